"""Checkpoint directories on disk: atomic commit, integrity records, discovery of the latest one.

[Note: atomic checkpoint commit]
A checkpoint is a directory. Every save writes into a hidden sibling ``.<name>.tmp``; every rank
fsyncs the files it wrote (DCP's ``sync_files``); rank 0 writes the manifest last (the file that
makes a directory a complete checkpoint), fsyncs it and the directory, then renames the directory
into place and fsyncs the parent. ``rename(2)`` of a directory is atomic on POSIX file systems, so
a reader sees either the previous checkpoint or the new one, never a mixture:

- killed while writing data or the manifest: only ``.<name>.tmp`` is incomplete; the previous
  checkpoints are untouched, and the next save to that name deletes the leftover;
- replacing an existing ``<name>`` takes two renames (``<name>`` -> ``.<name>.old``, then
  ``.<name>.tmp`` -> ``<name>``). Killed between them, ``<name>`` is missing and ``.<name>.old``
  holds the previous, complete checkpoint: ``resolve_checkpoint`` reads it from there, and the next
  save renames it back before starting.

DCP needs every rank to see the same directory (a shared file system for multi-node runs), as
torch's ``FileSystemWriter`` always does.

[Note: checkpoint integrity]
DCP itself detects a missing or truncated ``.metadata`` but not a data file cut short after the
last item it reads, nor flipped bytes: ``torch.load`` of a damaged item may succeed with wrong
numbers. So the manifest records every file's size and CRC-32. Loading checks all sizes on every
rank (one ``stat`` each) and the CRCs split across ranks (rank r hashes files r, r + world, ...),
then agrees on the verdict with one collective, so every rank raises the same error before the
model is touched. CRC-32 catches truncation, zeroed pages and bit flips; it is not a defence
against deliberate tampering (DCP unpickles its metadata anyway: load checkpoints you trust).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

__all__ = [
    "MANIFEST_NAME",
    "STEP_DIR_PATTERN",
    "checkpoint_path",
    "list_checkpoints",
    "damaged_checkpoints",
    "latest_checkpoint",
    "tmp_dir_for",
    "old_dir_for",
    "standing_checkpoint",
    "fsync_dir",
    "write_json_durably",
    "read_manifest",
    "file_record",
    "FileRecord",
]

MANIFEST_NAME = "zbuf-manifest.json"
"""The file whose presence makes a directory a complete zbuf checkpoint (written last)."""

STEP_DIR_PATTERN = re.compile(r"^step_(\d+)$")
"""Names of the checkpoints ``checkpoint_path`` creates under a checkpoint root."""

_CHUNK = 8 << 20


class FileRecord(NamedTuple):
    """What the manifest records about one file of a checkpoint."""

    nbytes: int
    crc32: int


def checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    """The conventional directory of step ``step``'s checkpoint under ``root``: ``root/step_00000042``.

    ``latest_checkpoint(root)`` finds these; any other directory works with save/load too.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return Path(root) / f"step_{step:08d}"


def tmp_dir_for(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp"


def old_dir_for(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def is_complete(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file()


def standing_checkpoint(path: Path) -> Optional[Path]:
    """The complete checkpoint that stands for ``path``: ``path`` itself, or the ``.<name>.old``
    a replace cut short between its renames left ([Note: atomic checkpoint commit]); None."""
    if is_complete(path):
        return path
    old = old_dir_for(path)
    return old if is_complete(old) else None


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete ``step_<N>`` checkpoints under ``root`` as ``(step, path)``, oldest first.

    A checkpoint whose replacement was interrupted ([Note: atomic checkpoint commit]) is listed
    under its real name's path, read from ``.<name>.old``. Unfinished saves are ignored.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for entry in root.iterdir():
        name = entry.name
        if name.startswith(".") and name.endswith(".old"):
            name = name[1:-4]
        m = STEP_DIR_PATTERN.match(name)
        if not m or not entry.is_dir() or not is_complete(entry):
            continue
        step = int(m.group(1))
        # a real directory beats a leftover .old of the same name
        if step not in found or not entry.name.startswith("."):
            found[step] = entry
    return sorted(found.items())


def damaged_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path, str]]:
    """``step_<N>`` directories under ``root`` that are not complete checkpoints, as ``(step,
    path, what is wrong)``, oldest first. A save never leaves one ([Note: atomic checkpoint
    commit]: an unfinished save is a hidden ``.<name>.tmp``), so each is a checkpoint damaged
    after its save (its manifest deleted), or a directory zbuf did not write."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = STEP_DIR_PATTERN.match(entry.name)
        if m and entry.is_dir() and not is_complete(entry):
            what = "it is empty" if not any(entry.iterdir()) else \
                f"it has no {MANIFEST_NAME}, the file a save writes last"
            found.append((int(m.group(1)), entry, what))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The complete checkpoint with the highest step under ``root``, or None if there is none.

    "Latest" is by step number in the directory name (``step_<N>``), never by modification time,
    so copying a checkpoint directory around does not change which one resumes.
    """
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)  # insertion order: model order, optimizer key order
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(path: Path) -> dict:
    """The parsed manifest; ``ValueError`` with the reason when it is missing or unreadable."""
    mpath = path / MANIFEST_NAME
    try:
        text = mpath.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"it has no {MANIFEST_NAME} (a save that never finished, or not a zbuf checkpoint)") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"its {MANIFEST_NAME} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "zbuf-checkpoint":
        raise ValueError(f"its {MANIFEST_NAME} is not a zbuf checkpoint manifest")
    return manifest


def file_record(path: Path) -> FileRecord:
    crc = 0
    nbytes = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            nbytes += len(chunk)
    return FileRecord(nbytes, crc)


def data_files(path: Path) -> list[str]:
    """Files of a checkpoint directory that the manifest covers (all but the manifest), sorted."""
    return sorted(
        p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST_NAME and not p.name.endswith(".partial")
    )


def check_files(path: Path, records: dict[str, list[int]], rank: int, world: int, *, checksums: bool = True) -> list[str]:
    """Problems found in ``path``'s files: all sizes, and (``checksums``) the CRCs of this rank's share.

    ``records``: the manifest's ``files`` (name -> [nbytes, crc32]). See [Note: checkpoint integrity].
    """
    problems = []
    for i, (name, (nbytes, crc)) in enumerate(sorted(records.items())):
        fpath = path / name
        try:
            size = fpath.stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size != nbytes:
            how = "truncated" if size < nbytes else "longer than written"
            problems.append(f"{name} is {how}: {size} bytes, the manifest says {nbytes}")
            continue
        if checksums and i % world == rank:
            actual = file_record(fpath)
            if actual.crc32 != crc:
                problems.append(f"{name} is corrupted: CRC-32 {actual.crc32:08x}, the manifest says {crc:08x}")
    return problems


def prepare_tmp_dir(path: Path) -> Path:
    """Rank 0, before a save: undo an interrupted replace, clear a stale temp dir, create it."""
    old = old_dir_for(path)
    if old.is_dir() and not path.exists() and is_complete(old):
        old.rename(path)
    elif old.exists():
        shutil.rmtree(old)
    tmp = tmp_dir_for(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, path: Path) -> None:
    """Rank 0, after every rank wrote and the manifest is in ``tmp``: [Note: atomic checkpoint commit]."""
    fsync_dir(tmp)
    old = old_dir_for(path)
    replacing = path.exists()
    if replacing:
        path.rename(old)
    from .. import faults

    faults.fault_point("checkpoint.between_renames")
    tmp.rename(path)
    fsync_dir(path.parent)
    if replacing:
        shutil.rmtree(old)


def prune(root: str | os.PathLike, keep_last: int,
          only: Optional[Callable[[Path], bool]] = None) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete ``step_<N>`` checkpoints under ``root``.

    ``only``: when given, only checkpoints for which ``only(path)`` is true count and can be
    deleted; the others are left alone (``zbuf train`` passes "written by this run").
    Call it from one rank after a save returned (every rank has finished by then). Returns the
    deleted paths.
    """
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    found = [p for _, p in list_checkpoints(root) if only is None or only(p)]
    doomed = found[:-keep_last]
    for p in doomed:
        shutil.rmtree(p)
    return doomed
