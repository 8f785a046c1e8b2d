"""Suffix memory: what followed the current context's suffix in earlier requests' prompts and outputs.

Structure: each stored sequence keeps its tokens (``array('i')``, 4 bytes a token) and, per position j, a
link to the previous occurrence anywhere in the memory of the k-gram ending at j (``array('q')``, 8 bytes);
one dict maps each k-gram's hash to its most recent occurrence (k = ``min_match``). A lookup hashes the
context's last k tokens, walks that occurrence chain (newest first, at most ``max_candidates`` hops),
measures each occurrence's true match length by comparing backwards (up to ``max_match`` tokens, so a hash
collision only costs a hop), and keeps the occurrences of the longest match. Their continuations are
tallied depth by depth: the spine follows the most frequent next token (ties: the newest occurrence), the
other next tokens are alternatives with how often each followed. Costs: a lookup is one dict read plus at
most ``max_candidates * (max_match + count_depth)`` token compares; an insert is one hash and dict write per
token; memory is about 12 bytes a token plus one dict entry (~100 bytes) per distinct k-gram.

Sequences are evicted whole, least recently used first (an insert or a draft from a sequence uses it), to
stay under ``max_bytes``. An older occurrence reached only through an evicted sequence's links is no longer
found (the chain stops there); drafts only, never outputs, depend on what the memory finds.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from ..config import DEFAULT_MAX_TENANTS, MemoryConfig

TOKEN_BYTES = 12  # a token (4) and its occurrence link (8)
ENTRY_BYTES = 104  # one dict entry: slot, hash, key and value objects
SEQUENCE_BYTES = 232  # per stored sequence: its two arrays' headers and its LRU entry
TENANT_BYTES = 1024  # per tenant of a MemoryPool: its SuffixMemory's objects, name and the pool's entry
_SHIFT = 32  # an occurrence's code: sequence id << _SHIFT | position


@dataclass
class MemoryDraft:
    """What the memory proposes after a context: `match` tokens of its suffix were found in `occurrences`
    places; `spine[i]` followed `counts[i]` of the `totals[i]` occurrences still agreeing at depth i;
    `branches`: (spine index the alternative hangs under, -1 for the root; its tokens; count; total)."""

    match: int = 0
    occurrences: int = 0
    spine: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    totals: list[int] = field(default_factory=list)
    branches: list[tuple[int, list[int], int, int]] = field(default_factory=list)


class _Seq:
    __slots__ = ("tokens", "links")

    def __init__(self, tokens: array, links: array) -> None:
        self.tokens, self.links = tokens, links


class SuffixMemory:
    """A bounded memory of token sequences (see the module docstring). Not thread-safe: one owner uses it."""

    def __init__(self, max_bytes: int, cfg: MemoryConfig = MemoryConfig()) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes, self.cfg = int(max_bytes), cfg
        self._seqs: OrderedDict[int, _Seq] = OrderedDict()  # least recently used first
        self._head: dict[int, int] = {}  # k-gram hash -> code of its newest occurrence
        self._next_id = 0
        self.tokens = 0  # stored tokens
        self.evicted = 0  # sequences evicted so far

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def nbytes(self) -> int:
        """The memory's accounted size in bytes (what `max_bytes` bounds)."""
        return TOKEN_BYTES * self.tokens + ENTRY_BYTES * len(self._head) + SEQUENCE_BYTES * len(self._seqs)

    def clear(self) -> None:
        """Forget everything (the model's weights changed)."""
        self._seqs.clear()
        self._head.clear()
        self.tokens = 0

    def insert(self, tokens: Sequence[int]) -> None:
        """Store a finished sequence (a request's prompt + output) as the most recently used one, then evict
        least recently used sequences until the memory fits `max_bytes` (a sequence that alone does not fit
        is not kept)."""
        k = self.cfg.min_match
        n = len(tokens)
        if n <= k or self.max_bytes <= 0:
            return
        sid = self._next_id
        self._next_id += 1
        toks = array("i", tokens)
        links = array("q", [-1]) * n
        head = self._head
        base = sid << _SHIFT
        for j in range(k - 1, n - 1):  # the k-gram ending at j is followed by toks[j + 1]
            h = hash(tuple(toks[j - k + 1 : j + 1]))
            links[j] = head.get(h, -1)
            head[h] = base | j
        self._seqs[sid] = _Seq(toks, links)
        self.tokens += n
        while self._seqs and self.nbytes > self.max_bytes:
            self.evict_one()

    def evict_one(self) -> None:
        """Drop the least recently used sequence; k-grams whose newest occurrence was in it point past it."""
        sid, seq = self._seqs.popitem(last=False)
        self.tokens -= len(seq.tokens)
        self.evicted += 1
        k, head, toks, links = self.cfg.min_match, self._head, seq.tokens, seq.links
        for j in range(k - 1, len(toks) - 1):
            h = hash(tuple(toks[j - k + 1 : j + 1]))
            code = head.get(h, -1)
            if code >> _SHIFT != sid:
                continue
            while code >= 0 and code >> _SHIFT == sid:
                code = links[code & 0xFFFFFFFF]
            if code < 0 or (code >> _SHIFT) not in self._seqs:
                del head[h]
            else:
                head[h] = code

    def _candidates(self, context: Sequence[int]) -> list[tuple[int, _Seq, int, int]]:
        """(match length, sequence, position, sequence id) of the newest occurrences of the context's last
        k-gram whose real match is at least k tokens."""
        cfg = self.cfg
        k = cfg.min_match
        if len(context) < k:
            return []
        code = self._head.get(hash(tuple(context[-k:])), -1)
        if code < 0:
            return []
        tail = array("i", context[-cfg.max_match :])  # compared a slice at a time (C speed)
        n_tail = len(tail)
        seqs, out = self._seqs, []
        for _ in range(cfg.max_candidates):
            if code < 0:
                break
            sid, j = code >> _SHIFT, code & 0xFFFFFFFF
            seq = seqs.get(sid)
            if seq is None:
                break
            toks = seq.tokens
            top = min(n_tail, j + 1)
            if toks[j + 1 - top : j + 1] == tail[n_tail - top :]:
                m = top
            else:  # shortest mismatch: binary search on the equal-suffix length (equality is monotone)
                lo, hi = 0, top - 1  # the suffix of length lo matches, of length top does not
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if toks[j + 1 - mid : j + 1] == tail[n_tail - mid :]:
                        lo = mid
                    else:
                        hi = mid - 1
                m = lo
            if m >= k:
                out.append((m, seq, j, sid))
            code = seq.links[j]
        return out

    def lookup(self, context: Sequence[int]) -> MemoryDraft:
        """The draft after `context` (see `MemoryDraft`); an empty one when its last k-gram was never stored."""
        cands = self._candidates(context)
        if not cands:
            return MemoryDraft()
        cfg = self.cfg
        best = max(c[0] for c in cands)
        active = [(seq, j + 1) for m, seq, j, _ in cands if m == best]  # newest first
        self._seqs.move_to_end(next(sid for m, _, _, sid in cands if m == best))
        draft = MemoryDraft(best, len(active))
        # identical continuations (the common case in repeated text) are tallied once, with their count
        groups: dict[tuple, list] = {}  # continuation -> [count, newest occurrence]
        for seq, p in active:
            cont = tuple(seq.tokens[p : p + cfg.count_depth])
            g = groups.get(cont)
            if g is None:
                groups[cont] = [1, (seq, p)]
            else:
                g[0] += 1
        live = list(groups.items())  # newest first
        depth = 0
        while live and depth < cfg.count_depth:
            if len(live) == 1:  # one continuation left: its tokens, all with its count
                cont, (c, _) = live[0]
                rest = cont[depth:]
                draft.spine.extend(rest)
                draft.counts.extend([c] * len(rest))
                draft.totals.extend([c] * len(rest))
                depth += len(rest)
                if depth < cfg.count_depth:
                    live = []
                break
            tally: dict[int, list] = {}  # next token -> [count, newest occurrence]
            for cont, (c, occ) in live:
                if depth < len(cont):
                    hit = tally.get(cont[depth])
                    if hit is None:
                        tally[cont[depth]] = [c, occ]
                    else:
                        hit[0] += c
            if not tally:
                break
            total = sum(c for c, _ in tally.values())
            top = max(tally, key=lambda t: tally[t][0])  # ties: the first inserted (newest occurrence)
            for t, (c, (seq, p)) in tally.items():
                if t != top and len(draft.branches) < cfg.max_branches:
                    draft.branches.append((depth - 1, list(seq.tokens[p + depth : p + depth + cfg.branch_length]),
                                           c, total))
            draft.spine.append(top)
            draft.counts.append(tally[top][0])
            draft.totals.append(total)
            live = [(cont, g) for cont, g in live if depth < len(cont) and cont[depth] == top]
            depth += 1
        if live and depth == cfg.count_depth and depth < cfg.max_spine:  # copy on from the newest agreeing one
            seq, p = live[0][1][1]
            rest = list(seq.tokens[p + depth : p + cfg.max_spine])
            draft.spine.extend(rest)
            draft.counts.extend([draft.counts[-1]] * len(rest))
            draft.totals.extend([draft.totals[-1]] * len(rest))
        return draft


class MemoryPool:
    """One `SuffixMemory` per tenant under one shared byte budget and a cap on tenants.

    A tenant's memory is made by its first insert (a request only reads one that exists), and dropped when
    eviction empties it or when it is the least recently used of `max_tenants`; a dropped memory is cleared,
    so a running request that still holds it keeps no bytes alive. Each tenant costs `TENANT_BYTES` besides its
    sequences. The byte total is kept as a running sum, so an insert costs the same with one tenant or a
    million. When the total is over `max_bytes`, the least recently used tenant's least recently used sequence
    goes first. Not thread-safe: the engine's step loop owns it."""

    def __init__(self, max_bytes: int, cfg: MemoryConfig = MemoryConfig(),
                 max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self.max_bytes, self.cfg, self.max_tenants = int(max_bytes), cfg, int(max_tenants)
        self._tenants: OrderedDict[str, SuffixMemory] = OrderedDict()  # least recently used first
        self._bytes = 0  # every tenant's nbytes + TENANT_BYTES each
        self.evicted = 0  # sequences evicted to keep all tenants within the budget
        self.dropped = 0  # tenants dropped (emptied by eviction, or the least recently used past max_tenants)

    def __len__(self) -> int:
        return len(self._tenants)

    def __contains__(self, tenant: str) -> bool:
        return tenant in self._tenants

    @property
    def nbytes(self) -> int:
        """Accounted bytes of all tenants (what `max_bytes` bounds)."""
        return self._bytes

    def tenant_bytes(self) -> dict[str, int]:
        """Accounted bytes per tenant (a copy; O(tenants): for reports, not for the step loop)."""
        return {name: mem.nbytes + TENANT_BYTES for name, mem in self._tenants.items()}

    def get(self, tenant: str) -> SuffixMemory | None:
        """`tenant`'s memory, marked most recently used; None when it has none (nothing inserted yet, or
        dropped) or the budget is 0. Never makes one: a tenant holds bytes only once it has text."""
        mem = self._tenants.get(tenant)
        if mem is not None:
            self._tenants.move_to_end(tenant)
        return mem

    def insert(self, tenant: str, tokens: Sequence[int]) -> None:
        """Store `tokens` in `tenant`'s memory (made now if it has none), then evict to the budget."""
        if self.max_bytes < TENANT_BYTES or len(tokens) <= self.cfg.min_match:
            return
        mem = self.get(tenant)
        if mem is None:
            while len(self._tenants) >= self.max_tenants:
                self._drop(next(iter(self._tenants)))
            mem = self._tenants[tenant] = SuffixMemory(self.max_bytes, self.cfg)
            self._bytes += TENANT_BYTES + mem.nbytes
        before = mem.nbytes
        mem.insert(tokens)
        self._bytes += mem.nbytes - before
        while self._bytes > self.max_bytes and self._tenants:
            name, oldest = next(iter(self._tenants.items()))
            if len(oldest) == 0:
                self._drop(name)
                continue
            before = oldest.nbytes
            oldest.evict_one()
            self.evicted += 1
            self._bytes -= before - oldest.nbytes
            if len(oldest) == 0:
                self._drop(name)

    def export(self) -> list[tuple[str, list[bytes]]]:
        """Every tenant's sequences as int32 token bytes, least recently used first (tenants and sequences): what
        `goose.drafting.snapshot.write_snapshot` writes. A copy: the pool may change once it returns."""
        return [(name, [seq.tokens.tobytes() for seq in mem._seqs.values()]) for name, mem in self._tenants.items()]

    def restore(self, tenants: list[tuple[str, Sequence[Sequence[int]]]]) -> None:
        """Insert `tenants`' sequences in order (as `export` lists them): the same tenants and sequences, in the
        same order of eviction, as far as this pool's budget holds them."""
        for name, seqs in tenants:
            for tokens in seqs:
                self.insert(name, tokens)

    def empty_like(self) -> "MemoryPool":
        """A new empty pool with this one's budget, k-gram settings and cap on tenants."""
        return MemoryPool(self.max_bytes, self.cfg, self.max_tenants)

    def absorb(self, newer: "MemoryPool") -> None:
        """Insert every sequence of `newer` after this pool's own (so they are the most recently used, in
        `newer`'s order), then clear `newer`: how a pool restored off the step loop's thread takes in what the
        live pool learned meanwhile (`Engine.restore_memories`)."""
        for name, mem in list(newer._tenants.items()):
            for seq in list(mem._seqs.values()):
                self.insert(name, seq.tokens)
        newer.clear()

    def _drop(self, tenant: str) -> None:
        mem = self._tenants.pop(tenant)
        self._bytes -= mem.nbytes + TENANT_BYTES
        mem.clear()
        self.dropped += 1

    def clear(self) -> None:
        for mem in self._tenants.values():
            mem.clear()
        self._tenants.clear()
        self._bytes = 0
