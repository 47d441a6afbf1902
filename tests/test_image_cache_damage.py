"""A damaged image cache (trainer.image_cache, trainer.cache_checksums) is found and repaired, never trusted: a
truncated rows file and garbled rows are decoded again (one warning line), a cache written before checksums is
used and gets them, and each threshold (block size, sample size) is crossed with lowered parameters on a few
40 px rows (4,800 bytes each)."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
from PIL import Image

from moco_retrieval.contracts.images import decode_image, walk_image_files
from moco_retrieval.trainer import cache_checksums, image_cache
from moco_retrieval.trainer.cache_checksums import RowChecksums
from moco_retrieval.trainer.demo_data import write_demo_dataset
from moco_retrieval.trainer.image_cache import INDEX_FILE, ImageCache

ROW = 40 * 40 * 3


@pytest.fixture
def decodes(monkeypatch) -> list[str]:
    seen = []
    real = image_cache.decode_to_side

    def counting(path, side):
        seen.append(os.path.basename(path))
        return real(path, side)

    monkeypatch.setattr(image_cache, "decode_to_side", counting)
    return seen


def _cache(data, tmp_path, rows_per_block=2, sample_blocks=100, **options) -> ImageCache:
    return ImageCache(
        data, 40, tmp_path / "cache", block_bytes=rows_per_block * ROW, sample_blocks=sample_blocks, **options
    )


def _update(cache: ImageCache, files=None):
    return cache.update(
        files if files is not None else walk_image_files(cache.root),
        workers=0,
        progress=False,
        whole_folder=files is None,
    )


def _index(cache: ImageCache) -> dict:
    return json.loads((cache.folder / INDEX_FILE).read_text())


def _assert_pixels_are_the_images(cached, data) -> None:
    pixels = cached.open()
    for i, f in enumerate(walk_image_files(data)):
        want = np.asarray(decode_image(data / f.path).resize((40, 40), resample=Image.BILINEAR, reducing_gap=None))
        np.testing.assert_array_equal(pixels[cached.rows[i]], want, err_msg=f.path)


def _assert_checksums_are_the_rows(cache: ImageCache) -> None:
    index = _index(cache)
    sums = RowChecksums.from_index(index)
    fresh = RowChecksums(index["pixels"], sums.block_rows)
    with open(cache.folder / index["pixels"], "rb") as f:
        fresh.cover(f.fileno(), ROW, index["rows"])
    assert sums == fresh


def _garble(cache: ImageCache, row: int) -> None:
    path = cache.folder / _index(cache)["pixels"]
    with open(path, "r+b") as f:
        f.seek(row * ROW + 100)
        byte = f.read(1)
        f.seek(row * ROW + 100)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.fixture
def data(tmp_path):
    return write_demo_dataset(tmp_path / "data", per_class=4, size=32, classes=("circle", "star"))  # 8 images


def test_cache__truncated_rows_file_is_extended_and_its_lost_blocks_decoded_again(data, tmp_path, decodes, caplog):
    cache = _cache(data, tmp_path)
    first, _ = _update(cache)
    first.close()
    rows_file = first.pixels_file
    os.truncate(rows_file, 5 * ROW + 123)  # rows 0-4 whole: blocks 0 and 1 intact, 2 (rows 4, 5) and 3 lost
    decodes.clear()
    with caplog.at_level(logging.WARNING, logger=image_cache.__name__):
        cached, failed = _update(cache)
    assert failed == {} and len(decodes) == 4 and cached.decoded == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "truncated (5 of 8 rows)" in warnings[0] and "its 4 images" in warnings[0]
    assert rows_file.stat().st_size == 12 * ROW  # 8 rows (4 dead, zeros) + 4 new: no row number reused
    _assert_pixels_are_the_images(cached, data)
    _assert_checksums_are_the_rows(cache)
    decodes.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=image_cache.__name__):
        _update(cache)
    assert decodes == [] and not caplog.records  # repaired: nothing more to do


def test_cache__a_garbled_row_fails_its_block_checksum_and_the_block_is_decoded_again(data, tmp_path, decodes, caplog):
    cache = _cache(data, tmp_path)
    _update(cache)
    _garble(cache, 3)  # block 1: rows 2 and 3
    decodes.clear()
    with caplog.at_level(logging.WARNING, logger=image_cache.__name__):
        cached, _ = _update(cache)
    assert len(decodes) == 2 and "1 block of rows fails its checksum" in caplog.text
    _assert_pixels_are_the_images(cached, data)
    _assert_checksums_are_the_rows(cache)
    decodes.clear()
    _update(cache)
    assert decodes == []


def test_cache__the_sample_reads_few_blocks_and_one_damaged_block_checks_them_all(data, tmp_path, decodes, monkeypatch):
    cache = _cache(data, tmp_path, rows_per_block=1, sample_blocks=2)  # 8 blocks of one row, 2 sampled
    _update(cache)
    checked = []
    real = RowChecksums.damaged

    def spy(self, fd, row_bytes, blocks):
        checked.append(list(blocks))
        return real(self, fd, row_bytes, blocks)

    monkeypatch.setattr(RowChecksums, "damaged", spy)
    decodes.clear()
    _update(cache)
    assert [len(c) for c in checked] == [2] and decodes == []  # 2 of 8 blocks read, all intact
    _garble(cache, 1)
    _garble(cache, 6)
    monkeypatch.setattr(RowChecksums, "sample", lambda self, count, rng=None: [1])  # the sample finds one of two
    checked.clear()
    cached, _ = _update(cache)
    assert checked == [[1], list(range(8))] and len(decodes) == 2  # then every block: both found
    _assert_pixels_are_the_images(cached, data)


def test_cache__appending_verifies_and_extends_the_partial_last_block(tmp_path, decodes):
    data = write_demo_dataset(tmp_path / "data", per_class=3, size=32, classes=("circle",))  # 3 rows: blocks 0, 1/2
    cache = _cache(data, tmp_path, rows_per_block=2, sample_blocks=0)  # only the partial last block is verified
    _update(cache)
    _garble(cache, 2)  # the partial block the next rows extend
    for i in range(3):
        Image.new("RGB", (32, 32), (40 * i, 200, 10)).save(data / "circle" / f"new_{i}.png")
    decodes.clear()
    cached, _ = _update(cache)
    assert sorted(decodes) == ["circle_00002.png", "new_0.png", "new_1.png", "new_2.png"]
    _assert_pixels_are_the_images(cached, data)
    _assert_checksums_are_the_rows(cache)  # extended across block boundaries, row by row


def test_cache__written_before_checksums_is_used_and_gets_them(data, tmp_path, decodes):
    cache = _cache(data, tmp_path)
    _update(cache)
    index = _index(cache)
    del index["checksums"]  # as the previous version wrote it
    (cache.folder / INDEX_FILE).write_text(json.dumps(index))
    decodes.clear()
    cached, _ = _update(cache)
    assert decodes == [] and _index(cache)["checksums"]["rows"] == 8
    _assert_checksums_are_the_rows(cache)
    _garble(cache, 0)
    _update(cache)
    assert len(decodes) == 2  # and they are checked from then on


def test_cache__stale_checksums_of_another_rows_file_are_rebuilt_not_trusted(data, tmp_path, decodes):
    cache = _cache(data, tmp_path)
    _update(cache)
    index = _index(cache)
    index["checksums"]["pixels"] = "pixels-9.u8"
    index["checksums"]["crc32"] = [0] * len(index["checksums"]["crc32"])
    (cache.folder / INDEX_FILE).write_text(json.dumps(index))
    decodes.clear()
    _update(cache)
    assert decodes == []
    _assert_checksums_are_the_rows(cache)


def test_cache__compaction_verifies_the_blocks_it_copies(data, tmp_path, decodes, caplog):
    cache = _cache(data, tmp_path, rows_per_block=2, sample_blocks=0, compact_min_rows=4)
    _update(cache)
    moved = [data / "circle" / f"circle_{i:05d}.png" for i in (1, 2, 3)] + [
        data / "star" / f"star_{i:05d}.png" for i in (0, 1, 2)
    ]
    for path in moved:  # 6 of 8 rows die; circle_00000 (row 0, block 0) and star_00003 (row 7) stay
        path.rename(tmp_path / path.name)
    Image.new("RGB", (32, 32), (30, 30, 200)).save(data / "star" / "new.png")  # 9 rows, 3 live: compacted
    _garble(cache, 0)  # in a full block the start does not sample (sample_blocks=0): the compaction finds it
    decodes.clear()
    with caplog.at_level(logging.WARNING, logger=image_cache.__name__):
        cached, _ = _update(cache)
    assert cached.pixels_file.name == "pixels-1.u8"
    assert sorted(decodes) == ["circle_00000.png", "new.png"]
    assert "while compacting" in caplog.text
    _assert_pixels_are_the_images(cached, data)
    _assert_checksums_are_the_rows(cache)


def test_train__reruns_over_a_truncated_cache_with_one_warning(tmp_path, caplog):
    from tests.conftest import tiny_train_config
    from moco_retrieval.trainer.train import train

    data = write_demo_dataset(tmp_path / "data", per_class=4, size=32, classes=("circle", "square", "star", "ring"))

    def config(out):
        return tiny_train_config(
            data, tmp_path / out, epochs=1, batch_size=8, queue_size=8, amp=False, cache_dir=str(tmp_path / "cache")
        )

    first, _ = _update(ImageCache(data, 40, tmp_path / "cache"))  # what an earlier run at 32 px left
    first.close()
    rows_file = first.pixels_file
    os.truncate(rows_file, rows_file.stat().st_size // 3)
    with caplog.at_level(logging.WARNING, logger=image_cache.__name__):
        assert train(config("run")).steps == 2
    assert caplog.text.count("is damaged") == 1 and "truncated" in caplog.text


def test_block_size__is_about_a_mebibyte_and_never_under_a_row():
    assert RowChecksums.for_rows("p", ROW).block_rows == (1 << 20) // ROW == 218
    assert RowChecksums.for_rows("p", 280 * 280 * 3).block_rows == 4
    assert RowChecksums.for_rows("p", 2000 * 2000 * 3).block_rows == 1
    assert cache_checksums.SAMPLE_BLOCKS * cache_checksums.BLOCK_BYTES <= 8 << 20


def test_cache__a_reader_of_the_old_index_keeps_its_intact_rows_through_a_repair(data, tmp_path):
    cache = _cache(data, tmp_path)
    reader, _ = _update(cache)  # another run's view, held while the cache is damaged and repaired
    before = np.array(reader.open())
    os.truncate(reader.pixels_file, 3 * ROW)
    repaired, _ = _update(cache)
    after = reader.open()  # the same rows file, its length back: no read past the end of a map
    np.testing.assert_array_equal(after[:3], before[:3])  # the rows before the cut: never written again
    assert not after[3:8].any()  # the rows the truncation lost read as zeros
    assert repaired.pixels_file == reader.pixels_file and set(repaired.rows[:2]) == {0, 1}
    reader.close()
