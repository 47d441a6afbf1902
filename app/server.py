"""Running the whole serving application: the JSON API from :mod:`serve.http` with the Gradio UI mounted at
``/``, on uvicorn. Used by ``moco serve`` and the last step of ``moco demo``.
"""
from __future__ import annotations

import errno
import logging
import socket
import threading
import time

from fastapi import FastAPI

from contracts.errors import ConfigError
from serve.engine import SearchEngine

LOG = logging.getLogger(__name__)


def make_app(engine: SearchEngine, ui: bool = True) -> FastAPI:
    """The FastAPI app for ``engine``: JSON API under ``/api``, OpenAPI page at ``/docs``, Gradio UI at ``/``."""
    from serve.http import create_app

    app = create_app(engine)
    if ui:
        from app.gradio_app import mount_ui

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


def serve_forever(engine: SearchEngine, host: str = "127.0.0.1", port: int = 7860, ui: bool = True) -> None:
    """Serve ``engine`` until Ctrl-C (or SIGTERM); prints the URL once the server listens."""
    import uvicorn

    check_port(host, port)
    app = make_app(engine, ui=ui)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{port}/"

    def announce():  # printed only once uvicorn is actually listening
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            print(f"serving {engine.index_dir} (generation {engine.generation}) at {url}  (API docs: {url}docs; "
                  "Ctrl-C stops)", flush=True)

    threading.Thread(target=announce, name="moco-announce", daemon=True).start()
    server.run()
