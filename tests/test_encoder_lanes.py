"""Encoder lanes (``indexer/encoder_lanes.py``): batches run several at once, results come back in order, errors
at their batch's turn, and closing early stops what has not started."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from moco_retrieval.contracts.images import walk_image_files
from moco_retrieval.indexer.embed import FolderEmbedder
from moco_retrieval.indexer.encoder import OnnxEncoder
from moco_retrieval.indexer.encoder_lanes import embed_in_order, lane_threads
from moco_retrieval.indexer.shards import WorkShards
from tests.index_fixtures import index_encoder, write_corpus  # noqa: F401 (fixture)


class SlowEncoder:
    """``embed`` sleeps ``delays[first pixel]`` seconds and returns the batch's first column as float32; records
    how many calls ran at once and which batches started."""

    def __init__(self, delays: dict[int, float], fail: int | None = None):
        self.delays, self.fail = delays, fail
        self.running = self.most = 0
        self.started: list[int] = []
        self.lock = threading.Lock()

    def embed(self, pixels: np.ndarray) -> np.ndarray:
        key = int(pixels[0, 0, 0, 0])
        with self.lock:
            self.started.append(key)
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(self.delays.get(key, 0.0))
            if key == self.fail:
                raise ValueError(f"batch {key} failed")
            return pixels[:, 0, 0, :1].astype(np.float32)
        finally:
            with self.lock:
                self.running -= 1


def _batches(n: int, none_at: tuple[int, ...] = ()):
    for i in range(n):
        yield i, None if i in none_at else np.full((2, 1, 1, 3), i, dtype=np.uint8)


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_embed_in_order__results_come_back_in_input_order_whatever_finishes_first(lanes):
    encoder = SlowEncoder({i: 0.05 if i % 2 == 0 else 0.0 for i in range(8)})  # even batches are slow

    got = list(embed_in_order(encoder.embed, _batches(8, none_at=(5,)), lanes))

    assert [tag for tag, _, _ in got] == list(range(8))
    for tag, vectors, seconds in got:
        if tag == 5:
            assert vectors is None and seconds == 0.0
        else:
            np.testing.assert_array_equal(vectors, np.full((2, 1), tag, dtype=np.float32))
            assert seconds >= (0.05 if tag % 2 == 0 else 0.0)
    assert encoder.most == lanes  # as many calls at once as lanes, never more


def test_embed_in_order__an_error_is_raised_at_its_batch_s_turn_after_the_earlier_results():
    encoder = SlowEncoder({}, fail=3)
    results = embed_in_order(encoder.embed, _batches(6), 2)

    assert [next(results)[0] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="batch 3 failed"):
        next(results)


def test_embed_in_order__closing_early_waits_for_running_calls_and_starts_no_more():
    encoder = SlowEncoder({i: 0.1 for i in range(20)})
    results = embed_in_order(encoder.embed, _batches(20), 2)

    assert next(results)[0] == 0
    results.close()

    assert encoder.running == 0  # the calls in flight finished before close returned
    started = len(encoder.started)
    time.sleep(0.15)
    assert len(encoder.started) == started <= 4  # the first, the two lanes, one more waiting at most


def test_lane_threads__splits_the_cores_between_lanes_and_never_goes_below_one():
    assert lane_threads(2, cores=2) == 1
    assert lane_threads(2, cores=16) == 8
    assert lane_threads(2, cores=1) == 1
    assert lane_threads(1, cores=4) == 4


def test_folder_embedder__two_lanes_store_what_one_lane_stores(index_encoder, tmp_path):
    """The real encoder on a folder with unreadable files, batches of 4 (several in flight): same entries, same
    vectors in the shards, whatever the lanes."""
    corpus = write_corpus(tmp_path / "images", per_class=4)
    entries = list(walk_image_files(tmp_path / "images"))
    encoder = OnnxEncoder(index_encoder, device="cpu", threads=1)
    stored = {}
    for lanes in (1, 2):
        shards = WorkShards(tmp_path / f"work{lanes}", encoder.sha256, encoder.embedding_dim, shard_size=5)
        stats = FolderEmbedder(encoder, tmp_path / "images", 4, 1, lanes).embed_into(entries, shards, False)
        assert stats["embedded"] == len(entries) and stats["encoder"] > 0
        shards.refresh()
        found = {e.path: shards.lookup(e.path, e.bytes, e.mtime_ns) for e in entries}
        stored[lanes] = {path: {k: v for k, v in entry.items() if k != "row"} for path, entry in found.items()}
        stored[lanes, "vectors"] = shards.vectors(corpus["good"])
    assert stored[1] == stored[2]
    assert sum(entry["error"] is not None for entry in stored[2].values()) == len(corpus["bad"])
    np.testing.assert_array_equal(stored[1, "vectors"], stored[2, "vectors"])
