"""Writing files so that a crash (SIGKILL, power loss) leaves the old file or the new one, never a part of either.

A file is written under a staging name in its own folder (so the final rename stays on one file system), flushed
and fsync'ed, renamed over the target with os.replace (atomic on POSIX and Windows), then the folder is fsync'ed
so the rename itself is on disk. Staging names are recognisable (`.<name>.<16 hex>.tmp`): a process killed
mid-write leaves one behind, which the next write to the same path removes.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

TOKEN_HEX = 16  # characters of the random token in staging and data-file names


def new_token() -> str:
    return secrets.token_hex(TOKEN_HEX // 2)


def staging_path(path: Path, token: str) -> Path:
    return path.with_name(f".{path.name}.{token}.tmp")


def staging_pattern(path: Path) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(path.name)}\.[0-9a-f]{{{TOKEN_HEX}}}\.tmp")


def writable_target(path: object, what: str) -> str | None:
    """Why a file named `what` (for messages) cannot be written at `path`, or None: not a path, a NUL byte in
    it, its folder missing or not writable, or a folder itself. Writers check it before the work that fills the
    file, so a run never ends, hours in, at a rename that never could have happened."""
    if not isinstance(path, (str, os.PathLike)):
        return f"{what} is written to a file path, not {type(path).__name__}"
    path = Path(path)
    if "\0" in str(path):  # the OS cannot name it: open() would raise a ValueError, not an OSError
        return f"cannot write {what} {str(path)!r}: it contains a NUL byte"
    folder = path.absolute().parent
    if not folder.is_dir():
        return f"cannot write {what} {str(path)!r}: folder {str(folder)!r} does not exist"
    if path.is_dir():
        return f"cannot write {what} {str(path)!r}: it is a folder; name the file in it"
    # a read-only mount or a folder without write permission had been found by the staging file's open(), at the
    # end of a `train -o` run, whose steps were then lost. (Not on Windows, whose read-only attribute on a folder
    # does not stop files being created in it, but makes os.access say so.)
    effective = os.access in os.supports_effective_ids  # a setuid process writes as its effective user
    if os.name != "nt" and not os.access(folder, os.W_OK | os.X_OK, effective_ids=effective):
        return f"cannot write {what} {str(path)!r}: folder {str(folder)!r} is not writable (read-only or no permission)"
    return None


def fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable. Windows cannot open a folder; there os.replace is durable as it is."""
    if os.name == "nt":
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_durably(path: Path, write: Callable[[BinaryIO], None], durable: bool = True) -> None:
    """Create `path` (which must not exist) with `write`, then flush and (if `durable`) fsync it."""
    with open(path, "xb") as stream:
        write(stream)
        stream.flush()
        if durable:
            os.fsync(stream.fileno())


def unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def replace_atomically(path: Path, write: Callable[[BinaryIO], None], durable: bool = True) -> None:
    """Write `path` through a staging file: readers (and crashes) see the old contents or the new, whole.
    `durable=False`, for a cache whose reader takes a torn file for a missing one: no fsyncs (a process killed
    still leaves the old contents or the new, a power loss maybe neither), and the staging files of killed
    writes are left for the cache's own pruning (a scan of the folder per write would cost a large cache)."""
    replace_file(path, write, durable)
    if durable:
        settle(path)


def replace_file(path: Path, write: Callable[[BinaryIO], None], durable: bool = True) -> None:
    """replace_atomically up to its commit point: `path` holds the new contents once this returns, not yet durably.
    Apart from `settle`, for a writer whose cleanup must know whether the rename happened (export.save_atomic)."""
    path = Path(path)
    staged = staging_path(path, new_token())
    try:
        write_durably(staged, write, durable)
        os.replace(staged, path)
    finally:
        unlink_quietly(staged)  # only still there if writing or renaming failed


def settle(path: Path) -> None:
    """After replace_file: make the rename durable, and remove the staging files of killed writes to `path`."""
    path = Path(path)
    fsync_folder(path.absolute().parent)
    remove_matching(path.parent, [staging_pattern(path)], keep=set())


def remove_matching(folder: Path, patterns: Iterable[re.Pattern[str]], keep: set[str]) -> None:
    """Remove the files of `folder` whose whole name matches a pattern (leftovers of killed writes)."""
    patterns = list(patterns)
    for entry in os.scandir(folder):
        if entry.name not in keep and any(p.fullmatch(entry.name) for p in patterns):
            unlink_quietly(Path(entry.path))
