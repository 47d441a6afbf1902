"""The LMDB metadata store of one generation: the source of truth for ids.

Named databases (keys are bytes; ids are 8-byte big-endian so they iterate in id order; values are JSON):

    items       id -> record {id, path, label, width, height, bytes, sha256, mtime, mtime_ns, duplicate_of}
    paths       relative path -> id            (live items only; keys: see path_key)
    sha256      sha256 hex -> [ids]            (live items with that content; the first is the original)
    tombstones  id -> {id, path, sha256, removed_in}   (ids that were live once; never reused)
    skipped     relative path -> {path, bytes, mtime_ns, reason}   (unreadable files, retried when they change)
    info        "next_id" -> int

The writer works on a private copy of the previous generation (see :func:`copy_store`), in transactions; when
the map is full it doubles the map size and replays the transaction. A published store is never written
again, so readers open it read-only without the lock file (``lock=False``): they never block a writer and
any thread may read with its own transaction. Read-only opens of one store within a process share one
environment (LMDB allows only one per file and process).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator

import lmdb

from contracts.errors import ArtifactError, IndexBuildError, OutputError
from contracts.filenames import decode_name, encode_name

LOG = logging.getLogger(__name__)

INITIAL_MAP_SIZE = 64 << 20  # bytes; grows by doubling as needed
MAX_DBS = 8
_DBS = (b"items", b"paths", b"sha256", b"tombstones", b"skipped", b"info")
WRITE_CHUNK = 10_000  # records per transaction when writing many


def id_key(item_id: int) -> bytes:
    return int(item_id).to_bytes(8, "big", signed=False)


MAX_KEY_BYTES = 511  # LMDB's compiled-in key limit (Environment.max_key_size())


def path_key(path: str) -> bytes:
    """The key of a relative path: its file-system bytes (``os.fsencode``: lossless, names that are not UTF-8
    included); a path longer than LMDB's key limit is keyed by a NUL byte + its sha256 (no path holds a NUL)."""
    raw = encode_name(path)
    return raw if len(raw) <= MAX_KEY_BYTES else b"\0" + hashlib.sha256(raw).digest()


def _dump(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _load(raw: bytes | memoryview | None):
    return None if raw is None else json.loads(bytes(raw))


# LMDB allows one environment per file per process: read-only opens of the same store share one, counted.
_SHARED: dict[str, list] = {}  # real path -> [env, users]
_SHARED_LOCK = threading.Lock()


def _acquire_readonly(path: Path) -> lmdb.Environment:
    key = os.path.realpath(path)
    with _SHARED_LOCK:
        if key not in _SHARED:
            env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=MAX_DBS, subdir=True, readahead=False)
            _SHARED[key] = [env, 0]
        _SHARED[key][1] += 1
        return _SHARED[key][0]


def _release_readonly(path: Path) -> None:
    key = os.path.realpath(path)
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            entry[0].close()
            del _SHARED[key]


def copy_store(src: Path, dst: Path) -> None:
    """Copy a published store to ``dst`` (compacted), to be modified by the next generation's writer."""
    env = _acquire_readonly(src)
    try:
        dst.mkdir(parents=True, exist_ok=True)
        env.copy(str(dst), compact=True)
    finally:
        _release_readonly(src)


class MetadataStore:
    """One ``meta.lmdb/`` folder, opened for reading (shared, lock-free) or writing (one writer)."""

    def __init__(self, path: str | os.PathLike, readonly: bool = True):
        """Open the store at ``path`` (created when writing).

        Raises:
            ArtifactError: a read-only open of a missing or unreadable store.
        """
        self.path = Path(path)
        self.readonly = readonly
        try:
            if readonly:
                if not (self.path / "data.mdb").is_file():
                    raise ArtifactError(f"metadata store not found: {self.path}; rebuild with `moco index --rebuild`")
                self.env = _acquire_readonly(self.path)
            else:
                self.path.mkdir(parents=True, exist_ok=True)
                size = max(INITIAL_MAP_SIZE, 2 * _file_size(self.path / "data.mdb"))
                self.env = lmdb.open(str(self.path), map_size=size, max_dbs=MAX_DBS, subdir=True, sync=True,
                                     metasync=True, readahead=False)
            self._db = {name.decode(): self.env.open_db(name, create=not readonly) for name in _DBS}
        except lmdb.Error as exc:
            raise ArtifactError(f"cannot open metadata store {self.path} ({exc}); "
                                "rebuild with `moco index --rebuild`") from exc

    def close(self) -> None:
        if self.env is None:
            return
        if self.readonly:
            _release_readonly(self.path)
        else:
            self.env.close()
        self.env = None

    def __enter__(self) -> "MetadataStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading ----------------------------------------------------------------------------------------------
    def _get(self, db: str, key: bytes):
        with self.env.begin(db=self._db[db], buffers=True) as txn:
            return _load(txn.get(key))

    def record(self, item_id: int) -> dict | None:
        """The live record of ``item_id``, or ``None`` (unknown or tombstoned)."""
        if item_id < 0:
            return None
        return self._get("items", id_key(item_id))

    def records(self, ids: Iterable[int]) -> list[dict | None]:
        """Records of many ids in one read transaction (``None`` where unknown)."""
        with self.env.begin(db=self._db["items"], buffers=True) as txn:
            return [_load(txn.get(id_key(i))) if i >= 0 else None for i in ids]

    def id_of_path(self, path: str) -> int | None:
        return self._get("paths", path_key(path))

    def ids_of_sha256(self, sha256: str) -> list[int]:
        return self._get("sha256", sha256.encode()) or []

    def tombstone(self, item_id: int) -> dict | None:
        return self._get("tombstones", id_key(item_id))

    def next_id(self) -> int:
        return self._get("info", b"next_id") or 0

    def count(self) -> int:
        with self.env.begin(db=self._db["items"]) as txn:
            return txn.stat(self._db["items"])["entries"]

    def iter_records(self) -> Iterator[dict]:
        """All live records in id order."""
        with self.env.begin(db=self._db["items"], buffers=True) as txn:
            for _, value in txn.cursor():
                yield _load(value)

    def iter_ids_with_paths(self) -> Iterator[tuple[str, int]]:
        """``(path, id)`` of every live item, in path order."""
        with self.env.begin(db=self._db["paths"], buffers=True) as txn:
            for key, value in txn.cursor():
                item_id = _load(value)
                if bytes(key[:1]) == b"\0":  # a long path, keyed by its hash: the record has it
                    yield _load(txn.get(id_key(item_id), db=self._db["items"]))["path"], item_id
                else:
                    yield decode_name(key), item_id

    def skipped(self) -> dict[str, dict]:
        """Unreadable files remembered from earlier runs: path -> {path, bytes, mtime_ns, reason}."""
        with self.env.begin(db=self._db["skipped"], buffers=True) as txn:
            return {info["path"]: info for info in (_load(v) for _, v in txn.cursor())}

    # -- writing ----------------------------------------------------------------------------------------------
    def _write(self, fn: Callable[[lmdb.Transaction], object]):
        """Run ``fn`` in one write transaction, doubling the map size and replaying it when the map is full."""
        if self.readonly:
            raise IndexBuildError(f"metadata store {self.path} is open read-only")
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                size = self.env.info()["map_size"] * 2
                LOG.debug("LMDB map full; growing %s to %d MiB", self.path, size >> 20)
                self.env.set_mapsize(size)
            except lmdb.Error as exc:  # I/O errors: a full disk is the usual one
                raise OutputError(f"cannot write metadata store {self.path} ({exc}); check free space and "
                                  "rerun the same command") from exc

    def remove_items(self, ids: list[int], generation: str) -> None:
        """Tombstone ``ids``; when a removed item was the original of duplicates, the next one becomes it."""
        for start in range(0, len(ids), WRITE_CHUNK):
            chunk = ids[start:start + WRITE_CHUNK]
            self._write(lambda txn: [self._remove_one(txn, i, generation) for i in chunk])

    def _remove_one(self, txn: lmdb.Transaction, item_id: int, generation: str) -> None:
        db = self._db
        key = id_key(item_id)
        rec = _load(txn.get(key, db=db["items"]))
        if rec is None:
            raise IndexBuildError(f"metadata store {self.path} has no live item {item_id} to remove; "
                                  "rebuild with `moco index --rebuild`")
        txn.delete(key, db=db["items"])
        txn.put(key, _dump({"id": item_id, "path": rec["path"], "sha256": rec["sha256"], "removed_in": generation}),
                db=db["tombstones"])
        if _load(txn.get(path_key(rec["path"]), db=db["paths"])) == item_id:
            txn.delete(path_key(rec["path"]), db=db["paths"])
        sha_key = rec["sha256"].encode()
        same = [i for i in (_load(txn.get(sha_key, db=db["sha256"])) or []) if i != item_id]
        if not same:
            txn.delete(sha_key, db=db["sha256"])
            return
        txn.put(sha_key, _dump(same), db=db["sha256"])
        if rec.get("duplicate_of") is None:  # the original went away: the oldest copy takes its place
            for i in same:
                other = _load(txn.get(id_key(i), db=db["items"]))
                other["duplicate_of"] = None if i == same[0] else same[0]
                txn.put(id_key(i), _dump(other), db=db["items"])

    def add_items(self, records: list[dict]) -> None:
        """Insert new live records (each with a fresh ``id``); sets ``duplicate_of`` from their sha256."""
        for start in range(0, len(records), WRITE_CHUNK):
            chunk = records[start:start + WRITE_CHUNK]
            self._write(lambda txn: [self._add_one(txn, r) for r in chunk])

    def _add_one(self, txn: lmdb.Transaction, rec: dict) -> None:
        db = self._db
        key = id_key(rec["id"])
        if txn.get(key, db=db["items"]) is not None or txn.get(key, db=db["tombstones"]) is not None:
            raise IndexBuildError(f"id {rec['id']} is already used in {self.path}; rebuild with `moco index --rebuild`")
        sha_key = rec["sha256"].encode()
        same = _load(txn.get(sha_key, db=db["sha256"])) or []
        rec = dict(rec, duplicate_of=same[0] if same else None)
        txn.put(key, _dump(rec), db=db["items"])
        txn.put(path_key(rec["path"]), _dump(rec["id"]), db=db["paths"])
        txn.put(sha_key, _dump(same + [rec["id"]]), db=db["sha256"])
        next_id = _load(txn.get(b"next_id", db=db["info"])) or 0
        if rec["id"] >= next_id:
            txn.put(b"next_id", _dump(rec["id"] + 1), db=db["info"])

    def set_next_id(self, next_id: int) -> None:
        self._write(lambda txn: txn.put(b"next_id", _dump(int(next_id)), db=self._db["info"]))

    def replace_skipped(self, skipped: dict[str, dict]) -> None:
        """Replace the remembered unreadable files with ``skipped`` (path -> {path, bytes, mtime_ns, reason})."""
        def fn(txn):
            txn.drop(self._db["skipped"], delete=False)
            for path, info in skipped.items():
                txn.put(path_key(path), _dump(info), db=self._db["skipped"])
        self._write(fn)

    def sync(self) -> None:
        """Flush everything to disk (before the generation is published)."""
        self.env.sync(True)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
