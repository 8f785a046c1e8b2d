"""Safe writes into goose's cache folders (dequantized models, cost curves, compiled kernels, datastores), and
the checks every entry passes before it is used.

Every cache entry is written the same way, so a crash, ``kill -9`` or a second process never leaves or
reuses a half-written entry:

* `lock(target)`: an exclusive ``fcntl.flock`` on ``<target>.lock`` beside the entry, held while it is
  checked and (re)built. A process that waits for the lock finds the entry complete when it gets it. The
  kernel drops the lock when its holder dies, however it dies. The lock file is opened without following a
  symbolic link (one planted there is refused, `UnsafeCache`).
* `temp_path(target)`: the entry is first written under a temporary name in the same folder
  (``.<name>.tmp-<pid>-<random>``), then renamed into place (`os.replace`, atomic on one file system).
  Readers see either no entry or a complete one.
* `clean_stale(folder)`: temporaries left by a process that is gone (or older than `STALE_S`) are removed;
  called under the lock before each write.

Every entry carries the digest of its bytes (`digest`: sha256 of each 8 MiB chunk, hashed on all the CPUs,
then sha256 of the chunks' digests), checked before it is used:

* a one-file entry (a compiled kernel, packed panels, a cost curve) has a sidecar ``<name>.digest`` beside it
  (`seal_file`, written under the entry's lock once the entry is in place; `write_bytes` seals what it
  writes under the cache root), checked by `check_file`;
* a folder entry (a model copy, a GGUF's small folder, a datastore) holds ``goose-digest.json`` listing
  every file with its size and digest (`seal_dir`, written into the temporary folder before it is renamed
  into place), checked by `check_dir`: the same files, sizes and digests.

A check returns why an entry cannot be used (None when it is whole); its owner then builds the entry again,
or refuses it when goose cannot (a datastore). An entry written by an older goose has no digest and is built
again once.

Ownership: the cache root is created with mode 0700 (`make_dirs`). An entry (and its digest, its lock, and
each folder from it up to the cache root) that another user owns, or that group or others may write, is
refused (`check_owner` raises `UnsafeCache` naming the file): never loaded, rebuilt or removed. A compiled
kernel loaded from a place others can write would run their code.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

from .errors import GooseError
from .paths import cache_root

TMP_TAG = ".tmp-"
STALE_S = 6 * 3600  # a temporary this old is abandoned even if its pid now belongs to another process
DIGEST_SUFFIX = ".digest"  # the sidecar of a one-file entry
MANIFEST = "goose-digest.json"  # the digest of a folder entry, inside it
CHUNK = 8 << 20  # bytes per hashed chunk (chunks are hashed in parallel threads)
ALGORITHM = "sha256 of 8 MiB chunks"
# the cache's folders that hold entries (`verify_tree`); every other file or folder in them is an entry
CONTAINERS = ("", "kernels", "models", "models/blocks", "models/panels", "cost", "datastores")


class UnsafeCache(GooseError):
    """A cache file another user owns or that group or others may write, or a symbolic link where goose
    keeps a file: refused, never loaded."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"refusing {path}: {reason}")
        self.path, self.reason = Path(path), reason


# ---- ownership ------------------------------------------------------------------------------------------

def _uid() -> int:
    """The user whose cache files goose uses (tests stand in another one here)."""
    return os.geteuid()


def _refuse_unsafe(path: Path, st: os.stat_result) -> None:
    """Raise `UnsafeCache` unless `st` (of `path`) is not a link, owned by this user, unwritable by others."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCache(path, "it is a symbolic link, and goose's cache holds none (remove it)")
    if st.st_uid != _uid():
        raise UnsafeCache(path, f"it is owned by uid {st.st_uid}, not by this user (uid {_uid()}); goose uses "
                                "only cache files it wrote itself")
    if st.st_mode & 0o022:
        raise UnsafeCache(path, f"group or others may write it (mode {stat.S_IMODE(st.st_mode):o}); "
                                f"fix with: chmod go-w {path} (or empty the cache: goose cache clear)")


def _in_cache(path: Path) -> bool:
    return Path(path).is_relative_to(cache_root())


def check_owner(path: Path) -> None:
    """Raise `UnsafeCache` unless `path` (not followed when a link) belongs to this user and group and others
    cannot write it, and the same holds for each folder from it up to the cache root (those followed: the
    root or one of its folders may be a link to another disk)."""
    path = Path(path)
    _refuse_unsafe(path, path.lstat())
    root = cache_root()
    for folder in path.parents:
        if not folder.is_relative_to(root):
            break
        _refuse_unsafe(folder, folder.stat())


def make_dirs(folder: Path) -> None:
    """Create `folder` and its parents; those this creates from the cache root down get mode 0700 (whatever
    the umask: it only takes bits away)."""
    folder, root = Path(folder), cache_root()
    if not folder.is_relative_to(root):
        folder.mkdir(parents=True, exist_ok=True)
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    for p in reversed([folder, *folder.parents]):
        if p.is_relative_to(root):
            with contextlib.suppress(FileExistsError):
                os.mkdir(p, 0o700)


def open_new(path: Path, mode: int = 0o644):
    """A new file `path` opened for binary writing, `mode` at most (never a link, never an existing file)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, mode), "wb")


def private_dirs(folder: Path) -> None:
    """Create `folder` and its missing parents with mode 0700 (whatever the umask: it only takes bits away)."""
    folder = Path(folder)
    for p in reversed([folder, *folder.parents]):
        if not p.exists():
            with contextlib.suppress(FileExistsError):
                os.mkdir(p, 0o700)


def refuse_unsafe(path: Path) -> None:
    """`UnsafeCache` when `path` (not followed) is a link, another user's, or writable by group or others."""
    _refuse_unsafe(Path(path), Path(path).lstat())


# ---- locks and atomic writes ----------------------------------------------------------------------------

@contextlib.contextmanager
def lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on `target` (a file or folder, existing or not) for the ``with`` block."""
    target = Path(target)
    make_dirs(target.parent)
    name = target.with_name(target.name + ".lock")
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeCache(name, "it is a symbolic link where goose keeps a lock file (remove it)") from None
        raise
    try:
        _refuse_unsafe(name, os.fstat(fd))
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
        if not _is_temp(p.name):
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


def _is_temp(name: str) -> bool:
    return name.startswith(".") and TMP_TAG in name


def remove(path: Path) -> None:
    """Delete a file or folder if it exists (never follows a link into a folder)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_entry(path: Path) -> None:
    """Delete a one-file entry and its digest."""
    remove(path)
    remove(sidecar(path))


def _replace_file(target: Path, data: bytes) -> None:
    make_dirs(target.parent)
    tmp = temp_path(target)
    try:
        with open_new(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_bytes(target: Path, data: bytes) -> None:
    """Atomically replace the file `target` with `data` (temp in the same folder, fsync, rename); under the
    cache root its digest is written beside it (`seal_file`). The caller holds `lock(target)` when several
    processes may write it."""
    target = Path(target)
    _replace_file(target, data)
    if _in_cache(target):
        seal_file(target, data)


def write_text(target: Path, text: str) -> None:
    write_bytes(target, text.encode("utf-8"))


def write_entry(target: Path, data: bytes) -> None:
    """`write_bytes`, with the digest beside it wherever `target` is (an entry read back with `read_entry`,
    such as a cost curve at a path the caller chose). The caller holds `lock(target)`."""
    _replace_file(Path(target), data)
    seal_file(target, data)


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


# ---- digests --------------------------------------------------------------------------------------------

def _parallel(fn: Callable, items: list) -> list:
    """`fn` of each item, on up to one thread per usable CPU (hashlib releases the GIL while it hashes)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    workers = min(len(items), cpus)
    if workers <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def _combine(size: int, parts: list[bytes]) -> str:
    h = hashlib.sha256(f"{ALGORITHM}|{size}|".encode())
    for p in parts:
        h.update(p)
    return h.hexdigest()


def digest(data) -> str:
    """The digest of a bytes-like object: sha256 of each `CHUNK`, hashed in parallel, then sha256 of the
    size and the chunks' digests."""
    view = memoryview(data).cast("B")
    return _combine(len(view), _parallel(lambda at: hashlib.sha256(view[at:at + CHUNK]).digest(),
                                         list(range(0, len(view), CHUNK))))


def file_digest(path: Path) -> tuple[int, str]:
    """``(size, digest)`` of the file `path`, its chunks read and hashed in parallel."""
    with open(path, "rb") as f:
        fd, size = f.fileno(), os.fstat(f.fileno()).st_size
        parts = _parallel(lambda at: hashlib.sha256(os.pread(fd, CHUNK, at)).digest(),
                          list(range(0, size, CHUNK)))
    return size, _combine(size, parts)


def sidecar(path: Path) -> Path:
    """Where the digest of the one-file entry `path` is kept."""
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


def seal_file(path: Path, data=None) -> None:
    """Write the digest of the file `path` (whose bytes are `data`, when the caller has them) beside it,
    atomically. The caller holds `lock(path)`."""
    size, hexdigest = file_digest(path) if data is None else (memoryview(data).nbytes, digest(data))
    record = {"algorithm": ALGORITHM, "bytes": size, "sha256": hexdigest}
    _replace_file(sidecar(path), json.dumps(record).encode())


def _record(path: Path) -> dict | str:
    """The JSON object in the digest file `path`, or why there is none to check against."""
    try:
        check_owner(path)
        record = json.loads(path.read_bytes())
    except FileNotFoundError:
        return "it has no digest: written by an older goose, or not by goose"
    except (OSError, ValueError):
        return f"its digest {path.name} is unreadable"
    if not isinstance(record, dict) or record.get("algorithm") != ALGORITHM:
        return f"its digest {path.name} is not one goose writes"
    return record


def check_file(path: Path, data=None) -> str | None:
    """Why the one-file entry `path` cannot be used (no digest, or its size or bytes differ from it), or None
    when it is whole. `data`: its bytes, when the caller has read them. Raises `UnsafeCache` (`check_owner`)
    and FileNotFoundError when there is no entry."""
    path = Path(path)
    check_owner(path)
    record = _record(sidecar(path))
    if isinstance(record, str):
        return record
    size = path.lstat().st_size if data is None else memoryview(data).nbytes
    if record.get("bytes") != size:
        return f"it holds {size} bytes where its digest says {record.get('bytes')}"
    hexdigest = file_digest(path)[1] if data is None else digest(data)
    return None if record.get("sha256") == hexdigest else "its bytes do not match its digest"


def read_entry(path: Path) -> bytes | None:
    """The bytes of the one-file entry `path`, or None when it is missing or fails `check_file`."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    return data if check_file(path, data) is None else None


def _files(folder: Path) -> list[str]:
    """Every file under `folder` but its digest (links included, not followed), as sorted relative paths."""
    out = []
    for parent, dirs, names in os.walk(folder):
        rel = Path(parent).relative_to(folder)
        out += [(rel / n).as_posix() for n in names + [d for d in dirs if os.path.islink(os.path.join(parent, d))]]
    return sorted(f for f in out if f != MANIFEST)


def seal_dir(folder: Path) -> None:
    """Write the digest of every file in `folder` into it (``goose-digest.json``), and take group and others'
    write permission off the folder and everything in it (what the umask let through): called on the
    finished temporary folder, before it is renamed into place."""
    folder = Path(folder)
    for parent, dirs, names in os.walk(folder):
        for p in [parent, *(os.path.join(parent, n) for n in dirs + names)]:
            if not os.path.islink(p):
                os.chmod(p, stat.S_IMODE(os.lstat(p).st_mode) & ~0o022)
    files = {}
    for rel in _files(folder):
        size, hexdigest = file_digest(folder / rel)
        files[rel] = {"bytes": size, "sha256": hexdigest}
    text = json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1, sort_keys=True) + "\n"
    with open_new(folder / MANIFEST) as f:
        f.write(text.encode())


def check_dir(folder: Path) -> str | None:
    """Why the folder entry `folder` cannot be used (no digest, a file missing, added, resized or changed),
    or None when it is whole. Raises `UnsafeCache` for it or any file in it (`check_owner`)."""
    folder = Path(folder)
    check_owner(folder)
    record = _record(folder / MANIFEST)
    if isinstance(record, str):
        return record
    files, present = record.get("files"), _files(folder)
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        return f"its digest {MANIFEST} is unreadable"
    for rel in present:
        check_owner(folder / rel)
    if set(present) != set(files):
        extra, missing = sorted(set(present) - set(files)), sorted(set(files) - set(present))
        return f"{missing[0]} is missing" if missing else f"{extra[0]} is not in its digest"
    for rel in present:
        size = (folder / rel).lstat().st_size
        if files[rel].get("bytes") != size:
            return f"{rel} holds {size} bytes where its digest says {files[rel].get('bytes')}"
    for rel in present:
        if files[rel].get("sha256") != file_digest(folder / rel)[1]:
            return f"{rel} does not match its digest"
    return None


# ---- the whole cache ------------------------------------------------------------------------------------

def entries(root: Path) -> list[Path]:
    """Every entry and lock file in the cache at `root` (the files and folders in its `CONTAINERS`, but
    digests and temporaries)."""
    root = Path(root)
    containers = {root / c for c in CONTAINERS}
    out = []
    for folder in sorted(containers):
        if folder.is_dir():
            out += [p for p in sorted(folder.iterdir()) if p not in containers
                    and not p.name.endswith(DIGEST_SUFFIX) and not _is_temp(p.name)]
    return out


def verify_tree(root: Path | None = None) -> tuple[int, list[tuple[Path, str]]]:
    """``(entries checked, [(path, why) of each bad one])`` for the cache at `root` (default: the cache root):
    the root itself (followed when a link: owned by this user, unwritable by others), then every entry."""
    root = Path(root or cache_root())
    try:
        _refuse_unsafe(root, root.stat())
    except UnsafeCache as exc:
        return 0, [(root, exc.reason)]
    found = entries(root)
    bad = [(p, why) for p in found if (why := verify(p)) is not None]
    return len(found), bad


def clear(root: Path | None = None) -> None:
    """Delete everything in the cache at `root` (default: the cache root), once the root passes the checks
    of `verify_tree`."""
    root = Path(root or cache_root())
    _refuse_unsafe(root, root.stat())
    for p in sorted(root.iterdir()):
        remove(p)


def verify(path: Path) -> str | None:
    """Why the entry or lock file `path` cannot be used (a damaged or unowned entry), or None."""
    path = Path(path)
    try:
        if path.name.endswith(".lock"):
            check_owner(path)
            return None
        return check_dir(path) if path.is_dir() and not path.is_symlink() else check_file(path)
    except UnsafeCache as exc:
        return exc.reason if exc.path == path else f"{exc.path}: {exc.reason}"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
