"""The HTTP JSON API over a :class:`~serve.engine.SearchEngine`, as a FastAPI application.

Endpoints (all under ``/api``; the OpenAPI page is ``/docs``)::

    POST /api/search              multipart field ``image`` (repeat it: a batch); ``k``, ``min_score`` -> neighbours
    POST /api/search/ids          JSON ``{"ids": [...]}``; ``k``, ``min_score``  -> neighbours of each item
    POST /api/classify            multipart field ``image``; ``k``, ``temperature`` -> k-NN label vote
    GET  /api/items/{id}          the item's record
    GET  /api/items/{id}/image    the item's image file
    GET  /api/items/{id}/neighbors?k=&min_score=   neighbours of an indexed item
    GET  /api/items/{id}/duplicates?threshold=   its near-duplicates (every item at least that similar)
    GET  /api/health              liveness and the live generation
    GET  /api/stats               items, labels, model, index type, recall@10

Every error is JSON ``{"error": "<one line>"}`` with the status of its :class:`~contracts.errors.MocoError`
(400 bad input, 404 unknown id or endpoint, 405 wrong method (with ``Allow``), 409 index/model problem, 410 an
item's file no longer the indexed one, 413 upload too large, 422 malformed request); an unexpected exception
answers 500 with no traceback (the traceback goes to the server log).

Hostile requests: a body over the upload limit is refused with 413 while it streams in, whatever its headers
say (chunked bodies included), so no more than the limit is ever read or spooled (:class:`UploadLimit`);
decoding happens off the event loop, at most ``decode_slots`` at once (:mod:`serve.engine`); an item's image
is served only while it is still the indexed file (:mod:`serve.files`). File names are shown readably
(:func:`contracts.filenames.display_name`: bytes that are not UTF-8 as ``\\xNN``) in ``path`` and ``label``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mimetypes
import os

from fastapi import Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from moco_retrieval.contracts.errors import DataError, MocoError, UploadTooLargeError
from moco_retrieval.contracts.filenames import display_name
from moco_retrieval.contracts.knn import KNN_K, KNN_TEMPERATURE
from moco_retrieval.serve.answers import (
    Hit,
    Item,
    batch_answer,
    classify_answer,
    duplicates_answer,
    item_record,
    search_answer,
)
from moco_retrieval.serve.engine import DUPLICATE_THRESHOLD, EngineConfig, SearchEngine

LOG = logging.getLogger(__name__)

MAX_UPLOAD_BYTES = 32 << 20  # an upload larger than this is refused with 413 before it is decoded
MULTIPART_ROOM = 64 << 10  # a request body may exceed the upload limit by this much: the multipart framing
# Upload bytes held in memory at once by all requests of a process (8 of the largest). Starlette spools each upload
# to disk past 1 MiB while it arrives; reading it for the decode is what holds memory, so a request past this
# waits for others to finish (measured before: 100 concurrent 31 MiB uploads took RSS from 591 MB to 2,249 MB).
UPLOAD_BYTES_IN_FLIGHT = 256 << 20


# -- response schemas (for the OpenAPI page; the records' own are serve/answers.py's) ---------------------------
class SearchResponse(BaseModel):
    generation: str
    k: int
    min_score: float | None = None
    capped: bool = False  # a threshold search that returned k hits: more items may score above min_score
    results: list[Hit]
    timings: dict[str, float]
    batch_size: int
    query: Item | None = None


class BatchSearchResponse(BaseModel):
    generation: str
    k: int
    min_score: float | None = None
    responses: list[SearchResponse]


class IdsRequest(BaseModel):
    ids: list[int]


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


_ERRORS = {status: {"model": ErrorBody} for status in (400, 404, 409, 410, 413, 422)}
K_HELP = "number of neighbours, 1 to the server's max_k (default 10; with min_score, max_k)"
MIN_SCORE_HELP = "keep only neighbours with a cosine similarity of at least this, from -1 to 1 (all of them, up to k)"


class FilterParams:
    """The filter query parameters every search route takes (``label`` and ``exclude`` repeatable)."""

    def __init__(
        self,
        label: list[str] | None = Query(None, description="only items with this label; repeat for several"),
        path_prefix: str | None = Query(
            None, description="only items whose relative path starts with this (a folder: `shoes/`)"
        ),
        min_width: int | None = Query(None, description="only images at least this wide (pixels)"),
        max_width: int | None = Query(None, description="only images at most this wide (pixels)"),
        min_height: int | None = Query(None, description="only images at least this tall (pixels)"),
        max_height: int | None = Query(None, description="only images at most this tall (pixels)"),
        exclude: list[int] | None = Query(None, description="never these item ids; repeatable"),
    ):
        self.values = dict(
            labels=tuple(label or ()),
            path_prefix=path_prefix,
            min_width=min_width,
            max_width=max_width,
            min_height=min_height,
            max_height=max_height,
            exclude=tuple(exclude or ()),
        )

    def filter(self, form_labels: list[str] | None = None):
        """The :class:`~serve.engine.SearchFilter` (labels of the form field too), or ``None`` when empty.

        Raises:
            ConfigError: a size range that cannot hold anything, a negative size."""
        from moco_retrieval.serve.engine import SearchFilter

        values = dict(self.values, labels=self.values["labels"] + tuple(form_labels or ()))
        flt = SearchFilter(**values)
        return flt or None


def _too_large_message(limit: int) -> str:
    return f"upload is larger than {limit >> 20} MiB; send a smaller image"


class UploadLimit:
    """ASGI middleware: refuse a request body over ``limit`` bytes with 413, counting the bytes as they arrive.

    A declared ``Content-Length`` over the limit is refused before the body is read; otherwise (chunked
    bodies, or a length that lies) the body is counted while the application reads it, and the read that
    passes the limit fails: the application's answer to that failure is dropped and the 413 sent instead. So
    at most ``limit`` bytes are ever read, buffered or spooled to disk, whatever the headers say.
    """

    def __init__(self, app, limit: int, message: str):
        self.app = app
        self.limit = limit
        self.message = message

    async def _refuse(self, send) -> None:
        body = JSONResponse({"error": self.message}, status_code=413, headers={"Connection": "close"})
        await send({"type": "http.response.start", "status": 413, "headers": body.raw_headers})
        await send({"type": "http.response.body", "body": body.body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return await self._refuse(send)
        received, refused, started = 0, False, False

        async def counting_receive():
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    refused = True
                    raise UploadTooLargeError(self.message)
            return message

        async def guarded_send(message):
            nonlocal started
            if refused:  # the application's answer to the failed read
                return
            started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not refused:
                raise
        if refused and not started:
            await self._refuse(send)


class ByteBudget:
    """At most ``limit`` bytes held at once by the requests of one process: a request that would pass it waits
    until others release theirs (one larger than the whole budget runs alone)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def hold(self, n: int):
        async with self._changed:
            await self._changed.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
        try:
            yield
        finally:
            async with self._changed:
                self.used -= n
                self._changed.notify_all()


async def _read_upload(image: UploadFile, limit: int) -> bytes:
    data = await image.read(limit + 1)
    if len(data) > limit:
        raise UploadTooLargeError(_too_large_message(limit))
    if not data:
        raise DataError("the uploaded file is empty; send an image file in the form field 'image'")
    return data


SMALL_FILE_BYTES = 8 << 20  # item images up to this size are sent from one read; larger ones are streamed


def _chunks(f, size: int = 1 << 20):
    """The bytes of the open file ``f`` in chunks, closing it at the end (or when the client goes away)."""
    with f:
        while chunk := f.read(size):
            yield chunk


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
        return JSONResponse(
            {"error": f"internal error ({type(exc).__name__}); the server log has the details"}, status_code=500
        )


def create_app(
    engine: SearchEngine | str | os.PathLike,
    max_upload_bytes: int = MAX_UPLOAD_BYTES,
    upload_bytes_in_flight: int = UPLOAD_BYTES_IN_FLIGHT,
    metrics: bool = True,
) -> FastAPI:
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

    from fastapi_offline import FastAPIOffline

    from moco_retrieval import __version__

    # FastAPIOffline: FastAPI whose /docs and /redoc pages load their scripts from this server, not from a CDN
    # (blank pages on an air-gapped host otherwise)
    app = FastAPIOffline(
        title="moco-retrieval",
        version=__version__,  # the package's: the API is versioned with it
        summary="Nearest-neighbour image search and k-NN classification over a `moco index` directory.",
        description="Upload an image to `/api/search` (multipart field `image`) to get the most similar "
        "images of the corpus, or to `/api/classify` for a label voted by its labeled neighbours. "
        'Errors are JSON `{"error": "..."}`.',
        lifespan=lifespan,
    )
    app.state.engine = engine
    add_error_handlers(app)

    app.add_middleware(
        UploadLimit, limit=max_upload_bytes + MULTIPART_ROOM, message=_too_large_message(max_upload_bytes)
    )
    uploads = ByteBudget(upload_bytes_in_flight)
    app.state.uploads = uploads
    observe = None
    if metrics:
        from moco_retrieval.serve.metrics import RequestMetrics, ServeMetrics

        served = ServeMetrics(engine)
        observe = served.observe_phases
        app.add_middleware(RequestMetrics, metrics=served)

        @app.get("/metrics", response_class=Response, tags=["service"])
        def metrics_text():
            """Prometheus metrics: requests and latency by route, the engine's phase times, the batcher's queue
            depth, the live generation and the encoder (every worker's under --workers)."""
            body, content_type = served.exposition()
            return Response(body, media_type=content_type)

    @app.post("/api/search", response_model=SearchResponse | BatchSearchResponse, responses=_ERRORS, tags=["search"])
    async def search(
        image: list[UploadFile] = File(
            ..., description="the query image (JPEG, PNG, WebP, ...); repeat the field for a batch, answered in order"
        ),
        k: int | None = Query(None, description=K_HELP),
        min_score: float | None = Query(None, description=MIN_SCORE_HELP),
        filters: FilterParams = Depends(),
        label: list[str] | None = Form(
            None, description="only items with this label (a form field, as the query parameter `label`); repeatable"
        ),
    ):
        """The `k` indexed images most similar to the uploaded one, best first (cosine similarity); with
        `min_score`, every one at least that similar (up to `k`); with filters, only the items they allow.
        Several `image` fields: a batch, answered as `responses` in request order (at most the server's
        max_queries)."""
        k = engine.resolve_k(k, min_score)
        flt = filters.filter(label)
        engine.check_batch(len(image), "images")
        held = sum(f.size or max_upload_bytes for f in image)
        async with uploads.hold(held):  # the bytes live until the search is done
            data = [await _read_upload(f, max_upload_bytes) for f in image]
            results = await engine.search_async(data, k, min_score, flt)
        if observe is not None:
            for res in results:
                observe(res.timings)
        if len(results) == 1:
            return search_answer(results[0], k, min_score)
        return batch_answer(results, k, min_score)

    @app.post("/api/search/ids", response_model=BatchSearchResponse, responses=_ERRORS, tags=["search"])
    def search_ids(
        body: IdsRequest,
        k: int | None = Query(None, description=K_HELP),
        min_score: float | None = Query(None, description=MIN_SCORE_HELP),
        filters: FilterParams = Depends(),
    ):
        """The neighbours of several indexed items (JSON body `{"ids": [...]}`, each item itself left out),
        answered as `responses` in the order of the ids (at most the server's max_queries)."""
        results = engine.search_by_ids(body.ids, k, min_score, filters.filter())
        return batch_answer(results, engine.resolve_k(k, min_score), min_score)

    @app.post("/api/classify", response_model=ClassifyResponse, responses=_ERRORS, tags=["search"])
    async def classify(
        image: UploadFile = File(..., description="the image to classify"),
        k: int | None = Query(
            None, description=f"neighbours that vote (default: the server's --knn-k, {KNN_K} unless set)"
        ),
        temperature: float = Query(KNN_TEMPERATURE, description="vote weight exp(score / T)"),
    ):
        """k-NN classification: labeled neighbours vote with weight exp(score / temperature)."""
        k = engine.config.knn_k if k is None else k
        async with uploads.hold(image.size or max_upload_bytes):
            data = await _read_upload(image, max_upload_bytes)
            (res,) = await engine.classify_async([data], k, temperature)
        if observe is not None:
            observe(res.timings)
        return classify_answer(res, k, temperature)

    @app.get("/api/items/{item_id}", response_model=Item, responses=_ERRORS, tags=["items"])
    def item(item_id: int):
        """An indexed item's record: relative path, label, size, sha256, duplicate_of."""
        return item_record(engine.item(item_id))

    @app.get("/api/items/{item_id}/image", responses=_ERRORS, response_class=Response, tags=["items"])
    def item_image(item_id: int):
        """An indexed item's image file, as stored; 410 when the file is no longer the one indexed (deleted,
        replaced, changed, or now resolving outside the image folder)."""
        f, st, rec = engine.open_image(item_id)
        media_type = mimetypes.guess_type(display_name(rec["path"]))[0] or "application/octet-stream"
        headers = {"Content-Length": str(st.st_size), "Cache-Control": "no-cache"}
        if st.st_size <= SMALL_FILE_BYTES:  # the usual case: one read, no streaming machinery
            with f:
                return Response(f.read(), media_type=media_type, headers=headers)
        return StreamingResponse(_chunks(f), media_type=media_type, headers=headers)

    @app.get("/api/items/{item_id}/neighbors", response_model=SearchResponse, responses=_ERRORS, tags=["items"])
    def neighbors(
        item_id: int,
        k: int | None = Query(None, description=K_HELP),
        min_score: float | None = Query(None, description=MIN_SCORE_HELP),
        filters: FilterParams = Depends(),
    ):
        """The `k` items most similar to an indexed item (the item itself left out); with `min_score`, every one
        at least that similar (up to `k`); with filters, only the items they allow."""
        res = engine.search_by_id(item_id, k, min_score, filters.filter())
        return search_answer(res, engine.resolve_k(k, min_score), min_score)

    @app.get("/api/items/{item_id}/duplicates", responses=_ERRORS, tags=["items"])
    def duplicates(
        item_id: int,
        threshold: float = Query(
            DUPLICATE_THRESHOLD, description="cosine similarity at which two images count as duplicates, -1 to 1"
        ),
    ):
        """The near-duplicates of an indexed item: every other item at least `threshold` similar (re-encodes,
        crops, resizes, copies), best first, at most the server's max_k (`capped` true when that many came
        back); `moco duplicates` groups the whole index the same way."""
        return duplicates_answer(engine.duplicates(item_id, threshold), threshold, engine.config.max_k)

    @app.get("/api/health", response_model=Health, tags=["service"])
    def health():
        """Liveness: the live index generation and its item count."""
        stats = engine.stats()
        return {"status": "ok", "generation": stats["generation"], "items": stats["items"]}

    @app.get("/api/stats", tags=["service"])
    def stats():
        """Items, labels with counts, model, index type and measured recall@10, queries served."""
        stats = engine.stats()
        return dict(stats, labels={display_name(label): n for label, n in stats["labels"].items()})

    @app.api_route(
        "/api/{rest:path}",
        methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"],
        include_in_schema=False,
    )
    def unknown_endpoint(request: Request, rest: str):
        # registered last: keeps unknown /api/ paths from falling through to the UI mounted at "/"
        path = request.url.path
        allowed = sorted(
            {
                m
                for r in app.router.routes
                if isinstance(r, APIRoute) and r.endpoint is not unknown_endpoint and r.path_regex.match(path)
                for m in r.methods
            }
        )
        if allowed:  # a real endpoint, asked with another method
            raise StarletteHTTPException(
                405,
                f"{request.method} is not allowed on {path}; use {' or '.join(allowed)}",
                headers={"Allow": ", ".join(allowed)},
            )
        raise StarletteHTTPException(404, f"no endpoint /api/{rest}; see /docs for the API")

    return app
