"""The step loop over a batch of requests: the one place where goose decodes.

Each request owns a `Slot`: its prompt, options, chooser (greedy or seeded sampling), method instance,
KV cache, generated tokens and statistics. `step(forward, slots, cost)` advances every slot by one forward:

  1. draft       decoding slots: the method's tree (or, for `goose`, its candidate tree and node
                 probabilities); prefilling slots: their next prompt chunk (all chunks of a step share
                 one token budget, so a long prompt stalls the others by at most one chunk)
  2. select      the batch's best set of subtrees under the batched cost curve, rows priced at the
                 sequences' mean cached context (`selector.allocate`)
  3. tensorize   ancestor mask and depths (cached per topology; none for chains)
  4. forward     one pass over every slot's tokens, each on its own cache (`forward.run`)
  5. verify      per slot: the longest path whose tokens the target picks, plus its next token
  6. compact KV  keep the prefix, the root and the accepted path
  7. harvest     the method learns from the logits of every verified node
  8. commit      accepted tokens + bonus (cut at the first stop token, `stop` and max_new_tokens)

`Decoder` runs it on a batch of one; `Engine` on every running request. Nothing here reads or writes state
that another slot can change, except what the method shares across requests by design (the adjacency
table with ``hot_start``, acceptance statistics with ``carry_over``): those only shape drafts, and every
committed token is the target's own choice, so no output can depend on them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..backends.lean import Segment
from ..backends.tree_tensors import ancestor_mask, is_chain, tree_depths
from ..config import DecodeConfig
from ..drafting.tree import ROOT
from ..errors import GooseError
from ..selection.selector import allocate
from .sampling import Chooser
from .stats import Stats

PREFILL, DECODE, DONE = "prefill", "decode", "done"
TREE_ROOM = 160  # cache entries reserved beyond prompt + max_new_tokens for a step's tree (more still fit: the cache grows)


@dataclass(eq=False)
class Slot:
    """One request's decoding state (owned by whoever runs its steps)."""

    prompt: list[int]
    cfg: DecodeConfig
    method: object  # a Method instance of this request (see Method.fork)
    cache: object  # its own KV cache (forward.new_cache())
    eos: set[int]
    limit: int | None  # the model's context
    chooser: Chooser | None = None
    stop: object = None  # stop(tokens) -> bool, asked after every generated token
    out: list[int] = field(default_factory=list)
    stats: Stats = None  # type: ignore[assignment]
    state: str = PREFILL
    finish_reason: str | None = None  # once done: "stop" (a stop token or `stop`) or "length"
    filled: int = 0  # prompt tokens prefilled so far
    hold: bool = False  # skip prefill chunks this step (the engine waits for a prefix another request is computing)
    prev: int = -1  # token before the next prefill chunk
    t0: float = 0.0
    new: list[int] = field(default_factory=list)  # tokens committed by the last step
    new_sources: list[int] = field(default_factory=list)  # per token of `new`: SPINE, BRANCH or ROOT (the target's own)
    stage_ms: dict[str, float] = field(default_factory=dict)
    # per step, set by `step`
    _tree: object = None
    _cands: object = None
    _tokens: list[int] = field(default_factory=list)
    _harvest: int = 0

    def __post_init__(self) -> None:
        if not self.prompt:
            raise GooseError("the prompt is empty")
        if self.limit is not None and len(self.prompt) + self.cfg.max_new_tokens > self.limit:
            raise GooseError(f"prompt ({len(self.prompt)} tokens) + max_new_tokens ({self.cfg.max_new_tokens}) "
                             f"exceeds the model's context of {self.limit} tokens")
        if self.chooser is None:
            self.chooser = Chooser.for_config(self.cfg)
        if self.stats is None:
            self.stats = Stats(prompt_tokens=len(self.prompt))
        self.stage_ms = self.stats.stage_ms

    def begin(self) -> None:
        """Start decoding: a fresh cache (sized for the whole request where the cache can be) and the method's
        per-request state."""
        self.t0 = time.perf_counter()
        expect = getattr(self.cache, "expect", None)
        if expect is not None:
            total = len(self.prompt) + self.cfg.max_new_tokens + TREE_ROOM
            expect(total if self.limit is None else min(total, self.limit + TREE_ROOM))
        self.cache.reset()
        self.method.start()

    def reuse_prefix(self, n: int) -> None:
        """The cache already holds the entries of the prompt's first `n` tokens (`goose.engine.prefix`): the
        prefill starts after them."""
        if n <= 0:
            return
        if not n < len(self.prompt) or self.cache.length != n:
            raise GooseError(f"a reused prefix of {n} tokens must leave prompt tokens to prefill and fill the cache")
        self.filled, self.prev = n, self.prompt[n - 1]
        self.stats.cached_tokens = n

    @property
    def unstarted(self) -> bool:
        """Still prefilling, and nothing of its own prefilled yet (only entries from the prefix cache)."""
        return self.state == PREFILL and self.filled == self.stats.cached_tokens

    @property
    def done(self) -> bool:
        return self.state == DONE

    def commit(self, new: list[int], sources: list[int] | None = None) -> None:
        """Append `new`, cut at max_new_tokens, a stop token or `stop`. `sources`: the draft source of each
        token (default: all ROOT, the target's own tokens), kept in `new_sources`."""
        cfg, out = self.cfg, self.out
        new = new[: cfg.max_new_tokens - len(out)]
        reason = "length" if len(out) + len(new) >= cfg.max_new_tokens else None
        for i, t in enumerate(new):
            if t in self.eos or (self.stop is not None and self.stop(out + new[: i + 1])):
                new, reason = new[: i + 1], "stop"
                break
        out.extend(new)
        self.new = new
        self.new_sources = [ROOT] * len(new) if sources is None else list(sources[: len(new)])
        self.stats.new_tokens = len(out)
        self.stats.wall_time_s = time.perf_counter() - self.t0
        if reason is not None:
            self.state, self.finish_reason = DONE, reason


class _Clock:
    """Adds the milliseconds since the previous call to each slot's `stage_ms[name]` (shared stages are
    charged to every slot of the step)."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        ms = (now - self.last) * 1e3
        for s in self.slots:
            s.stage_ms[name] = s.stage_ms.get(name, 0.0) + ms
        self.last = now


def step(forward, slots: list[Slot], cost=None, prefill_budget: int | None = None) -> None:
    """Advance every slot that is not done by one forward (see the module docstring). `cost`: the batched
    cost curve (`costmodel.BatchCostCurve`) that `goose` slots' subtrees are chosen under; `prefill_budget`:
    prompt tokens all prefilling slots may add in this step (default: the first one's ``prefill_chunk``).
    After the call each slot's `new` holds the tokens it committed."""
    with torch.inference_mode():
        _step(forward, [s for s in slots if not s.done], cost, prefill_budget)


def _step(forward, slots: list[Slot], cost, budget: int | None) -> None:
    for s in slots:
        s.new, s.new_sources = [], []
    decoding = [s for s in slots if s.state == DECODE]
    clock = _Clock(decoding)
    # 1. prefill chunks (token budget shared by the prefilling slots) and drafts (decoding slots)
    prefilling = [s for s in slots if s.state == PREFILL and not s.hold]
    chunks: dict[int, list[int]] = {}
    if prefilling:
        left = budget or prefilling[0].cfg.prefill_chunk
        for s in prefilling:
            take = min(left, s.cfg.prefill_chunk, len(s.prompt) - s.filled)
            if take <= 0:
                break
            chunks[id(s)] = s.prompt[s.filled : s.filled + take]
            left -= take
    context = _mean_context(decoding + [s for s in prefilling if id(s) in chunks])
    min_prob = _worth(cost, len(chunks) + len(decoding), sum(map(len, chunks.values())) + len(decoding),
                      len(decoding), context)
    for s in decoding:
        anchor = s.out[-1]
        prev = s.out[-2] if len(s.out) > 1 else s.prompt[-1]
        room = None if s.limit is None else s.limit - 1 - s.cache.length
        cand = getattr(s.method, "candidates", None)
        if cand is not None:
            s._cands, s._tree = cand(anchor, prev, room, min_prob), None
        else:
            tree = s.method.draft(anchor, prev)
            s._tree, s._cands = (tree if room is None else tree.within_depth(room)), None
    clock("draft")
    # 2. select: the batch's best subtrees for the slots that offer candidates
    fixed = sum(len(c) for c in chunks.values()) + sum(len(s._tree.all_tokens) for s in decoding if s._tree)
    offered = [s for s in decoding if s._cands is not None]
    if offered:
        n_seq = len(chunks) + len(decoding)
        picks = allocate([s._cands for s in offered], fixed, len(decoding) - len(offered), cost, n_seq, context)
        for s, tree in zip(offered, picks):
            s._tree = tree
    clock("select")
    # 3. tensorize
    segments, active = [], []
    for s in slots:
        if s.state == PREFILL:
            chunk = chunks.get(id(s))
            if chunk is None:
                continue
            end = s.filled + len(chunk)
            tail = len(s.prompt) if s.method.prefill_harvest is None else s.method.prefill_harvest
            s._harvest = min(len(chunk), max(0, end - (len(s.prompt) - tail)))  # harvested positions here
            segments.append(Segment(s.cache, chunk, keep_last=max(s._harvest, 1)))
        else:
            tree = s._tree
            s._tokens = tokens = tree.all_tokens  # tree nodes, then any unverified extras (lookahead window)
            if len(tokens) == 1 or is_chain(tree):
                segments.append(Segment(s.cache, tokens))
            else:
                segments.append(Segment(s.cache, tokens, tree_depths(tree), ancestor_mask(tree)))
        active.append(s)
    clock("tensorize")
    # 4. forward
    if not segments:
        return
    outs = forward.run(segments)
    clock("forward")
    # 5.-8. per slot
    for s, logits in zip(active, outs):
        if s.state == PREFILL:
            _after_prefill_chunk(s, chunks[id(s)], logits)
            continue
        tree = s._tree
        t = time.perf_counter()
        walk = s.chooser.walk(tree, logits, s.prompt + s.out)  # 5. verify
        t = _add(s, "verify", t)
        s.cache.keep(walk.path)  # 6. compact KV
        t = _add(s, "compact", t)
        tokens = s._tokens
        prev_anchor = s.out[-2] if len(s.out) > 1 else s.prompt[-1]
        prevs = [prev_anchor] + [tokens[p] for p in tree.all_parents[1:]]
        s.method.harvest(tokens, prevs, logits)  # 7. harvest
        s.method.observe(tree, walk)
        t = _add(s, "harvest", t)
        s.commit([tree.tokens[i] for i in walk.path[1:]] + [walk.bonus],  # 8. commit
                 [tree.sources[i] for i in walk.path[1:]] + [ROOT])
        s.method.commit(s.new)
        s.stats.record_step(tree, walk)
        _add(s, "commit", t)


WORTH_ROWS = 4  # the marginal cost of a draft row: averaged over this many rows (the curve has flat steps)
# a request's candidates are built when its best child may bring 1.5x a row's price: building, pricing and
# harvesting a tree costs Python time that the curve does not price (benchmarks/concurrency_ab.py: 1.5 against
# 0.8 gave +5% tokens/s at concurrency 1 and +3% at 4, level at 8)
WORTH_MARGIN = 1.5


def _worth(cost, sequences: int, rows: int, value: float, context: float = 0.0) -> float:
    """About the acceptance probability a draft node must reach to pay for its row in this step: the step's
    tokens per millisecond without drafts (`value` tokens for `rows` rows) times the marginal cost of a
    row (its share of the cached `context` included), times WORTH_MARGIN. Only speed depends on it (requests
    whose root children are all below it verify a plain step without building a candidate tree); 0 without
    a cost curve."""
    if cost is None or value <= 0 or rows < 1 or rows + WORTH_ROWS > cost.max_size:
        return 0.0
    at = cost.pricer(sequences, context)
    base = at(rows)
    marginal = (at(rows + WORTH_ROWS) - base) / WORTH_ROWS
    return WORTH_MARGIN * value * marginal / base if base > 0 else 0.0


def _mean_context(slots: list[Slot]) -> float:
    """Mean cached tokens of the sequences in this step's forward (what each query row's attention reads)."""
    return sum(s.cache.length for s in slots) / len(slots) if slots else 0.0


def _add(s: Slot, name: str, t: float) -> float:
    now = time.perf_counter()
    s.stage_ms[name] = s.stage_ms.get(name, 0.0) + (now - t) * 1e3
    return now


def _after_prefill_chunk(s: Slot, chunk: list[int], logits: torch.Tensor) -> None:
    k = s._harvest
    if k:
        prevs = ([s.prev] + chunk[:-1])[-k:]
        s.method.harvest(chunk[-k:], prevs, logits[-k:])
    s.prev = chunk[-1]
    s.filled += len(chunk)
    if s.filled < len(s.prompt):
        return
    s.stats.forward_calls = 1  # the whole prefill counts as one call producing one token
    s.state = DECODE
    s.commit([s.chooser.first(logits[-1], s.prompt)])
    s.method.begin(s.prompt + s.out)
