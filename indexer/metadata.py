"""The LMDB metadata of one generation: the source of truth for ids.

Named databases (keys are bytes; ids are 8-byte big-endian so they iterate in id order; values are JSON):

    items       id -> record (:class:`~indexer.records.ItemRecord`: its JSON, keys sorted)
    paths       relative path -> id            (live items only; keys: see path_key)
    sha256      sha256 hex -> [ids]            (live items with that content; the first is the original)
    tombstones  id -> {id, path, sha256, removed_in}   (ids that were live once; never reused)
    skipped     relative path -> {path, bytes, mtime_ns, reason}   (unreadable files, retried when they change)
    info        "next_id" -> int; "label_index" -> 1 when ``labels`` holds every live labeled item
    labels      label + NUL + id -> 1      (live labeled items: a label's ids are one sorted range scan)

``labels`` is maintained by :meth:`MetadataStore.add_items` / :meth:`MetadataStore.remove_items`, which every
full build, update and compaction runs. Stores written before it existed have no ``labels`` database and no
``label_index`` flag, and still open; a filter by label refuses them in one line ("rebuild"), because their
ids could only come from reading every record. A base created by this code sets the flag; an old base never
gets it from an update or a compaction (their deltas would hold only the items added since), only from
``moco index --rebuild``.

A generation's metadata has one or two layers, each an LMDB environment that is never written again once
published:

    meta.lmdb/    the *base*: everything, as of the last full build or compaction. Later generations share it
                  (``data.mdb`` is hard-linked into each generation folder), so an update never copies it.
    delta.lmdb/   the *delta* (only after incremental updates): every key written since the base, with its new
                  value, or an empty value for a key deleted since. Copied and extended by each update, so its
                  size is what changed since the base, not the corpus.

Reads look a key up in the delta first, then in the base; iteration merges both in key order. A reader of a
generation therefore sees exactly that generation, whatever later generations wrote (they write their own
delta copies). Compaction (:func:`materialize`) folds a delta into a new base.

The writer works in transactions on a store no reader has opened yet (a fresh base, or the new generation's
delta copy, both in a staging folder that a failed run discards); when the map is full it doubles the map size
and replays the transaction. Its commits are not flushed to disk one by one: :meth:`MetadataStore.sync` flushes
the store once, before the generation is published (a fsync per 10,000 records cost a fifth of a full build's
metadata time).

Readers open stores read-only without the lock file (``lock=False``): they never block a writer and any thread
may read with its own transaction. LMDB allows one environment per file and process, so read-only opens of one
file share one environment (keyed by device and inode: generations share their base by hard links).

LMDB maps a store and trusts it: a page read past the end of a truncated file is a SIGBUS that kills the
process (``moco search`` printed only "Bus error"). So a store is checked before it is mapped
(:func:`check_data_file`: the file holds every page its header counts), and every LMDB or JSON error of a read
(a damaged page: ``lmdb.CorruptedError``, ``PageNotFoundError``; a value that is not ours) becomes one
:class:`~contracts.errors.ArtifactError` naming the store.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import struct
import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

import lmdb
import numpy as np

from moco_retrieval.contracts.atomic import output_errors
from moco_retrieval.contracts.errors import ArtifactError, IndexBuildError, OutputError
from moco_retrieval.contracts.filenames import decode_name, encode_name
from moco_retrieval.indexer.records import ItemRecord

LOG = logging.getLogger(__name__)

INITIAL_MAP_SIZE = 64 << 20  # bytes; grows by doubling as needed
MAX_DBS = 8
_DBS = (b"items", b"paths", b"sha256", b"tombstones", b"skipped", b"info")
_OPTIONAL_DBS = (b"labels",)  # absent from stores written before them (read-only opens then see None)
LABEL_INDEX = b"label_index"
WRITE_CHUNK = 10_000  # records per transaction when writing many
DELETED = b""  # a delta value meaning "deleted since the base" (JSON values are never empty)
DATA_FILE = "data.mdb"


# LMDB's meta pages (pages 0 and 1; the one with the larger txnid is current), as lmdb.h / mdb.c lay them out on
# 64-bit builds: a 16-byte page header, then MDB_meta: magic, version, address, mapsize, two MDB_db (48 bytes
# each; the first one's md_pad holds the page size), mm_last_pg, mm_txnid.
_META_MAGIC = 0xBEEFC0DE
_META = struct.Struct("<II8xQI44x48xQQ")  # magic, version, mapsize, page size, last page, txnid (from byte 16)
# errors of a damaged store (BadTxnError: a transaction that met a damaged page refuses every later operation)
_DAMAGE = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.IncompatibleError,
    lmdb.BadValsizeError,
    lmdb.VersionMismatchError,
    lmdb.BadChecksumError,
    lmdb.PanicError,
    lmdb.BadTxnError,
)


def _meta_page(f, offset: int) -> tuple | None:
    """``(magic, version, mapsize, page size, last page, txnid)`` of the meta page at ``offset``, or ``None``
    where there is none (short file, wrong magic)."""
    f.seek(offset)
    page = f.read(16 + _META.size)
    if len(page) < 16 + _META.size:
        return None
    meta = _META.unpack_from(page, 16)
    return meta if meta[0] == _META_MAGIC else None


def check_data_file(path: Path) -> None:
    """Refuse an LMDB data file that does not hold the pages its header says it does, before it is mapped.

    LMDB never reads a page past the last one committed (``mm_last_pg`` of the newer meta page), so a file of at
    least ``(last page + 1) x page size`` bytes is never read past its end. Costs one read of two pages.

    Raises:
        ArtifactError: missing, unreadable, not an LMDB file, or shorter than its header says (truncated).
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = _meta_page(f, 0)
            page_size = first[3] if first is not None else 0
            second = _meta_page(f, page_size) if 512 <= page_size <= 1 << 16 else None
    except FileNotFoundError:
        raise ArtifactError(f"metadata store not found: {path.parent}; rebuild with `moco index --rebuild`") from None
    except OSError as exc:
        raise ArtifactError(
            f"cannot read metadata store {path} ({exc.strerror or exc}); rebuild with `moco index --rebuild`"
        ) from exc
    if second is None:
        state = "empty" if size == 0 else f"not an LMDB file or its header is damaged ({size:,} bytes)"
        raise ArtifactError(f"metadata store {path} is {state}; rebuild with `moco index --rebuild`")
    _, _, _, page_size, last_page, _ = max(first, second, key=lambda meta: meta[5])
    needed = (last_page + 1) * page_size
    if size < needed:
        raise ArtifactError(
            f"metadata store {path} is truncated ({size:,} bytes, its header counts {needed:,}); "
            "rebuild with `moco index --rebuild`"
        )


def id_key(item_id: int) -> bytes:
    return int(item_id).to_bytes(8, "big", signed=False)


MAX_KEY_BYTES = 511  # LMDB's compiled-in key limit (Environment.max_key_size())


def path_key(path: str) -> bytes:
    """The key of a relative path: its file-system bytes (``os.fsencode``: lossless, names that are not UTF-8
    included); a path longer than LMDB's key limit is keyed by a NUL byte + its sha256 (no path holds a NUL)."""
    raw = encode_name(path)
    return raw if len(raw) <= MAX_KEY_BYTES else b"\0" + hashlib.sha256(raw).digest()


def label_key(label: str, item_id: int) -> bytes:
    """The ``labels`` key of an item: its label's bytes, NUL (no folder name holds one), its 8-byte id."""
    return label_prefix(label) + id_key(item_id)


def label_prefix(label: str) -> bytes:
    """What every ``labels`` key of ``label`` starts with: its bytes and NUL."""
    return encode_name(label) + b"\0"


def _optional_dbs(env: lmdb.Environment, create: bool) -> dict:
    """The optional databases of ``env`` (``None`` where a read-only store predates them)."""
    out = {}
    for name in _OPTIONAL_DBS:
        try:
            out[name.decode()] = env.open_db(name, create=create)
        except lmdb.NotFoundError:
            out[name.decode()] = None
    return out


_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True)  # one encoder (json.dumps makes one a call)


def _dump(obj) -> bytes:
    return _JSON.encode(obj).encode()


def _dump_ids(ids: list[int]) -> bytes:
    """``_dump`` of a list of ids, the same bytes without the JSON encoder (a full build writes one a file)."""
    return b"[" + b",".join(b"%d" % i for i in ids) + b"]"


def _above_every_id(view: "_View", ids: list[int]) -> bool:
    """Whether ``ids`` increase strictly and all lie above every id the store has held (live or removed): then
    none is in use, which one range check per chunk says instead of two reads per record (a build's ids are
    fresh and in order; anything else is checked id by id)."""
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0:
        return False
    return id_key(ids[0]) > max(view.last_key("items") or b"", view.last_key("tombstones") or b"")


def _load(raw: bytes | memoryview | None):
    return None if raw is None else json.loads(bytes(raw))


def _load_item(raw: bytes | memoryview | None) -> ItemRecord | None:
    return None if raw is None else ItemRecord.from_dict(json.loads(bytes(raw)))


RECORD_CACHE = 100_000  # decoded records a read-only store keeps (about 40 MB of small records)
_MISSING = object()

# LMDB allows one environment per file per process: read-only opens of the same file share one, counted.
_SHARED: dict[tuple[int, int], list] = {}  # (st_dev, st_ino) of data.mdb -> [env, users]
_SHARED_LOCK = threading.Lock()


def _file_id(path: Path) -> tuple[int, int]:
    try:
        st = os.stat(path / DATA_FILE)
    except OSError as exc:
        raise ArtifactError(
            f"metadata store not found: {path} ({exc.strerror or exc}); rebuild with `moco index --rebuild`"
        ) from exc
    return st.st_dev, st.st_ino


def _acquire_readonly(path: Path) -> tuple[lmdb.Environment, tuple[int, int]]:
    key = _file_id(path)
    with _SHARED_LOCK:
        if key not in _SHARED:
            check_data_file(path / DATA_FILE)
            env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=MAX_DBS, subdir=True, readahead=False)
            _SHARED[key] = [env, 0]
        _SHARED[key][1] += 1
        return _SHARED[key][0], key


def _release_readonly(key: tuple[int, int]) -> None:
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            entry[0].close()
            del _SHARED[key]


def _open_writable(path: Path) -> lmdb.Environment:
    path.mkdir(parents=True, exist_ok=True)
    size = max(INITIAL_MAP_SIZE, 2 * _file_size(path / DATA_FILE))
    return lmdb.open(
        str(path), map_size=size, max_dbs=MAX_DBS, subdir=True, sync=False, metasync=False, readahead=False
    )


def copy_store(src: Path, dst: Path) -> None:
    """Copy a published store to ``dst`` (compacted): a new generation's delta starts as its predecessor's."""
    env, key = _acquire_readonly(src)
    try:
        dst.mkdir(parents=True, exist_ok=True)
        env.copy(str(dst), compact=True)
    except _DAMAGE as exc:  # the copy walks every page of the source: it meets a damaged one first
        raise ArtifactError(
            f"metadata store {src} is damaged ({str(exc).splitlines()[0]}); rebuild with `moco index --rebuild`"
        ) from exc
    finally:
        _release_readonly(key)


def link_store(src: Path, dst: Path) -> None:
    """Make ``dst`` the same store as the published, immutable ``src``: a hard link of its data file (a copy
    where the filesystem has no hard links)."""
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src / DATA_FILE, dst / DATA_FILE)
    except OSError:
        shutil.copyfile(src / DATA_FILE, dst / DATA_FILE)


class _View:
    """The layers of one transaction: reads merge the delta over the base; writes go to the top layer."""

    def __init__(self, store: "MetadataStore", top: lmdb.Transaction, base: lmdb.Transaction | None):
        self.store, self.top, self.base = store, top, base  # base is None for a one-layer store

    def get(self, db: str, key: bytes):
        try:
            raw = self.top.get(key, db=self.store._db[db])
        except _DAMAGE as exc:
            raise self.store.damaged(self.store.top_path, exc) from exc
        if self.base is None:
            return raw
        if raw is not None:
            return None if len(raw) == 0 else raw
        try:
            return self.base.get(key, db=self.store._base_db[db])
        except _DAMAGE as exc:
            raise self.store.damaged(self.store.path, exc) from exc

    def put(self, db: str, key: bytes, value: bytes) -> None:
        self.top.put(key, value, db=self.store._db[db])

    def put_many(self, db: str, pairs: list[tuple[bytes, bytes]]) -> None:
        """:meth:`put` of each ``(key, value)`` in order, in one call (LMDB's ``putmulti``)."""
        if pairs:
            self.top.cursor(db=self.store._db[db]).putmulti(pairs)

    def delete(self, db: str, key: bytes) -> None:
        if self.base is None or self.store._base_db[db] is None:  # (an optional database the base predates)
            self.top.delete(key, db=self.store._db[db])
        elif self.base.get(key, db=self.store._base_db[db]) is not None:
            self.top.put(key, DELETED, db=self.store._db[db])  # mask the base's value
        else:
            self.top.delete(key, db=self.store._db[db])  # only ever in the delta: gone for good

    def last_key(self, db: str) -> bytes | None:
        """The largest key of ``db`` in either layer (a deletion marker counts: an upper bound), ``None`` when
        both are empty."""

        def last(path, txn, handle) -> bytes | None:
            if txn is None or handle is None:
                return None
            try:
                cursor = txn.cursor(db=handle)
                return bytes(cursor.key()) if cursor.last() else None
            except _DAMAGE as exc:
                raise self.store.damaged(path, exc) from exc

        keys = [last(self.store.top_path, self.top, self.store._db[db])]
        if self.base is not None:
            keys.append(last(self.store.path, self.base, self.store._base_db[db]))
        return max((k for k in keys if k is not None), default=None)

    def prefixed(self, db: str, prefix: bytes) -> list[tuple[bytes, object]]:
        """``(key, raw value)`` of every live key of ``db`` that starts with ``prefix``, in key order: a range scan
        of each layer (the delta's keys override the base's)."""

        def scan(path, txn, handle) -> list:
            if txn is None or handle is None:
                return []
            out = []
            try:
                cursor = txn.cursor(db=handle)
                ok = cursor.set_range(prefix)
                while ok:
                    key = bytes(cursor.key())
                    if not key.startswith(prefix):
                        break
                    out.append((key, bytes(cursor.value())))
                    ok = cursor.next()
            except _DAMAGE as exc:
                raise self.store.damaged(path, exc) from exc
            return out

        top = scan(self.store.top_path, self.top, self.store._db[db])
        if self.base is None:
            return top
        merged = dict(scan(self.store.path, self.base, self.store._base_db[db]))
        merged.update(top)
        return sorted((k, v) for k, v in merged.items() if len(v))

    def items(self, db: str, values: bool = True) -> Iterator[tuple[bytes, object]]:
        """``(key, raw value)`` of every live key of ``db`` in key order (values ``None`` when not wanted)."""
        top_path = self.store.top_path
        if self.base is None:
            try:
                top = self.top.cursor(db=self.store._db[db])
                if values:
                    for key, value in top.iternext(keys=True, values=True):
                        yield bytes(key), value
                else:
                    for key in top.iternext(keys=True, values=False):
                        yield bytes(key), None
            except _DAMAGE as exc:
                raise self.store.damaged(top_path, exc) from exc
            return
        top = _cursor(self.store, top_path, self.top, self.store._db[db])
        bottom = _cursor(self.store, self.store.path, self.base, self.store._base_db[db])
        a = _next(self.store, top_path, top)
        b = _next(self.store, self.store.path, bottom)
        while a is not None or b is not None:
            if b is None or (a is not None and a[0] <= b[0]):
                if b is not None and a[0] == b[0]:
                    b = _next(self.store, self.store.path, bottom)
                if len(a[1]):
                    yield a
                a = _next(self.store, top_path, top)
            else:
                yield b
                b = _next(self.store, self.store.path, bottom)


def _cursor(store: "MetadataStore", path: Path, txn: lmdb.Transaction, db):
    try:
        return txn.cursor(db=db)
    except _DAMAGE as exc:
        raise store.damaged(path, exc) from exc


def _next(store: "MetadataStore", path: Path, cursor) -> tuple[bytes, object] | None:
    try:
        if not cursor.next():
            return None
        return bytes(cursor.key()), cursor.value()
    except _DAMAGE as exc:
        raise store.damaged(path, exc) from exc


def _reads(method):
    """Make a read of the store fail in one line: a damaged page (an LMDB error) or a value that is not our JSON
    becomes an ArtifactError naming the store (generators too: their errors come while they are iterated)."""

    def damaged(self, exc):
        return exc if isinstance(exc, ArtifactError) else self.damaged(self.layers, exc)

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def generator(self, *args, **kwargs):
            try:
                yield from method(self, *args, **kwargs)
            except (lmdb.Error, ValueError, TypeError, KeyError) as exc:
                raise damaged(self, exc) from exc

        return generator

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (lmdb.Error, ValueError, TypeError, KeyError) as exc:
            raise damaged(self, exc) from exc

    return wrapper


class MetadataStore:
    """The metadata of one generation (one layer, or a base plus a delta), opened for reading (shared,
    lock-free) or writing (one writer, on a store no reader sees yet)."""

    def __init__(self, path: str | os.PathLike, readonly: bool = True, delta: str | os.PathLike | None = None):
        """Open the store at ``path``; with ``delta``, the layered store of ``path`` (the base, always read-only
        then) under ``delta``.

        Args:
            readonly: open for reading; otherwise the top layer (``delta`` when given, else ``path``) is
                created if missing and written.

        Raises:
            ArtifactError: a missing or unreadable store.
        """
        self.path = Path(path)
        self.delta_path = Path(delta) if delta is not None else None
        self.readonly = readonly
        # read-only: a generation's records never change, so decoded ones are kept (at most RECORD_CACHE)
        self._cache: dict[int, ItemRecord | None] = {}
        self.env = self._base_env = None
        self._keys: list[tuple[int, int]] = []
        opening = self.path  # the layer being opened, for the message
        try:
            if self.delta_path is None:
                self.env = self._open(self.path, readonly)
            else:
                self._base_env = self._open(self.path, True)
                opening = self.delta_path
                self.env = self._open(self.delta_path, readonly)
            opening = self.top_path
            self._db = {name.decode(): self.env.open_db(name, create=not readonly) for name in _DBS}
            self._db.update(_optional_dbs(self.env, create=not readonly))
            opening = self.path
            self._base_db = (
                {name.decode(): self._base_env.open_db(name, create=False) for name in _DBS}
                if self._base_env is not None
                else None
            )
            if self._base_db is not None:
                self._base_db.update(_optional_dbs(self._base_env, create=False))
            if (
                not readonly and not self.layered and self._db.get("labels") is not None and self._is_empty()
            ):  # a new base: its label index is whole
                with self.env.begin(write=True) as txn:
                    txn.put(LABEL_INDEX, _dump(1), db=self._db["info"])
        except lmdb.Error as exc:
            self.close()
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if not readonly and opening == self.top_path and not isinstance(exc, _DAMAGE):  # creating it: I/O
                raise OutputError(
                    f"cannot write metadata store {opening} ({detail}); check free space and "
                    "permissions, then rerun the same command"
                ) from exc
            raise ArtifactError(
                f"cannot open metadata store {opening} ({detail}); rebuild with `moco index --rebuild`"
            ) from exc
        except OSError as exc:  # creating the folder of a writable store
            self.close()
            with output_errors(opening):
                raise exc
        except BaseException:
            self.close()
            raise

    def _is_empty(self) -> bool:
        with self.env.begin() as txn:
            return (
                txn.stat(self._db["items"])["entries"] == 0
                and txn.stat(self._db["tombstones"])["entries"] == 0
                and txn.get(b"next_id", db=self._db["info"]) is None
            )

    def _open(self, path: Path, readonly: bool) -> lmdb.Environment:
        if not readonly:
            return _open_writable(path)
        if not (path / DATA_FILE).is_file():
            raise ArtifactError(f"metadata store not found: {path}; rebuild with `moco index --rebuild`")
        env, key = _acquire_readonly(path)
        self._keys.append(key)
        return env

    @property
    def layered(self) -> bool:
        return self._base_env is not None

    @property
    def top_path(self) -> Path:
        """The layer reads look in first, and writes go to."""
        return self.delta_path or self.path

    @property
    def layers(self) -> str:
        """The store's layers, for a message that cannot tell which one is damaged."""
        return f"{self.path} or {self.delta_path}" if self.layered else str(self.top_path)

    def damaged(self, where, exc: Exception) -> ArtifactError:
        """The one-line error for a damaged page or value of this store (``where``: the layer, when known)."""
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return ArtifactError(f"metadata store {where} is damaged ({detail}); rebuild with `moco index --rebuild`")

    def close(self) -> None:
        if self.env is not None and not self.readonly:
            self.env.close()
        for key in self._keys:
            _release_readonly(key)
        self._keys = []
        self.env = self._base_env = None

    def __enter__(self) -> "MetadataStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- transactions -----------------------------------------------------------------------------------------
    def _read(self):
        store = self

        class _ReadView:
            def __enter__(self):
                self.top = store.env.begin(buffers=True)
                self.base = store._base_env.begin(buffers=True) if store._base_env is not None else None
                return _View(store, self.top, self.base)

            def __exit__(self, *exc):
                self.top.abort()
                if self.base is not None:
                    self.base.abort()

        return _ReadView()

    def _write(self, fn: Callable[[_View], object]):
        """Run ``fn`` in one write transaction, doubling the map size and replaying it when the map is full."""
        if self.readonly:
            raise IndexBuildError(f"metadata store {self.delta_path or self.path} is open read-only")
        while True:
            base = self._base_env.begin(buffers=True) if self._base_env is not None else None
            try:
                with self.env.begin(write=True) as txn:
                    return fn(_View(self, txn, base))
            except lmdb.MapFullError:
                size = self.env.info()["map_size"] * 2
                LOG.debug("LMDB map full; growing %s to %d MiB", self.delta_path or self.path, size >> 20)
                self.env.set_mapsize(size)
            except _DAMAGE as exc:  # a damaged page of the store being updated (or of the base it reads)
                raise self.damaged(self.layers, exc) from exc
            except (ValueError, TypeError, KeyError) as exc:  # a value in it that is not our JSON
                raise self.damaged(self.layers, exc) from exc
            except lmdb.Error as exc:  # I/O errors: a full disk is the usual one
                raise OutputError(
                    f"cannot write metadata store {self.delta_path or self.path} ({exc}); check free "
                    "space and rerun the same command"
                ) from exc
            finally:
                if base is not None:
                    base.abort()

    # -- reading ----------------------------------------------------------------------------------------------
    def _get(self, db: str, key: bytes):
        with self._read() as view:
            return _load(view.get(db, key))

    @_reads
    def record(self, item_id: int) -> ItemRecord | None:
        """The live record of ``item_id``, or ``None`` (unknown or tombstoned)."""
        return self.records([item_id])[0]

    @_reads
    def records(self, ids: Iterable[int]) -> list[ItemRecord | None]:
        """Records of many ids in one read transaction (``None`` where unknown).

        A read-only store keeps up to :data:`RECORD_CACHE` decoded records (dropped all at once when full):
        search results name the same items again and again, and reading and decoding one costs about 20 us
        (a folder of 10,000 queries with k = 20 read 250,000, a third of ``moco classify``'s time)."""
        ids = [int(i) for i in ids]
        known: dict[int, ItemRecord | None] = {}  # taken from the cache (another thread may clear it meanwhile)
        for i in ids:
            rec = self._cache.get(i, _MISSING) if i >= 0 else None
            if rec is not _MISSING:
                known[i] = rec
        missing = list(dict.fromkeys(i for i in ids if i not in known))
        if missing:
            with self._read() as view:
                found = {i: _load_item(view.get("items", id_key(i))) for i in missing}
            known.update(found)
            if self.readonly:
                if len(self._cache) + len(found) > RECORD_CACHE:
                    self._cache.clear()
                self._cache.update(found)
        return [known[i] for i in ids]

    @_reads
    def id_of_path(self, path: str) -> int | None:
        return self._get("paths", path_key(path))

    @_reads
    def ids_of_sha256(self, sha256: str) -> list[int]:
        return self._get("sha256", sha256.encode()) or []

    @_reads
    def tombstone(self, item_id: int) -> dict | None:
        return self._get("tombstones", id_key(item_id))

    @_reads
    def next_id(self) -> int:
        return self._get("info", b"next_id") or 0

    @_reads
    def count(self) -> int:
        """Live items (one pass over the keys when the store is layered)."""
        if not self.layered:
            with self.env.begin(db=self._db["items"]) as txn:
                return txn.stat(self._db["items"])["entries"]
        with self._read() as view:
            return sum(1 for _ in view.items("items", values=False))

    @_reads
    def live_ids(self) -> np.ndarray:
        """Sorted int64 ids of every live item (keys only: no record is decoded)."""
        with self._read() as view:
            return np.fromiter((int.from_bytes(k, "big") for k, _ in view.items("items", values=False)), dtype=np.int64)

    @property
    def has_label_index(self) -> bool:
        """Whether :meth:`label_ids` can answer (a store written with the ``labels`` database from its base on)."""
        return self._db.get("labels") is not None and bool(self._get("info", LABEL_INDEX))

    @_reads
    def label_ids(self, label: str) -> np.ndarray:
        """Sorted int64 ids of the live items of ``label``: one range scan of the ``labels`` database.

        Raises:
            ArtifactError: a store written before label filters existed (rebuild it).
        """
        if not self.has_label_index:
            raise ArtifactError(
                f"index metadata {self.top_path} was built before label filters; rebuild it with "
                "`moco index --rebuild` to filter by label"
            )
        prefix = label_prefix(label)
        with self._read() as view:
            keys = [k for k, _ in view.prefixed("labels", prefix)]
        return np.fromiter((int.from_bytes(k[-8:], "big") for k in keys), dtype=np.int64, count=len(keys))

    @_reads
    def path_prefix_ids(self, prefix: str) -> np.ndarray:
        """Sorted int64 ids of the live items whose relative path starts with ``prefix``: a range scan of the
        ``paths`` database (plus the few paths too long to be keys, keyed by their hash)."""
        raw = encode_name(prefix)
        if not raw:
            raise ValueError("an empty path prefix selects everything; pass no prefix instead")
        with self._read() as view:
            ids = [_load(v) for _, v in view.prefixed("paths", raw)]
            for _, value in view.prefixed("paths", b"\0"):  # long paths: the record has the path
                item_id = _load(value)
                if _load_item(view.get("items", id_key(item_id))).path.startswith(prefix):
                    ids.append(item_id)
        return np.unique(np.asarray(ids, dtype=np.int64))

    @_reads
    def iter_records(self) -> Iterator[ItemRecord]:
        """All live records in id order."""
        with self._read() as view:
            for _, value in view.items("items"):
                yield _load_item(value)

    @_reads
    def iter_ids_with_paths(self) -> Iterator[tuple[str, int]]:
        """``(path, id)`` of every live item, in path order."""
        with self._read() as view:
            for key, value in view.items("paths"):
                item_id = _load(value)
                if bytes(key[:1]) == b"\0":  # a long path, keyed by its hash: the record has it
                    yield _load_item(view.get("items", id_key(item_id))).path, item_id
                else:
                    yield decode_name(bytes(key)), item_id

    @_reads
    def skipped(self) -> dict[str, dict]:
        """Unreadable files remembered from earlier runs: path -> {path, bytes, mtime_ns, reason}."""
        with self._read() as view:
            return {info["path"]: info for info in (_load(v) for _, v in view.items("skipped"))}

    # -- writing ----------------------------------------------------------------------------------------------
    def remove_items(self, ids: list[int], generation: str) -> list[tuple[ItemRecord, bool]]:
        """Tombstone ``ids``; when a removed item was the original of duplicates, the next one becomes it.

        Returns:
            ``(record, copies_left)`` of each removed item: its record, and whether live items with its content
            remain (then one fewer of them counts as a duplicate).
        """
        removed: list[tuple[ItemRecord, bool]] = []
        for start in range(0, len(ids), WRITE_CHUNK):
            chunk = ids[start : start + WRITE_CHUNK]
            removed += self._write(lambda view: [self._remove_one(view, i, generation) for i in chunk])
        return removed

    def _remove_one(self, view: _View, item_id: int, generation: str) -> tuple[ItemRecord, bool]:
        key = id_key(item_id)
        rec = _load_item(view.get("items", key))
        if rec is None:
            raise IndexBuildError(
                f"metadata store {self.path} has no live item {item_id} to remove; rebuild with `moco index --rebuild`"
            )
        view.delete("items", key)
        if rec.label is not None and self._db.get("labels") is not None:
            view.delete("labels", label_key(rec.label, item_id))
        view.put(
            "tombstones",
            key,
            _dump({"id": item_id, "path": rec.path, "sha256": rec.sha256, "removed_in": generation}),
        )
        if _load(view.get("paths", path_key(rec.path))) == item_id:
            view.delete("paths", path_key(rec.path))
        sha_key = rec.sha256.encode()
        same = [i for i in (_load(view.get("sha256", sha_key)) or []) if i != item_id]
        if not same:
            view.delete("sha256", sha_key)
            return rec, False
        view.put("sha256", sha_key, _dump(same))
        if rec.duplicate_of is None:  # the original went away: the oldest copy takes its place
            for i in same:
                other = _load_item(view.get("items", id_key(i)))
                other = replace(other, duplicate_of=None if i == same[0] else same[0])
                view.put("items", id_key(i), other.to_json())
        return rec, True

    def add_items(self, records: list[ItemRecord | dict]) -> list[ItemRecord]:
        """Insert new live records (each with a fresh ``id``; a dict is read with
        :meth:`~indexer.records.ItemRecord.from_dict`); sets ``duplicate_of`` from their sha256.

        Returns:
            the records as stored (``duplicate_of`` set).
        """
        stored: list[ItemRecord] = []
        for start in range(0, len(records), WRITE_CHUNK):
            chunk = records[start : start + WRITE_CHUNK]
            stored += self._write(lambda view: self._add_chunk(view, chunk))
        return stored

    def _add_chunk(self, view: _View, chunk: list[ItemRecord | dict]) -> list[ItemRecord]:
        """One transaction's records: each id checked unused, its duplicates found (in the store and earlier in
        the chunk), then every database written in one ``putmulti`` (a full build writes 10M records: a put and a
        ``json.dumps`` per key per record cost more than LMDB itself)."""
        stored: list[ItemRecord] = []
        items, labels, paths = [], [], []
        shas: dict[bytes, list[int]] = {}  # sha256 -> its ids, read once and written once per chunk
        prefixes: dict[str, bytes] = {}  # label -> label_prefix(label)
        chunk = [ItemRecord.from_dict(rec) if isinstance(rec, dict) else rec for rec in chunk]
        fresh = _above_every_id(view, [rec.id for rec in chunk])
        keys: set[bytes] = set()  # the ids of the chunk (not yet in the store)
        for rec in chunk:
            key = id_key(rec.id)
            if not fresh and (
                key in keys or view.get("items", key) is not None or view.get("tombstones", key) is not None
            ):
                raise IndexBuildError(
                    f"id {rec.id} is already used in {self.path}; rebuild with `moco index --rebuild`"
                )
            sha_key = rec.sha256.encode()
            same = shas.get(sha_key)
            if same is None:
                same = shas[sha_key] = _load(view.get("sha256", sha_key)) or []
            original = same[0] if same else None
            if rec.duplicate_of != original:
                rec = replace(rec, duplicate_of=original)
            same.append(rec.id)
            keys.add(key)
            stored.append(rec)
            items.append((key, rec.to_json()))
            if rec.label is not None:  # a folder holds few labels: each one's bytes are encoded once a chunk
                prefix = prefixes.get(rec.label)
                if prefix is None:
                    prefix = prefixes[rec.label] = label_prefix(rec.label)
                labels.append((prefix + key, b"1"))  # label_key
            paths.append((path_key(rec.path), b"%d" % rec.id))  # (_dump of an int)
        view.put_many("items", items)
        if self._db.get("labels") is not None:
            view.put_many("labels", labels)
        view.put_many("paths", paths)
        view.put_many("sha256", [(k, _dump_ids(ids)) for k, ids in shas.items()])
        top = max((r.id for r in stored), default=-1)
        if top >= (_load(view.get("info", b"next_id")) or 0):
            view.put("info", b"next_id", _dump(top + 1))
        return stored

    def set_next_id(self, next_id: int) -> None:
        self._write(lambda view: view.put("info", b"next_id", _dump(int(next_id))))

    def replace_skipped(self, skipped: dict[str, dict]) -> None:
        """Replace the remembered unreadable files with ``skipped`` (path -> {path, bytes, mtime_ns, reason})."""

        def fn(view: _View):
            old = {k for k, _ in view.items("skipped", values=False)}
            new = {path_key(p): info for p, info in skipped.items()}
            for key in old - set(new):
                view.delete("skipped", key)
            for key, info in new.items():
                view.put("skipped", key, _dump(info))

        self._write(fn)

    def sync(self) -> None:
        """Flush everything to disk (before the generation is published)."""
        self.env.sync(True)


def materialize(base: Path, delta: Path, out: Path) -> None:
    """Write the store that ``base`` + ``delta`` read as into ``out`` as one layer (compaction): a compacted
    copy of the base with every key of the delta applied. Costs a sequential copy of the base plus the delta.
    """
    copy_store(base, out)
    with MetadataStore(out, readonly=False) as target, MetadataStore(delta) as source:
        for db in (name.decode() for name in _DBS + _OPTIONAL_DBS):
            if source._db.get(db) is None or target._db.get(db) is None:
                continue
            with source._read() as view:
                entries = [(k, bytes(v)) for k, v in _raw_items(view, db)]
            for start in range(0, len(entries), WRITE_CHUNK):
                chunk = entries[start : start + WRITE_CHUNK]

                def apply(v: _View, chunk=chunk, db=db):
                    for key, value in chunk:
                        if len(value) == 0:
                            if v.get(db, key) is not None:
                                v.delete(db, key)
                        else:
                            v.put(db, key, value)

                target._write(apply)
        target.sync()


def _raw_items(view: _View, db: str) -> Iterator[tuple[bytes, bytes]]:
    """Every key of one layer, deletion markers included."""
    cursor = view.top.cursor(db=view.store._db[db])
    for key, value in cursor.iternext(keys=True, values=True):
        yield bytes(key), value


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
