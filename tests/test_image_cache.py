"""The image cache (trainer.image_cache): decoded once, reused, updated when files are added, changed or removed,
unreadable files skipped with their reason and not retried until they change, dead rows compacted."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from PIL import Image

from moco_retrieval.contracts.images import decode_image, walk_image_files
from moco_retrieval.trainer import image_cache
from moco_retrieval.trainer.demo_data import write_demo_dataset
from moco_retrieval.trainer.image_cache import ImageCache, cache_side


@pytest.fixture
def decodes(monkeypatch) -> list[str]:
    """The paths the cache decodes (in this process: workers=0)."""
    seen = []
    real = image_cache.decode_to_side

    def counting(path, side):
        seen.append(os.path.basename(path))
        return real(path, side)

    monkeypatch.setattr(image_cache, "decode_to_side", counting)
    return seen


def _update(root, cache_root, side=40):
    return ImageCache(root, side, cache_root).update(walk_image_files(root), workers=0, progress=False)


def test_cache_side__is_a_quarter_larger_than_the_training_size():
    assert (cache_side(32), cache_side(224), cache_side(96)) == (40, 280, 120)


def test_cache__built_once_then_reused_with_the_decoded_pixels(tmp_path, decodes):
    data = write_demo_dataset(tmp_path / "data", per_class=3, size=50, classes=("circle", "star"))
    cached, failed = _update(data, tmp_path / "cache")
    assert failed == {} and len(cached) == 6 and len(decodes) == 6
    pixels = cached.open()
    files = walk_image_files(data)
    for i, f in enumerate(files):  # each row is the decoded image squashed to 40 x 40, its size recorded
        want = np.asarray(decode_image(data / f.path).resize((40, 40), resample=Image.BILINEAR, reducing_gap=None))
        np.testing.assert_array_equal(pixels[cached.rows[i]], want)
        assert tuple(cached.sizes[i]) == (50, 50)
    decodes.clear()
    again, _ = _update(data, tmp_path / "cache")
    assert decodes == [] and np.array_equal(again.rows, cached.rows)  # nothing decoded the second time


def test_cache__adds_changed_and_new_files_and_forgets_removed_ones(tmp_path, decodes):
    data = write_demo_dataset(tmp_path / "data", per_class=3, size=32, classes=("circle", "star"))
    first, _ = _update(data, tmp_path / "cache")
    decodes.clear()
    Image.new("RGB", (20, 30), (200, 10, 10)).save(data / "circle" / "new.png")
    changed = data / "star" / "star_00001.png"
    Image.new("RGB", (32, 32), (0, 0, 250)).save(changed)
    os.utime(changed, ns=(time.time_ns(), time.time_ns() + 10**9))
    (data / "circle" / "circle_00000.png").unlink()
    cached, failed = _update(data, tmp_path / "cache")
    assert sorted(decodes) == ["new.png", "star_00001.png"] and failed == {}
    paths = [f.path for f in walk_image_files(data)]
    assert len(cached) == len(paths) == 6 and "circle/circle_00000.png" not in paths
    row = cached.rows[paths.index("star/star_00001.png")]
    assert (cached.open()[row] == (0, 0, 250)).all()
    assert tuple(cached.sizes[paths.index("circle/new.png")]) == (20, 30)


def test_cache__unreadable_files_are_skipped_with_a_reason_and_not_retried(tmp_path, decodes):
    data = write_demo_dataset(tmp_path / "data", per_class=2, size=32, classes=("circle", "star"))
    (data / "star" / "broken.png").write_bytes(b"\x89PNG not really")
    (data / "star" / "empty.jpg").write_bytes(b"")
    cached, failed = _update(data, tmp_path / "cache")
    assert set(failed) == {"star/broken.png", "star/empty.jpg"} and len(cached) == 4
    assert "not a readable image" in failed["star/broken.png"] and "empty" in failed["star/empty.jpg"]
    decodes.clear()
    _, failed_again = _update(data, tmp_path / "cache")
    assert decodes == [] and failed_again == failed  # remembered, not decoded again
    Image.new("RGB", (32, 32)).save(data / "star" / "broken.png")  # fixed: decoded on the next update
    cached, failed = _update(data, tmp_path / "cache")
    assert decodes == ["broken.png"] and set(failed) == {"star/empty.jpg"} and len(cached) == 5


def test_cache__compacts_when_most_rows_are_dead(tmp_path, monkeypatch):
    monkeypatch.setattr(image_cache, "COMPACT_MIN_ROWS", 4)
    data = write_demo_dataset(tmp_path / "data", per_class=4, size=32, classes=("circle", "star"))
    first, _ = _update(data, tmp_path / "cache")
    for i in range(3):
        (data / "circle" / f"circle_{i:05d}.png").unlink()
        (data / "star" / f"star_{i:05d}.png").unlink()
    cached, _ = _update(data, tmp_path / "cache")
    assert sorted(cached.rows.tolist()) == [0, 1] and cached.pixels_file != first.pixels_file
    assert not first.pixels_file.exists()
    files = sorted(p.name for p in cached.folder.iterdir())
    assert files == sorted([".lock", "index.json", cached.pixels_file.name])
