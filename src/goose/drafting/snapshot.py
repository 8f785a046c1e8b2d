"""Snapshots of the suffix memories (`MemoryPool`): what `goose serve --memory-snapshot PATH` writes at an
interval and on shutdown, and loads when it starts, so a restarted server (or another replica of the same model)
drafts from earlier requests at once instead of starting cold.

A snapshot is one self-contained file (it can be copied to another machine): a first line naming the format, a
JSON header line, then every stored token as a little-endian int32. The header holds the snapshot's `identity`
(the model and tokenizer it was made with, the memory's k-gram length and goose's snapshot format: `identity`
in the server), each tenant's sequences' lengths (least recently used first, so a load restores the order of
eviction), and the sha256 and size of the tokens. It is written to a temporary file beside `path` under a lock,
flushed to disk and renamed over `path`, so a reader sees the old snapshot or the new one, never half of one.

The file holds every tenant's prompts and answers (as token ids): it is as sensitive as the traffic. It is
created with mode 0600 (never through a link, never over an existing temporary), missing folders with 0700,
and a snapshot or folder that is a link, another user's, or writable by group or others is refused.

`read_snapshot` refuses, in one line naming the file and what is wrong, a file that is not a snapshot, a
damaged one (its tokens' digest or size differs from the header, or a token is out of the vocabulary), and a
foreign one (made for another model, tokenizer or memory setting): nothing of it is loaded. Every header field
is checked for its type and range (counts are integers >= 0, names and digests strings), so no header value can
raise anything but that one-line `GooseError`. A snapshot shapes drafts only, never outputs, but one of another
model would only waste the memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from array import array
from pathlib import Path

from .. import cachefs
from ..errors import GooseError

MAGIC = b"goose-memory-snapshot 1\n"
MAX_HEADER_BYTES = 64 << 20  # the JSON header line (tenant names and sequence lengths)


def write_snapshot(path: str | Path, identity: dict, tenants: list[tuple[str, list[bytes]]]) -> int:
    """Write `tenants` (name, each sequence's tokens as int32 bytes; least recently used first) with `identity`
    atomically to `path`; returns the bytes written."""
    path = Path(path)
    blobs = [blob for _, seqs in tenants for blob in seqs]
    tokens = b"".join(blobs) if sys.byteorder == "little" else b"".join(_swapped(b) for b in blobs)
    header = {"identity": identity, "tenants": [[name, [len(b) // 4 for b in seqs]] for name, seqs in tenants],
              "tokens_bytes": len(tokens), "tokens_sha256": hashlib.sha256(tokens).hexdigest()}
    data = MAGIC + json.dumps(header, separators=(",", ":")).encode("utf-8") + b"\n" + tokens
    cachefs.private_dirs(path.parent)
    _check_folder(path)
    with cachefs.lock(path):
        if path.exists() or path.is_symlink():
            _check_file(path)  # (its folder was checked above)
        tmp = cachefs.temp_path(path)
        try:
            with cachefs.open_new(tmp, 0o600) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return len(data)


def read_snapshot(path: str | Path, identity: dict, vocab: int) -> list[tuple[str, list[array]]]:
    """The tenants of the snapshot at `path` (name, its sequences' tokens as ``array('i')`` slices, 4 bytes a
    token; least recently used first), after checking it whole, safe to read and made for `identity`;
    GooseError (one line naming the file) otherwise."""
    path = Path(path)
    try:
        check_safe(path)
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise _refused(path, "not a goose memory snapshot (or another version of the format)")
            line = f.readline(MAX_HEADER_BYTES + 1)
            tokens = f.read()
    except OSError as exc:
        raise GooseError(f"cannot read the memory snapshot {path}: {exc.strerror or exc}") from None
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):
        raise _refused(path, "its header is damaged (not JSON)") from None
    names, size, digest, theirs = _header(header, path)
    foreign = [f"{k} {theirs.get(k)!r} vs {v!r}" for k, v in identity.items() if theirs.get(k) != v]
    if foreign:
        raise _refused(path, "made for another model or setting: " + "; ".join(foreign))
    if len(tokens) != size or size % 4 or hashlib.sha256(tokens).hexdigest() != digest \
            or sum(n for _, lengths in names for n in lengths) * 4 != size:
        raise _refused(path, "it is damaged (its tokens differ from its header's size or digest)")
    flat = array("i")
    flat.frombytes(tokens)
    if sys.byteorder != "little":
        flat.byteswap()
    if flat and not 0 <= min(flat) <= max(flat) < vocab:
        raise _refused(path, f"it holds token ids outside the vocabulary of {vocab}")
    out, at = [], 0
    for name, lengths in names:
        seqs = []
        for n in lengths:
            seqs.append(flat[at:at + n])
            at += n
        out.append((name, seqs))
    return out


def check_safe(path: Path) -> None:
    """Refuse (one line) a snapshot that is a link, another user's or writable by group or others, and a
    folder holding it that is another user's or writable by others without the sticky bit (``/tmp`` is fine:
    nobody else can replace a file of ours there). OSError when `path` does not exist."""
    _check_file(path)
    _check_folder(path)


def _check_file(path: Path) -> None:
    try:
        cachefs.refuse_unsafe(path)
    except cachefs.UnsafeCache as exc:
        raise _refused(path, exc.reason) from None


def _check_folder(path: Path) -> None:
    folder = path.parent.resolve()
    st = folder.stat()
    if st.st_uid not in (os.getuid(), 0) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        raise _refused(path, f"its folder {folder} is another user's or others may write it (mode "
                             f"{stat.S_IMODE(st.st_mode):o}): anybody there could replace the snapshot")


def _count(value) -> bool:
    return type(value) is int and value >= 0


def _header(header, path: Path) -> tuple[list[tuple[str, list[int]]], int, str, dict]:
    """(tenants with their sequences' lengths, tokens' size, tokens' digest, identity) of a parsed header, each
    field checked for its type and range; a one-line refusal naming the field otherwise."""
    if not isinstance(header, dict):
        raise _refused(path, "its header is damaged (not a JSON object)")
    size, digest, theirs, tenants = (header.get(k) for k in ("tokens_bytes", "tokens_sha256", "identity", "tenants"))
    if not _count(size):
        raise _refused(path, "its header is damaged (tokens_bytes is not an integer >= 0)")
    if not isinstance(digest, str):
        raise _refused(path, "its header is damaged (tokens_sha256 is not a string)")
    if not isinstance(theirs, dict):
        raise _refused(path, "its header is damaged (identity is not an object)")
    if not isinstance(tenants, list):
        raise _refused(path, "its header is damaged (tenants is not a list)")
    names = []
    for entry in tenants:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and all(_count(n) for n in entry[1])):
            raise _refused(path, "its header is damaged (a tenant is not [name, [lengths >= 0]])")
        names.append((entry[0], entry[1]))
    return names, size, digest, theirs


def _swapped(blob: bytes) -> bytes:
    a = array("i")
    a.frombytes(blob)
    a.byteswap()
    return a.tobytes()


def _refused(path: Path, why: str) -> GooseError:
    return GooseError(f"the memory snapshot {path} is refused: {why}")
