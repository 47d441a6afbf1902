"""The Gradio web UI over a :class:`~serve.engine.SearchEngine`, mounted at ``/`` of the serving FastAPI app.

Drop, paste or shoot an image; get its nearest neighbours as a captioned gallery (score and label, path, id:
every line shown whole, in as many columns as the width allows) and the k-NN label vote as a chart (voted by
``EngineConfig.knn_k`` neighbours, the CLI's and the API's default). A min-score slider, a label picker and a
near-duplicates panel narrow or widen the answer. Clicking a result searches from that item and shows it as the
query image; a new upload
describes itself and clears the selection and the item id. Every handler has an explicit ``api_name``
(``search``, ``classify``, ``search_by_id``, ``select_result``, ``duplicates``, ``stats``) so ``gradio_client``
can call it (``search`` and ``search_by_id`` return the gallery as an update that also clears its selection);
errors show as ``gr.Error`` messages in the page. ``UI_CSS`` holds the page's own styles.

The UI gives Gradio no folder to serve from (no ``allowed_paths``): a gallery image or an example query is
a copy, in Gradio's own cache, of an indexed file read through the same check as the API's
``/api/items/{id}/image`` (:func:`serve.engine.SearchEngine.open_image`: still a regular file inside the
image folder, with the indexed size, mtime and sha256), made once per content (named by its sha256). Hidden
files, non-images and anything else that merely sits in the image folder are never reachable, and
``gradio_client`` downloads the results like any Gradio output.

What a client may hand the UI is as narrow (:func:`mount_ui`): an input file must be an upload in Gradio's
upload folder, never a path on the server (Gradio checks this only in apps it launched itself, so a mounted
app is marked as launched); the development route ``/gradio_api/dev/reload`` is removed; uploads are deleted
``UPLOAD_LIFETIME_S`` after they arrive and the oldest go first once they hold more than ``UPLOAD_CACHE_BYTES``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import gradio as gr
from fastapi import FastAPI

from moco_retrieval.contracts.atomic import atomic_write, check_writable
from moco_retrieval.contracts.encoder_format import model_label
from moco_retrieval.contracts.errors import MocoError
from moco_retrieval.contracts.filenames import display_name
from moco_retrieval.contracts.knn import SEARCH_K
from moco_retrieval.serve.answers import capped
from moco_retrieval.serve.engine import DUPLICATE_THRESHOLD, SearchEngine, SearchFilter

LOG = logging.getLogger(__name__)

UI_MAX_K = 100  # the slider's range; the JSON API allows up to the engine's max_k
# near-duplicates the panel shows, best first (a threshold of 0.95 on a weak model found 1,000 of 10,000 items:
# a 46,000-px page, every image copied into Gradio's cache); the summary line says how many there are
UI_DUPLICATES_SHOWN = 100
EXAMPLES = 6
UPLOAD_LIFETIME_S = 3600  # an upload is a query, needed for seconds; an hour covers a slow page
UPLOAD_CACHE_BYTES = 2 << 30  # all uploads kept at once, whoever sent them: 64 of the largest allowed
UPLOAD_SWEEP_S = 60  # how often both limits are applied
DEV_ROUTES = ("/gradio_api/dev/reload",)  # Gradio's live-reload stream: for `gradio app.py`, not production


# The page's own styles (Gradio's defaults, measured in headless Chromium over a 10,000-image index: a 28 px
# query preview, captions cut to "0.988 · sneaker · s…", 5 fixed columns showing 6 of 10 results on a phone).
UI_CSS = """
#query-image img { width: 100%; height: auto; min-height: 12rem; max-height: 20rem; object-fit: contain;
                   image-rendering: pixelated; }
#results .grid-wrap, #duplicates .grid-wrap { overflow-y: visible; height: auto !important; max-height: none !important; }
#results .grid-container, #duplicates .grid-container { grid-template-columns: repeat(auto-fill, minmax(8rem, 1fr)) !important;
                           grid-template-rows: none !important; grid-auto-rows: auto !important; }
#results .thumbnail-item, #duplicates .thumbnail-item { aspect-ratio: auto !important; height: auto !important; display: flex;
                           flex-direction: column; overflow: visible; }
#results .thumbnail-item img, #duplicates .thumbnail-item img { width: 100%; aspect-ratio: 1; height: auto; object-fit: cover;
                               image-rendering: pixelated; }
#results .caption-label, #duplicates .caption-label { position: static !important; max-width: none !important; white-space: pre-line !important;
                          overflow: visible !important; text-overflow: clip !important; overflow-wrap: anywhere;
                          border: none; border-top: 1px solid var(--border-color-primary); border-radius: 0;
                          font-size: var(--text-sm); line-height: 1.35; opacity: 1 !important; }
"""


def _caption(hit: dict) -> str:
    """Three lines, all of them shown (UI_CSS wraps them): score and label, the path, the id."""
    label = display_name(hit.get("label")) or "unlabeled"
    return f"{hit['score']:.3f} · {label}\n{display_name(hit['path'])}\nid {hit['id']}"


def ui_copy(engine: SearchEngine, record: dict, cache_dir: str | Path) -> Path | None:
    """The path of a copy of ``record``'s image in ``cache_dir`` (Gradio's cache), or ``None`` (logged) when its
    file is no longer the indexed one. The copy is made from the checked file and kept only when its sha256 is
    the record's; it is named by that sha256, so each content is copied once."""
    try:
        f, _, rec = engine.open_image(record["id"])
    except MocoError as exc:
        LOG.info("not showing item %d: %s", record["id"], exc)
        return None
    target = Path(cache_dir) / "moco-items" / rec["sha256"] / f"{rec['id']}{Path(display_name(rec['path'])).suffix}"
    with f:
        if target.is_file():
            return target
        digest = hashlib.sha256()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(target) as out:  # published only when the block ends without an exception
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                if digest.hexdigest() != rec["sha256"]:
                    raise _Changed
        except _Changed:
            LOG.info("not showing item %d: same size and mtime, other bytes than indexed", rec["id"])
            return None
        except (OSError, MocoError) as exc:  # a full or read-only cache: the search still answers
            LOG.warning("cannot copy item %d into %s: %s", rec["id"], cache_dir, exc)
            return None
    return target


def duplicates_summary(res, shown: int, threshold: float, max_k: int) -> str:
    """The line above the near-duplicates gallery: how many were found (``at least`` when the engine's ``max_k``
    cut the answer) and how many of them the gallery shows."""
    found = f"{'at least ' if capped(res.hits, max_k) else ''}{len(res.hits)}"
    line = (
        f"{found} near-duplicates of item {res.query['id']} (`{display_name(res.query['path'])}`) "
        f"at a score of {threshold:g} or more"
    )
    return line + (f"; the {shown} most similar shown" if shown < len(res.hits) else "")


def _about_upload(shown: int, min_score: float | None) -> str:
    above = "" if min_score is None or float(min_score) <= -1 else f" scoring at least {float(min_score):g}"
    return f"Searched from the uploaded image: {shown} results{above}."


class _Changed(Exception):
    """A copy whose bytes are not the indexed ones (raised inside its atomic write, so it is never published)."""


def _gallery(engine: SearchEngine, hits: list[dict], cache_dir: str) -> tuple[list[tuple[str, str]], list[dict]]:
    """``(gallery items, the hits they show)``: a checked copy of each hit's image and its caption; hits whose
    file is gone or changed are left out (so a click's index still names the right hit)."""
    items, shown = [], []
    for hit in hits:
        path = ui_copy(engine, hit, cache_dir)
        if path is not None:
            items.append((str(path), _caption(hit)))
            shown.append(hit)
    return items, shown


def _votes(probabilities: dict[str, float]) -> dict[str, float]:
    return {display_name(label): p for label, p in probabilities.items()}


def stats_markdown(stats: dict) -> str:
    """The index statistics panel: items, labels, model, index type, recall@10."""
    model, index = stats["model"], stats["index"]
    labels = stats["labels"]
    label_text = (
        ", ".join(f"{display_name(name)} ({n})" for name, n in labels.items()) if labels else "none (unlabeled corpus)"
    )
    recall = index.get("recall_at_10")
    return (
        f"**{stats['items']} items** · generation `{stats['generation']}` · updated {stats['updated_at']}  \n"
        f"**labels:** {label_text}  \n"
        f"**model:** {model_label(model)}, {model.get('image_size')} px, "
        f"{model.get('embedding_dim')}-d, `{model['sha256'][:12]}` on {model.get('provider')}  \n"
        f"**index:** `{index.get('factory')}` ({index.get('metric')}), recall@10 "
        f"{'n/a' if recall is None else f'{recall:.3f}'}"
    )


def build_ui(engine: SearchEngine) -> gr.Blocks:
    """The Gradio Blocks app for ``engine`` (not launched; mount it with :func:`mount_ui`)."""

    def _call(fn, *args):
        try:
            return fn(*args)
        except MocoError as exc:  # shown in the page; the app keeps running
            raise gr.Error(str(exc)) from exc

    knn_k = engine.config.knn_k  # the vote's k: the CLI's and the API's default too, so all three agree

    def _min_score(value: float | None) -> float | None:
        return None if value is None or float(value) <= -1 else float(value)

    def _filter(labels: list[str] | None) -> SearchFilter | None:
        return SearchFilter(labels=tuple(labels)) if labels else None

    def search(image: str | None, k: float, min_score: float | None = None, labels: list[str] | None = None):
        """Nearest neighbours of an uploaded image: (gallery, hits, query description, item id cleared)."""
        if not image:
            raise gr.Error("Upload, paste or take a picture first.")
        (res,) = _call(engine.search, [image], int(k), _min_score(min_score), _filter(labels))
        items, shown = _gallery(engine, res.hits, cache_dir)
        # a new gallery: nothing selected in it, and the page no longer describes the last clicked item
        return gr.Gallery(value=items, selected_index=None), shown, _about_upload(len(shown), min_score), None

    def classify(image: str | None):
        """k-NN label vote of an uploaded image (k = the engine's knn_k): {label: probability}."""
        if not image:
            raise gr.Error("Upload, paste or take a picture first.")
        if not engine.labels():  # an unlabeled corpus: no chart rather than an error
            return {}
        (res,) = _call(engine.classify, [image], knn_k)
        return _votes(res.probabilities)

    def select_result(hits: list[dict] | None, evt: gr.SelectData):
        """The id of the clicked gallery item."""
        if not hits or evt.index is None or evt.index >= len(hits):
            raise gr.Error("That result is no longer shown; search again.")
        return hits[evt.index]["id"]

    def search_by_id(item_id: float | None, k: float, min_score: float | None = None, labels: list[str] | None = None):
        """Neighbours of an indexed item: (gallery, hits, label chart, query description, the item's image for
        the query panel: the image searched from, not the last upload; empty when its file is gone)."""
        if item_id is None:
            raise gr.Error("Enter an item id, or click a search result.")
        res = _call(engine.search_by_id, int(item_id), int(k), _min_score(min_score), _filter(labels))
        q = res.query
        about = (
            f"Searched from item {q['id']}: `{display_name(q['path'])}` "
            f"(label {display_name(q.get('label')) or 'none'})"
        )
        chart = _votes(_call(engine.classify_by_id, int(item_id), knn_k).probabilities) if engine.labels() else {}
        items, shown = _gallery(engine, res.hits, cache_dir)
        query_copy = ui_copy(engine, q, cache_dir)
        return gr.Gallery(value=items, selected_index=None), shown, chart, about, query_copy and str(query_copy)

    def duplicates(item_id: float | None, threshold: float):
        """Near-duplicates of an indexed item: (gallery, summary)."""
        if item_id is None:
            raise gr.Error("Enter an item id, or click a search result.")
        res = _call(engine.duplicates, int(item_id), float(threshold))
        items, shown = _gallery(engine, res.hits[:UI_DUPLICATES_SHOWN], cache_dir)
        return items, duplicates_summary(res, len(shown), float(threshold), engine.config.max_k)

    def stats():
        return stats_markdown(_call(engine.stats))

    # delete_cache: Gradio deletes the uploads (and its own copies) older than UPLOAD_LIFETIME_S
    with gr.Blocks(title="moco-retrieval search", delete_cache=(UPLOAD_SWEEP_S, UPLOAD_LIFETIME_S)) as ui:
        cache_dir = ui.GRADIO_CACHE  # the folder Gradio serves its own files from
        examples = [
            [str(path)]
            for path in (ui_copy(engine, rec, cache_dir) for rec in engine.examples(EXAMPLES))
            if path is not None
        ]
        gr.Markdown(
            "# moco-retrieval: image search\nDrop, paste or shoot an image to find the most similar "
            "images of the index and a k-NN label vote. Click a result to search from it."
        )
        stats_box = gr.Markdown(elem_id="stats")
        with gr.Row():
            with gr.Column(scale=1):
                image = gr.Image(
                    type="filepath",
                    sources=["upload", "clipboard", "webcam"],
                    label="Query image",
                    elem_id="query-image",
                )
                k = gr.Slider(1, UI_MAX_K, value=SEARCH_K, step=1, label="k (neighbours)", elem_id="k")
                min_score = gr.Slider(
                    -1,
                    1,
                    value=-1,
                    step=0.01,
                    elem_id="min-score",
                    label="min score (all results at least this similar, up to k; -1: off)",
                )
                label_names = sorted(engine.labels())
                labels = gr.Dropdown(
                    label_names,
                    value=[],
                    multiselect=True,
                    elem_id="label-filter",
                    label="only these labels (none: all)",
                    visible=bool(label_names),
                )
                button = gr.Button("Search", variant="primary", elem_id="search-button")
                label = gr.Label(
                    num_top_classes=5, label=f"k-NN prediction ({knn_k} neighbours vote)", elem_id="prediction"
                )
                with gr.Row():
                    item_id = gr.Number(value=None, label="Item id", precision=0, elem_id="item-id")
                    by_id = gr.Button("Search from id")
                about = gr.Markdown(elem_id="about")
                if examples:
                    gr.Examples(examples=examples, inputs=[image], label="Examples from the index")
            with gr.Column(scale=2):
                # columns: UI_CSS makes them responsive (as many 8 rem columns as fit)
                gallery = gr.Gallery(
                    label="Nearest neighbours", columns=5, height="auto", elem_id="results", allow_preview=False
                )
                with gr.Accordion("Near-duplicates of an item", open=False, elem_id="duplicates-panel"):
                    threshold = gr.Slider(
                        0.5,
                        1.0,
                        value=DUPLICATE_THRESHOLD,
                        step=0.005,
                        elem_id="dup-threshold",
                        label="at least this similar",
                    )
                    dup_button = gr.Button("Find near-duplicates of the item id", elem_id="dup-button")
                    dup_about = gr.Markdown(elem_id="dup-about")
                    dup_gallery = gr.Gallery(
                        label="Near-duplicates", columns=4, height="auto", elem_id="duplicates", allow_preview=False
                    )
        hits = gr.State([])

        gr.on(
            [button.click, image.upload],
            search,
            inputs=[image, k, min_score, labels],
            outputs=[gallery, hits, about, item_id],
            api_name="search",
        )
        gr.on([button.click, image.upload], classify, inputs=[image], outputs=[label], api_name="classify")
        gallery.select(select_result, inputs=[hits], outputs=[item_id], api_name="select_result").then(
            search_by_id,
            inputs=[item_id, k, min_score, labels],
            outputs=[gallery, hits, label, about, image],
            api_name="search_by_id_clicked",
            api_visibility="private",
        )
        by_id.click(
            search_by_id,
            inputs=[item_id, k, min_score, labels],
            outputs=[gallery, hits, label, about, image],
            api_name="search_by_id",
        )
        dup_button.click(
            duplicates, inputs=[item_id, threshold], outputs=[dup_gallery, dup_about], api_name="duplicates"
        )
        ui.load(stats, outputs=[stats_box], api_name="stats")
    ui.queue(default_concurrency_limit=8)
    return ui


def mount_ui(
    app: FastAPI,
    engine: SearchEngine,
    path: str = "/",
    max_file_size: int | None = None,
    upload_cache_bytes: int = UPLOAD_CACHE_BYTES,
) -> FastAPI:
    """Mount the UI on ``app`` at ``path``. It serves no file of the image folder and reads no file of the server
    that a client names (see the module docstring); uploads over ``max_file_size`` bytes are refused (the API's
    upload limit, by default), and all uploads together are kept under ``upload_cache_bytes``."""
    from moco_retrieval.serve.http import MAX_UPLOAD_BYTES

    check_upload_folder()
    ui = build_ui(engine)
    app = gr.mount_gradio_app(
        app, ui, path=path, footer_links=["api"], css=UI_CSS, max_file_size=max_file_size or MAX_UPLOAD_BYTES
    )
    # hack: Gradio checks that an input file is an upload (processing_utils._check_allowed) only once
    # `has_launched` is set, which launch() does and mount_gradio_app does not; unset, a request naming
    # {"path": "/etc/passwd"} had the file copied into the cache and served back, and "/dev/zero" froze the loop.
    ui.has_launched = True
    app.add_middleware(_ClosedPaths, paths=tuple(path.rstrip("/") + route for route in DEV_ROUTES))
    app.add_middleware(_NotFoundInOurFormat)
    _start_upload_sweeper(ui, upload_cache_bytes)
    return app


def check_upload_folder() -> Path:
    """Gradio's upload folder (``GRADIO_TEMP_DIR``, else the system's temp folder), created and writable.

    Raises:
        OutputError: it cannot be written (read-only, not a folder, full).
    """
    from gradio.utils import get_upload_folder

    folder = Path(get_upload_folder())
    check_writable(
        folder,
        "the web app's upload folder",
        "set GRADIO_TEMP_DIR to a writable folder, or serve the API alone with --no-ui",
    )
    return folder


class _ClosedPaths:
    """Pure ASGI middleware: requests for ``paths`` answer 404 in the project's error format before any route
    sees them (Gradio registers its routes inside an included router that offers no public way to drop one)."""

    def __init__(self, app, paths: tuple[str, ...]):
        self.app, self.paths = app, frozenset(paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].rstrip("/") in self.paths:
            from fastapi.responses import JSONResponse

            await JSONResponse({"error": f"{scope['path']} is not served"}, status_code=404)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _NotFoundInOurFormat:
    """Pure ASGI middleware: a 404 that Gradio (or Starlette) answers as ``{"detail": ...}`` is sent in the
    project's error format, ``{"error": "<one line>"}``. Only 404s: Gradio's page reads ``detail`` of its other
    errors (a refused upload, a queue error), so those pass unchanged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: dict = {}

        async def rewriting_send(message):
            if message["type"] == "http.response.start" and message["status"] == 404:
                headers = dict(message.get("headers") or [])
                if headers.get(b"content-type", b"").startswith(b"application/json"):
                    held["start"], held["body"] = message, b""
                    return
            if "start" in held and message["type"] == "http.response.body":
                held["body"] += message.get("body", b"")
                if message.get("more_body"):
                    return
                await _send_json_404(send, held.pop("start"), held.pop("body"), scope["path"])
                return
            await send(message)

        await self.app(scope, receive, rewriting_send)


async def _send_json_404(send, start: dict, body: bytes, path: str) -> None:
    import json

    try:
        detail = json.loads(body)
    except ValueError:
        detail = None
    if isinstance(detail, dict) and set(detail) == {"detail"}:
        body = json.dumps({"error": f"{path} not found; the web app is at /, the API at /api (see /docs)"}).encode()
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def trim_uploads(files: set[str], max_bytes: int) -> int:
    """Delete the oldest of ``files`` (by ctime, as Gradio ages them) until the rest hold at most ``max_bytes``;
    deleted and vanished names leave ``files``. Returns the bytes deleted."""
    sized = []
    for name in list(files):  # a copy: the server adds uploads while this runs
        try:
            st = os.lstat(name)
        except FileNotFoundError:
            files.discard(name)
            continue
        sized.append((st.st_ctime, st.st_size, name))
    total, freed = sum(size for _, size, _ in sized), 0
    for _, size, name in sorted(sized):
        if total <= max_bytes:
            break
        try:
            os.remove(name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            LOG.warning("cannot delete upload %s: %s", name, exc)
            continue
        files.discard(name)
        total, freed = total - size, freed + size
    return freed


def _start_upload_sweeper(ui: gr.Blocks, max_bytes: int) -> None:
    def sweep():  # a daemon thread: it ends with the process
        while True:
            freed = trim_uploads(ui.upload_file_set, max_bytes)
            if freed:
                LOG.info("uploads over %d MiB: deleted the oldest %.1f MiB", max_bytes >> 20, freed / 2**20)
            time.sleep(UPLOAD_SWEEP_S)

    threading.Thread(target=sweep, name="moco-upload-sweeper", daemon=True).start()
