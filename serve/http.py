"""The HTTP JSON API over a :class:`~serve.engine.SearchEngine`, as a FastAPI application.

Endpoints (all under ``/api``; the OpenAPI page is ``/docs``)::

    POST /api/search              multipart field ``image``; query ``k``      -> neighbours
    POST /api/classify            multipart field ``image``; ``k``, ``temperature`` -> k-NN label vote
    GET  /api/items/{id}          the item's record
    GET  /api/items/{id}/image    the item's image file
    GET  /api/items/{id}/neighbors?k=   neighbours of an indexed item
    GET  /api/health              liveness and the live generation
    GET  /api/stats               items, labels, model, index type, recall@10

Every error is JSON ``{"error": "<one line>"}`` with the status of its :class:`~contracts.errors.MocoError`
(400 bad input, 404 unknown id, 409 index/model problem, 413 upload too large, 422 malformed request);
an unexpected exception answers 500 with no traceback (the traceback goes to the server log).
"""
from __future__ import annotations

import logging
import mimetypes
import os

from fastapi import FastAPI, File, Query, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from contracts.errors import DataError, MocoError, UploadTooLargeError
from contracts.knn import KNN_K, KNN_TEMPERATURE, SEARCH_K
from serve.engine import EngineConfig, SearchEngine

LOG = logging.getLogger(__name__)

MAX_UPLOAD_BYTES = 32 << 20  # an upload larger than this is refused with 413 before it is decoded


# -- response schemas (for the OpenAPI page; records may carry more fields) -----------------------------------
class _Record(BaseModel):
    id: int
    path: str
    label: str | None = None
    width: int | None = None
    height: int | None = None
    bytes: int | None = None
    sha256: str | None = None
    duplicate_of: int | None = None
    image_url: str


class Hit(_Record):
    score: float


class Item(_Record):
    mtime: float | None = None


class SearchResponse(BaseModel):
    generation: str
    k: int
    results: list[Hit]
    timings: dict[str, float]
    batch_size: int
    query: Item | None = None


class ClassifyResponse(BaseModel):
    generation: str
    k: int
    temperature: float
    label: str | None
    probabilities: dict[str, float]
    neighbors: list[Hit]
    timings: dict[str, float]


class Health(BaseModel):
    status: str
    generation: str
    items: int


class ErrorBody(BaseModel):
    error: str


_ERRORS = {status: {"model": ErrorBody} for status in (400, 404, 409, 413, 422)}


def _with_url(record: dict) -> dict:
    return dict(record, image_url=f"/api/items/{record['id']}/image")


async def _read_upload(image: UploadFile, limit: int) -> bytes:
    data = await image.read(limit + 1)
    if len(data) > limit:
        raise UploadTooLargeError(f"upload is larger than {limit >> 20} MiB; send a smaller image")
    if not data:
        raise DataError("the uploaded file is empty; send an image file in the form field 'image'")
    return data


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path"))
        msg = err.get("msg", "invalid")
        if where == "image" and err.get("type") == "missing":
            msg = "missing; upload the image as the multipart form field 'image'"
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "malformed request"


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error as ``{"error": ...}``: MocoError by its http_status, validation 422, others 500."""

    @app.exception_handler(MocoError)
    async def _moco_error(request: Request, exc: MocoError):
        return JSONResponse({"error": str(exc)}, status_code=exc.http_status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return JSONResponse({"error": _validation_message(exc)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        LOG.exception("unexpected error answering %s %s", request.method, request.url.path)
        return JSONResponse({"error": f"internal error ({type(exc).__name__}); the server log has the details"},
                            status_code=500)


def create_app(engine: SearchEngine | str | os.PathLike, max_upload_bytes: int = MAX_UPLOAD_BYTES) -> FastAPI:
    """The FastAPI application serving ``engine`` (or a new engine over an index directory path).

    An engine created here is closed when the application shuts down; a passed-in engine stays the caller's.
    The Gradio UI is not part of this app: ``app.gradio_app`` mounts it at ``/``.
    """
    owned = not isinstance(engine, SearchEngine)
    if owned:
        engine = SearchEngine(engine, EngineConfig())

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        if owned:
            engine.close()

    app = FastAPI(
        title="moco-retrieval",
        summary="Nearest-neighbour image search and k-NN classification over a `moco index` directory.",
        description="Upload an image to `/api/search` (multipart field `image`) to get the most similar "
                    "images of the corpus, or to `/api/classify` for a label voted by its labeled neighbours. "
                    "Errors are JSON `{\"error\": \"...\"}`.",
        version="1", lifespan=lifespan,
    )
    app.state.engine = engine
    add_error_handlers(app)

    @app.middleware("http")
    async def _refuse_large_bodies(request: Request, call_next):
        length = request.headers.get("content-length")
        if request.url.path.startswith("/api/") and length and length.isdigit() \
                and int(length) > max_upload_bytes + (64 << 10):  # + room for the multipart framing
            return JSONResponse({"error": f"upload is larger than {max_upload_bytes >> 20} MiB; send a smaller "
                                          "image"}, status_code=413)
        return await call_next(request)

    @app.post("/api/search", response_model=SearchResponse, responses=_ERRORS, tags=["search"])
    async def search(image: UploadFile = File(..., description="the query image (JPEG, PNG, WebP, ...)"),
                     k: int = Query(SEARCH_K, description="number of neighbours, 1 to the server's max_k")):
        """The `k` indexed images most similar to the uploaded one, best first (cosine similarity)."""
        data = await _read_upload(image, max_upload_bytes)
        (res,) = await run_in_threadpool(engine.search, [data], k)
        return {"generation": res.generation, "k": k, "results": [_with_url(h) for h in res.hits],
                "timings": res.timings, "batch_size": res.batch_size}

    @app.post("/api/classify", response_model=ClassifyResponse, responses=_ERRORS, tags=["search"])
    async def classify(image: UploadFile = File(..., description="the image to classify"),
                       k: int = Query(KNN_K, description="neighbours that vote"),
                       temperature: float = Query(KNN_TEMPERATURE, description="vote weight exp(score / T)")):
        """k-NN classification: labeled neighbours vote with weight exp(score / temperature)."""
        data = await _read_upload(image, max_upload_bytes)
        (res,) = await run_in_threadpool(engine.classify, [data], k, temperature)
        return {"generation": res.generation, "k": k, "temperature": temperature, "label": res.label,
                "probabilities": res.probabilities, "neighbors": [_with_url(h) for h in res.neighbors],
                "timings": res.timings}

    @app.get("/api/items/{item_id}", response_model=Item, responses=_ERRORS, tags=["items"])
    def item(item_id: int):
        """An indexed item's record: relative path, label, size, sha256, duplicate_of."""
        return _with_url(engine.item(item_id))

    @app.get("/api/items/{item_id}/image", responses=_ERRORS, response_class=FileResponse, tags=["items"])
    def item_image(item_id: int):
        """An indexed item's image file, as stored."""
        path, _ = engine.image_file(item_id)
        media_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return FileResponse(path, media_type=media_type)

    @app.get("/api/items/{item_id}/neighbors", response_model=SearchResponse, responses=_ERRORS, tags=["items"])
    def neighbors(item_id: int, k: int = Query(SEARCH_K, description="number of neighbours")):
        """The `k` items most similar to an indexed item (the item itself left out)."""
        res = engine.search_by_id(item_id, k)
        return {"generation": res.generation, "k": k, "results": [_with_url(h) for h in res.hits],
                "timings": res.timings, "batch_size": res.batch_size, "query": _with_url(res.query)}

    @app.get("/api/health", response_model=Health, tags=["service"])
    def health():
        """Liveness: the live index generation and its item count."""
        stats = engine.stats()
        return {"status": "ok", "generation": stats["generation"], "items": stats["items"]}

    @app.get("/api/stats", tags=["service"])
    def stats():
        """Items, labels with counts, model, index type and measured recall@10, queries served."""
        return engine.stats()

    @app.api_route("/api/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    def unknown_endpoint(rest: str):
        # registered last: keeps unknown /api/ paths from falling through to the UI mounted at "/"
        raise StarletteHTTPException(404, f"no endpoint /api/{rest}; see /docs for the API")

    return app
