"""The image cache (trainer.image_cache): decoded once, reused, updated when files are added, changed or removed,
unreadable files skipped with their reason and not retried until they change, dead rows compacted; and one cache
with several readers: a subset update (the k-NN monitor's), a compaction, a sub-folder's cache or another
process never drop entries or a rows file that a reader still holds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from moco_retrieval.contracts.images import decode_image, walk_image_files
from moco_retrieval.trainer import image_cache
from moco_retrieval.trainer.demo_data import write_demo_dataset
from moco_retrieval.trainer.image_cache import INDEX_FILE, ImageCache, cache_side


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


def _update(root, cache_root, side=40, **cache_options):
    """A training run's update: the walk of the whole folder."""
    return ImageCache(root, side, cache_root, **cache_options).update(
        walk_image_files(root), workers=0, progress=False, whole_folder=True
    )


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
    first.close()  # its reader is done: nothing holds the old rows file any more
    cached, _ = _update(data, tmp_path / "cache")
    assert sorted(cached.rows.tolist()) == [0, 1] and cached.pixels_file != first.pixels_file
    assert not first.pixels_file.exists()
    files = sorted(p.name for p in cached.folder.iterdir())
    assert files == sorted([".lock", "index.json", cached.pixels_file.name])


# -- one cache, several readers ---------------------------------------------------------------------------------------
def _entries(cached) -> dict:
    import json

    return json.loads((cached.folder / INDEX_FILE).read_text())["entries"]


def _expected_rows(root, files, side=40) -> np.ndarray:
    """What the cache must hold for ``files``, ``[N, side, side, 3]``: each decoded and squashed to the side."""
    return np.stack(
        [
            np.asarray(decode_image(root / f.path).resize((side, side), resample=Image.BILINEAR, reducing_gap=None))
            for f in files
        ]
    )


def _assert_reads(cached, root, files, side=40) -> None:
    np.testing.assert_array_equal(cached.open()[cached.rows], _expected_rows(root, files, side))


def test_cache__subset_update_keeps_every_entry_and_earlier_readers_valid(tmp_path, decodes):
    data = write_demo_dataset(tmp_path / "data", per_class=10, size=16, classes=("circle", "star"))
    files = walk_image_files(data)
    cache = ImageCache(data, 40, tmp_path / "cache", compact_min_rows=1)  # a compaction would happen at once
    whole, _ = cache.update(files, progress=False, whole_folder=True)
    mapped = whole.open()  # one reader already mapped, one (`whole`) still to map, as a training loader
    decodes.clear()
    subset, _ = cache.update(files[::4], progress=False)  # what the k-NN monitor asks for
    assert decodes == [] and len(subset) == 5 and subset.pixels_file == whole.pixels_file
    assert sorted(_entries(whole)) == [f.path for f in files]  # the others are kept
    _assert_reads(whole, data, files)
    np.testing.assert_array_equal(mapped[whole.rows], _expected_rows(data, files))
    again, _ = cache.update(files, progress=False, whole_folder=True)
    assert decodes == [] and (again.decoded, again.reused) == (0, 20)  # the next run decodes nothing


def test_cache__compaction_keeps_the_old_rows_file_while_a_reader_holds_it(tmp_path):
    data = write_demo_dataset(tmp_path / "data", per_class=4, size=16, classes=("circle", "star"))
    before = walk_image_files(data)
    expected = _expected_rows(data, before)
    reader, _ = _update(data, tmp_path / "cache", compact_min_rows=4)  # holds pixels-0, maps it later
    for i in range(3):
        (data / "circle" / f"circle_{i:05d}.png").unlink()
        (data / "star" / f"star_{i:05d}.png").unlink()
    compacted, _ = _update(data, tmp_path / "cache", compact_min_rows=4)
    assert compacted.pixels_file != reader.pixels_file and sorted(compacted.rows.tolist()) == [0, 1]
    assert reader.pixels_file.exists()  # held: not deleted under the reader
    np.testing.assert_array_equal(reader.open()[reader.rows], expected)  # every row, removed files' too
    _assert_reads(compacted, data, walk_image_files(data))
    reader.close()
    _update(data, tmp_path / "cache", compact_min_rows=4)  # the next update deletes what nobody holds
    assert sorted(p.name for p in compacted.folder.iterdir()) == sorted(
        [".lock", INDEX_FILE, compacted.pixels_file.name]
    )


def test_cache__a_sub_folder_has_its_own_cache_and_leaves_the_folders_alone(tmp_path, decodes):
    data = write_demo_dataset(tmp_path / "data", per_class=4, size=16, classes=("circle", "star"))
    files = walk_image_files(data)
    whole, _ = _update(data, tmp_path / "cache", compact_min_rows=1)
    part, _ = _update(data / "circle", tmp_path / "cache", compact_min_rows=1)  # a later run over a sub-folder
    assert part.folder != whole.folder and len(part) == 4
    assert sorted(_entries(whole)) == [f.path for f in files]
    _assert_reads(whole, data, files)
    decodes.clear()
    assert _update(data, tmp_path / "cache")[0].decoded == 0 and decodes == []


def test_knn_monitor__on_a_subset_of_the_training_folder_keeps_its_cache(tmp_path):
    from moco_retrieval.trainer.monitor import KnnMonitor

    data = write_demo_dataset(tmp_path / "data", per_class=10, size=16, classes=("circle", "square", "star", "ring"))
    files = walk_image_files(data)
    training, _ = _update(data, tmp_path / "cache")  # the training run's cache at 32 px: side 40
    monitor = KnnMonitor(data, 32, max_images=10, cache_root=tmp_path / "cache")
    assert len(monitor) == 10 and len(_entries(training)) == 40
    _assert_reads(training, data, files)


_CONCURRENT_RUN = textwrap.dedent("""
    import sys
    import numpy as np
    from moco_retrieval.contracts.images import walk_image_files
    from moco_retrieval.trainer.image_cache import ImageCache, decode_to_side
    root, cache_root = sys.argv[1], sys.argv[2]
    files = walk_image_files(root)
    cached, _ = ImageCache(root, 40, cache_root, compact_min_rows=4).update(files, progress=False,
                                                                            whole_folder=True)
    print("decoded", cached.decoded, flush=True)
    if sys.argv[3] == "wait":  # a long run: holds its view while another process compacts the cache
        sys.stdin.readline()
    want = np.stack([decode_to_side(f"{root}/{f.path}", 40)[0] for f in files])
    assert (cached.open()[cached.rows] == want).all()
    print("read ok", flush=True)
""")


def _run_in_process(data, cache_root, mode) -> subprocess.Popen:
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen(
        [sys.executable, "-c", _CONCURRENT_RUN, str(data), str(cache_root), mode],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_cache__two_processes_at_once_decode_each_image_once_and_read_their_rows(tmp_path):
    data = write_demo_dataset(tmp_path / "data", per_class=8, size=16, classes=("circle", "star"))
    runs = [_run_in_process(data, tmp_path / "cache", "go") for _ in range(2)]
    outs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outs]
    decoded = sorted(int(out.split()[1]) for out, _ in outs)
    assert decoded == [0, 16] and all("read ok" in out for out, _ in outs)  # one decoded, the other waited


def test_cache__another_processs_compaction_leaves_a_running_readers_rows_file(tmp_path):
    data = write_demo_dataset(tmp_path / "data", per_class=4, size=16, classes=("circle", "star"))
    run = _run_in_process(data, tmp_path / "cache", "wait")
    assert run.stdout.readline().split() == ["decoded", "8"], run.stderr.read()[-2000:]
    old_rows = next((tmp_path / "cache").iterdir()) / "pixels-0.u8"  # the waiting run's rows file
    for i in range(3):  # the other run sees most files removed and compacts (rows >= 4, 6 of 8 dead)
        (data / "circle" / f"circle_{i:05d}.png").rename(tmp_path / f"circle_{i}.png")
        (data / "star" / f"star_{i:05d}.png").rename(tmp_path / f"star_{i}.png")
    compacted, _ = _update(data, tmp_path / "cache", compact_min_rows=4)
    assert compacted.pixels_file.name == "pixels-1.u8" and old_rows.exists()
    for i in range(3):  # put them back so the waiting run can check its rows against the files
        (tmp_path / f"circle_{i}.png").rename(data / "circle" / f"circle_{i:05d}.png")
        (tmp_path / f"star_{i}.png").rename(data / "star" / f"star_{i:05d}.png")
    out, err = run.communicate("continue\n", timeout=120)
    assert run.returncode == 0 and "read ok" in out, err[-2000:]
    compacted.close()
    _update(data, tmp_path / "cache", compact_min_rows=4)  # the reader has ended: its file goes
    assert not old_rows.exists()


# -- the training run and its k-NN monitor ------------------------------------------------------------------------
def test_train__monitor_on_a_subset_of_a_large_folder_neither_breaks_the_run_nor_the_next(
    tmp_path, monkeypatch, decodes, caplog
):
    """Issue 19: the monitor's 5,000-image sample of a 60,000-image folder used to drop the other entries and
    compact the cache, deleting the rows file the training loader was about to map (FileNotFoundError); the
    next run then decoded the 55,000 again. Here: 40 images, a monitor of 10, compaction from 4 rows."""
    import logging

    from tests.conftest import tiny_train_config
    from moco_retrieval.trainer.train import train

    monkeypatch.setattr(image_cache, "COMPACT_MIN_ROWS", 4)
    data = write_demo_dataset(tmp_path / "data", per_class=10, size=32, classes=("circle", "square", "star", "ring"))

    def config(out):
        return tiny_train_config(
            data,
            tmp_path / out,
            epochs=1,
            batch_size=8,
            queue_size=16,
            knn_every=1,
            knn_max_images=10,
            cache_dir=str(tmp_path / "cache"),
        )

    first = train(config("run1"))
    assert first.steps == 5 and first.knn_before is not None and first.knn_acc is not None
    assert len(decodes) == 40
    decodes.clear()
    with caplog.at_level(logging.INFO, logger="moco_retrieval.trainer.image_cache"):
        second = train(config("run2"))
    assert second.steps == 5 and decodes == []
    assert "40 images reused, 0 decoded" in caplog.text
