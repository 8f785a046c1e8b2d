"""A file's sha256, computed once per file version (path, size, mtime) and remembered in the user cache: what
names a GGUF file's cached copies (dequantized folders, packed panels)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .. import cachefs
from ..paths import cache_root
from ..progress import note

HASH_MEMO = "gguf-sha256.json"  # path|size|mtime -> sha256, so a GGUF is hashed once


def file_sha256(path: Path) -> str:
    """sha256 of a file's content, computed once per (path, size, mtime) and remembered in the cache."""
    st = path.stat()
    memo_file = cache_root() / "models" / HASH_MEMO
    entry = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    memo = _read_memo(memo_file)
    if entry in memo:
        return memo[entry]
    note(f"hashing {path.name} ({st.st_size / 2**20:.0f} MiB) to name its cached copy (once per file version)")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    with cachefs.lock(memo_file):
        memo = _read_memo(memo_file)
        memo = {k: v for k, v in memo.items() if not k.startswith(f"{path}|")}  # older versions of this file
        memo[entry] = digest
        cachefs.write_text(memo_file, json.dumps(memo, indent=1) + "\n")
    return digest


def _read_memo(path: Path) -> dict:
    """The remembered hashes, or none when the file is missing or damaged (`cachefs.read_entry`)."""
    data = cachefs.read_entry(path)
    try:
        memo = json.loads(data) if data is not None else {}
    except ValueError:
        return {}
    return {k: v for k, v in memo.items() if isinstance(v, str)} if isinstance(memo, dict) else {}
