"""What one ``moco index`` run has to do: the difference between the image folder and the live generation.

Two ways to find it:

- a full rescan (the default): every image file's size and mtime (``indexer.scan``, directory entries and
  ``stat`` only) against the metadata of the live generation; files that vanished are removed;
- a *changed list* (``--changed-list FILE``): only the listed relative paths are looked at (stat'ed and
  looked up by path), the rest of the index is kept as it is. An update then costs what changed, not the
  size of the folder (a rescan of 1M files alone takes ~8 s here): listed files that exist are added or
  updated, listed files that are gone are removed.

Either way files whose size, mtime and label match their record are unchanged and never read again, and
unreadable files remembered from earlier runs are not retried until they change.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

from moco_retrieval.contracts.errors import ConfigError, DataError
from moco_retrieval.indexer.metadata import MetadataStore
from moco_retrieval.indexer.records import ItemRecord
from moco_retrieval.contracts.images import FoundFile, find_image_file
from moco_retrieval.indexer.scan import ScanResult

LOG = logging.getLogger(__name__)


@dataclass
class Plan:
    """The difference between the folder and the live generation."""

    todo: list[FoundFile]  # new or changed files, in path order
    changed_ids: dict[str, int]  # path -> old id, for changed files
    removed_ids: list[int]  # ids of vanished files
    unchanged: int
    skipped: dict[str, dict]  # path -> {path, bytes, mtime_ns, reason}: unreadable, not retried


def read_changed_list(path: str | os.PathLike) -> list[str]:
    """The relative paths of a ``--changed-list`` file: one per line; blank lines and ``#`` comments ignored.

    Raises:
        ConfigError: missing or unreadable file.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"--changed-list file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read --changed-list {path}: {exc}") from exc
    out = []
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(Path(line).as_posix())
    return sorted(set(out))


def scan_listed(root: Path, paths: list[str], labels: dict[str, str] | None) -> tuple[ScanResult, list[str]]:
    """Stat only ``paths`` under ``root``: ``(their scan, paths that are gone or no image name)``.

    Raises:
        DataError: ``root`` is missing.
    """
    if not Path(root).is_dir():
        raise DataError(f"image folder not found: {root}")
    entries, skipped, gone = [], [], []
    for rel in paths:
        found = find_image_file(root, rel)
        if found is None:
            gone.append(rel)
        elif found.skip_reason is not None:
            skipped.append((found.path, found.skip_reason))
        else:
            entries.append(found if labels is None else replace(found, label=labels.get(found.path)))
    return ScanResult(root=Path(root), entries=entries, skipped=skipped), gone


def plan_full(entries: list[FoundFile], store: MetadataStore | None) -> Plan:
    """Split the scanned files into unchanged, to-embed (new or changed) and removed, against ``store``."""
    if store is None:
        return Plan(todo=list(entries), changed_ids={}, removed_ids=[], unchanged=0, skipped={})
    records = {rec.path: rec for rec in store.iter_records()}  # one pass in id order: 2x faster than by path
    plan = _compare(entries, records, store.skipped())
    present = {e.path for e in entries}
    plan.removed_ids = sorted(rec.id for path, rec in records.items() if path not in present)
    return plan


def plan_listed(entries: list[FoundFile], gone: list[str], store: MetadataStore | None) -> Plan:
    """The plan for a changed list: ``entries`` (listed files that exist) and ``gone`` (listed, not there)."""
    if store is None:
        raise DataError("--changed-list updates an existing index; build it first with a full `moco index`")
    listed = [e.path for e in entries] + gone
    ids = {p: store.id_of_path(p) for p in listed}
    found = [i for i in ids.values() if i is not None]
    records = {rec.path: rec for rec in store.records(found) if rec is not None}
    old_skipped = store.skipped()
    plan = _compare(entries, records, old_skipped)
    # unreadable files not listed stay remembered as they were
    for path, info in old_skipped.items():
        if path not in ids:
            plan.skipped[path] = info
    plan.removed_ids = sorted(ids[p] for p in gone if ids.get(p) is not None)
    return plan


def _compare(entries: list[FoundFile], records: dict[str, ItemRecord], old_skipped: dict[str, dict]) -> Plan:
    todo, changed, unchanged, skipped = [], {}, 0, {}
    for e in entries:
        rec = records.get(e.path)
        if rec is not None and rec.bytes == e.bytes and rec.mtime_ns == e.mtime_ns and rec.label == e.label:
            unchanged += 1
            continue
        was_skipped = old_skipped.get(e.path)
        if rec is None and was_skipped and was_skipped["bytes"] == e.bytes and was_skipped["mtime_ns"] == e.mtime_ns:
            skipped[e.path] = was_skipped  # still the same unreadable file: not read again
            continue
        if rec is not None:
            changed[e.path] = rec.id
        todo.append(e)
    return Plan(todo=todo, changed_ids=changed, removed_ids=[], unchanged=unchanged, skipped=skipped)
