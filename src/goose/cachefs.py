"""Safe writes into goose's cache folders (dequantized models, cost curves, compiled kernels, datastores).

Every cache entry is written the same way, so a crash, ``kill -9`` or a second process never leaves or
reuses a half-written entry:

* `lock(target)`: an exclusive ``fcntl.flock`` on ``<target>.lock`` beside the entry, held while it is
  checked and (re)built. A process that waits for the lock finds the entry complete when it gets it. The
  kernel drops the lock when its holder dies, however it dies.
* `temp_path(target)`: the entry is first written under a temporary name in the same folder
  (``.<name>.tmp-<pid>-<random>``), then renamed into place (`os.replace`, atomic on one file system).
  Readers see either no entry or a complete one.
* `clean_stale(folder)`: temporaries left by a process that is gone (or older than `STALE_S`) are removed;
  called under the lock before each write.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Iterator

TMP_TAG = ".tmp-"
STALE_S = 6 * 3600  # a temporary this old is abandoned even if its pid now belongs to another process


@contextlib.contextmanager
def lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on `target` (a file or folder, existing or not) for the ``with`` block."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.with_name(target.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def temp_path(target: Path) -> Path:
    """A fresh temporary name beside `target`, owned by this process (see `clean_stale`)."""
    target = Path(target)
    return target.with_name(f".{target.name}{TMP_TAG}{os.getpid()}-{secrets.token_hex(4)}")


def _owner_alive(name: str) -> bool:
    try:
        pid = int(name.rsplit(TMP_TAG, 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_stale(folder: Path, now: float | None = None) -> list[Path]:
    """Remove the temporaries in `folder` whose process is gone or that are older than `STALE_S`."""
    folder = Path(folder)
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for p in entries:
        if not p.name.startswith(".") or TMP_TAG not in p.name:
            continue
        try:
            age = now - p.lstat().st_mtime
        except OSError:
            continue
        if _owner_alive(p.name) and age < STALE_S:
            continue
        remove(p)
        removed.append(p)
    return removed


def remove(path: Path) -> None:
    """Delete a file or folder if it exists (never follows a link into a folder)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def write_bytes(target: Path, data: bytes) -> None:
    """Atomically replace the file `target` with `data` (temp in the same folder, fsync, rename).
    The caller holds `lock(target)` when several processes may write it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(target)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_text(target: Path, text: str) -> None:
    write_bytes(target, text.encode("utf-8"))


def replace_dir(tmp: Path, target: Path) -> None:
    """Move the finished folder `tmp` to `target`, replacing an older `target` (readers that opened files
    of the old one keep them: they are unlinked, not truncated). The caller holds `lock(target)`."""
    tmp, target = Path(tmp), Path(target)
    old = None
    if target.exists():
        old = temp_path(target)
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        remove(old)
