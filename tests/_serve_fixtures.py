"""Session fixtures of the serve tests (a plugin: test modules name it in ``pytest_plugins``): the colour
corpus, a random-init encoder exported to ONNX, a published index directory, an engine over it and a real
uvicorn server of the whole application. The helpers they use live in :mod:`tests._serve_helpers`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests._serve_helpers import (
    CORPUS_PER_CLASS,
    HELD_OUT_PER_CLASS,
    RunningServer,
    build_index,
    export_random_encoder,
    write_colour_corpus,
)


@pytest.fixture(scope="session")
def serve_corpus(tmp_path_factory) -> Path:
    """4 colour classes x 12 generated 32 px images, one subfolder per class (the labels)."""
    return write_colour_corpus(tmp_path_factory.mktemp("serve") / "corpus", CORPUS_PER_CLASS, seed=11)


@pytest.fixture(scope="session")
def held_out(tmp_path_factory) -> Path:
    """Other images of the same classes (another seed), never indexed."""
    return write_colour_corpus(tmp_path_factory.mktemp("serve") / "held_out", HELD_OUT_PER_CLASS, seed=12)


@pytest.fixture(scope="session")
def encoder_onnx(tmp_path_factory) -> Path:
    return export_random_encoder(tmp_path_factory.mktemp("serve_model"))


@pytest.fixture(scope="session")
def served_index(tmp_path_factory, serve_corpus, encoder_onnx) -> Path:
    """A published index directory over ``serve_corpus`` (read-only for tests; copy it to modify)."""
    out = tmp_path_factory.mktemp("serve_index") / "index"
    build_index(serve_corpus, encoder_onnx, out)
    return out


@pytest.fixture
def private_index(tmp_path, serve_corpus, encoder_onnx):
    """``(corpus copy, index dir)`` owned by one test, free to re-index."""
    corpus = tmp_path / "corpus"
    shutil.copytree(serve_corpus, corpus)
    out = tmp_path / "index"
    build_index(corpus, encoder_onnx, out)
    return corpus, out


@pytest.fixture(scope="session")
def served_engine(served_index):
    """One engine over ``served_index`` shared by the tests (CPU, one encoder thread, no watcher)."""
    from moco_retrieval.serve.engine import EngineConfig, SearchEngine

    engine = SearchEngine(served_index, EngineConfig(device="cpu", threads=1, poll_seconds=0))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def live_server(served_engine):
    """The whole application (JSON API + Gradio UI at /) served by uvicorn over ``served_index``."""
    from moco_retrieval.app.server import make_app

    server = RunningServer(make_app(served_engine))
    yield server
    server.stop()
