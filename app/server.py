"""Running the whole serving application: the JSON API from :mod:`serve.http` with the Gradio UI mounted at
``/``, on uvicorn. Used by ``moco serve`` and the last step of ``moco demo``.

``moco serve --workers N`` runs N uvicorn worker processes on one listening socket (uvicorn's own
multiprocess supervisor; the kernel spreads connections over them). Each worker opens its own engine over the
index directory: the FAISS index is memory-mapped (:mod:`indexer.index_dir`), so the workers share its pages
instead of holding N copies, and each one watches ``CURRENT`` and hot-swaps on its own. Every response says
which worker answered in the ``X-Moco-Worker`` header (its process id).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import socket
import tempfile
import threading
import time

from fastapi import FastAPI

from moco_retrieval.app.http_protocol import uvicorn_options
from moco_retrieval.contracts.errors import ConfigError
from moco_retrieval.serve.engine import EngineConfig, SearchEngine

LOG = logging.getLogger(__name__)


def make_app(engine: SearchEngine, ui: bool = True, metrics: bool = True) -> FastAPI:
    """The FastAPI app for ``engine``: JSON API under ``/api``, OpenAPI page at ``/docs``, Prometheus metrics at
    ``/metrics`` (unless ``metrics`` is off), Gradio UI at ``/``."""
    from moco_retrieval.serve.http import create_app

    app = create_app(engine, metrics=metrics)
    pid = str(os.getpid())

    @app.middleware("http")
    async def _worker_header(request, call_next):
        response = await call_next(request)
        response.headers["X-Moco-Worker"] = pid
        return response

    if ui:
        from moco_retrieval.app.gradio_app import mount_ui

        app = mount_ui(app, engine)
    return app


def check_port(host: str, port: int) -> None:
    """Fail early, in one line, when ``host:port`` cannot be listened on.

    Raises:
        ConfigError: port out of range, already in use, or the host is not an address of this machine.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be 0-65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} is not a usable address ({exc.strerror})") from exc
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {host} is already in use; choose another with --port") from exc
            raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --host/--port") from exc


def serve_forever(
    engine: SearchEngine, host: str = "127.0.0.1", port: int = 7860, ui: bool = True, metrics: bool = True
) -> None:
    """Serve ``engine`` until Ctrl-C (or SIGTERM); prints the URL once the server listens."""
    import uvicorn

    check_port(host, port)
    app = make_app(engine, ui=ui, metrics=metrics)
    config = uvicorn.Config(app, host=host, port=port, **uvicorn_options())
    server = uvicorn.Server(config)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{port}/"

    def announce():  # printed only once uvicorn is actually listening
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            print(
                f"serving {engine.index_dir} (generation {engine.generation}) at {url}  (API docs: {url}docs; "
                "Ctrl-C stops)",
                flush=True,
            )

    threading.Thread(target=announce, name="moco-announce", daemon=True).start()
    server.run()


WORKER_CONFIG_ENV = "MOCO_SERVE_WORKER"  # how the parent hands each spawned worker its configuration


def worker_app() -> FastAPI:
    """The uvicorn app factory of one ``--workers`` process: its own engine over the index directory."""
    cfg = json.loads(os.environ[WORKER_CONFIG_ENV])
    from moco_retrieval.app.cli import setup_logging

    setup_logging(cfg.get("log_level", logging.INFO))
    engine = SearchEngine(cfg["index_dir"], EngineConfig(**cfg["engine"]))
    return make_app(engine, ui=cfg["ui"], metrics=cfg.get("metrics", True))


def serve_workers(
    index_dir: str,
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 7860,
    ui: bool = True,
    workers: int = 2,
    metrics: bool = True,
) -> None:
    """Serve ``index_dir`` with ``workers`` processes until Ctrl-C (or SIGTERM); prints the URL once they answer.

    Raises:
        ConfigError: fewer than 1 worker, or the port cannot be listened on.
    """
    import urllib.request

    import uvicorn

    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    check_port(host, port)
    os.environ[WORKER_CONFIG_ENV] = json.dumps(
        {
            "index_dir": str(index_dir),
            "engine": dataclasses.asdict(config),
            "ui": ui,
            "log_level": logging.getLogger().getEffectiveLevel(),
            "metrics": metrics,
        }
    )
    from moco_retrieval.serve.metrics import MULTIPROC_ENV

    # the workers' metrics meet in files here (prometheus_client's multiprocess mode), so any worker reports all
    samples = tempfile.TemporaryDirectory(prefix="moco-metrics-")
    os.environ[MULTIPROC_ENV] = samples.name
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{port}/"
    stop = threading.Event()

    def announce():  # printed once a worker answers
        while not stop.is_set():
            try:
                with urllib.request.urlopen(url + "api/health", timeout=2) as reply:
                    generation = json.loads(reply.read())["generation"]
                print(
                    f"serving {index_dir} (generation {generation}) at {url} with {workers} workers  (API docs: "
                    f"{url}docs; Ctrl-C stops)",
                    flush=True,
                )
                return
            except OSError:
                time.sleep(0.1)

    threading.Thread(target=announce, name="moco-announce", daemon=True).start()
    try:
        uvicorn.run(
            "moco_retrieval.app.server:worker_app",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            **uvicorn_options(),
        )
    finally:
        stop.set()
        samples.cleanup()
