"""The step loop over a batch of requests: the one place where goose decodes.

Each request owns a `Slot`: its prompt, options, chooser (greedy or seeded sampling), method instance,
KV cache, generated tokens and statistics. `step(forward, slots, cost)` advances every slot by one forward,
one function per stage; what a slot carries from stage to stage within a step is its `_Work`:

  1. draft       `_prefill_chunks`: prefilling slots' next prompt chunks (all chunks of a step share one
                 token budget, so a long prompt stalls the others by at most one chunk); `_draft`:
                 decoding slots' trees (or, for `goose`, candidate trees and node probabilities)
  2. select      `_select`: the batch's best set of subtrees under the batched cost curve, rows priced at
                 the sequences' mean cached context (`selector.allocate`)
  3. tensorize   `_tensorize`: ancestor mask and depths (cached per topology; none for chains)
  4. forward     one pass over every slot's tokens, each on its own cache (`forward.run`)
  5. verify      `_verify`: per slot, the longest path whose tokens the target picks, plus its next token
  6. compact KV  keep the prefix, the root and the accepted path
  7. harvest     `_harvest`: the method learns from the logits of every verified node
  8. commit      `_commit`: accepted tokens + bonus (cut at the first stop token, `stop` and max_new_tokens)

`Engine` runs it on every running request (`Decoder` is an Engine of one request at a time). Nothing here reads or
writes state that another slot can change, except what the method shares across requests by design (the adjacency
table with ``hot_start``, acceptance statistics with ``carry_over``): those only shape drafts, and every committed
token is the target's own choice, so no output can depend on them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..backends.tree_tensors import ancestor_mask, is_chain, tree_depths
from ..config import DecodeConfig, EngineConfig
from ..drafting.tree import ROOT, DraftTree, WalkResult
from ..errors import GooseError, RequestFailed
from ..protocols import CostModel, Forward, KVCache, Segment
from ..selection.selector import Candidates, allocate, decoding_cost
from .sampling import Chooser
from .stats import Stats
from .threads import ThreadGovernor

PREFILL, DECODE, DONE = "prefill", "decode", "done"
DEFAULTS = EngineConfig()  # the settings of a step loop that is given none (a `Decoder`'s)


@dataclass(eq=False)
class Slot:
    """One request's decoding state (owned by whoever runs its steps)."""

    prompt: list[int]
    cfg: DecodeConfig
    method: object  # a Method instance of this request (see Method.fork)
    cache: KVCache | None  # its own KV cache (forward.new_cache(), made when the request is admitted)
    eos: set[int]
    limit: int | None  # the model's context
    chooser: Chooser | None = None
    stop: object = None  # stop(tokens) -> bool, asked after every generated token
    out: list[int] = field(default_factory=list)
    stats: Stats = None  # type: ignore[assignment]
    state: str = PREFILL
    finish_reason: str | None = None  # once done: "stop" (a stop token or `stop`), "length" or "error"
    error: BaseException | None = None  # why its own stage failed (then done, finish_reason "error")
    filled: int = 0  # prompt tokens prefilled so far
    hold: bool = False  # skip prefill chunks this step (the engine waits for a prefix another request is computing)
    prev: int = -1  # token before the next prefill chunk
    t0: float = 0.0
    new: list[int] = field(default_factory=list)  # tokens committed by the last step
    new_sources: list[int] = field(default_factory=list)  # per token of `new`: SPINE, BRANCH or ROOT (the target's own)
    stage_ms: dict[str, float] = field(default_factory=dict)

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

    def begin(self, tree_room: int = DEFAULTS.tree_room) -> None:
        """Start decoding: a fresh cache (sized for the whole request and `tree_room` entries of a step's tree,
        where the cache can be) and the method's per-request state."""
        self.t0 = time.perf_counter()
        total = len(self.prompt) + self.cfg.max_new_tokens + tree_room
        self.cache.expect(total if self.limit is None else min(total, self.limit + tree_room))
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

    def fail(self, stage: str, exc: BaseException) -> None:
        """This request's own stage raised `exc`: it is over (`error` says why); the others go on."""
        self.error = RequestFailed.stage(stage, exc)
        self.state, self.finish_reason, self.new, self.new_sources = DONE, "error", [], []

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


class _Work:
    """One slot's part of one step: what its stages hand each other (dropped after the step)."""

    __slots__ = ("slot", "chunk", "harvest", "cands", "tree", "tokens", "hidden")

    def __init__(self, slot: Slot, chunk: list[int] | None = None) -> None:
        self.slot = slot
        self.chunk = chunk  # prefilling: the prompt tokens of this step
        self.harvest = 0  # prefilling: the chunk's last positions whose logits the method harvests
        self.cands: Candidates | None = None  # decoding: the candidate tree the selection cuts (`goose`)
        self.tree: DraftTree | None = None  # decoding: the tree this step verifies
        self.tokens: list[int] = []  # decoding: its tokens, then any unverified extras (lookahead window)
        self.hidden: torch.Tensor | None = None  # every row's final hidden state, for a method with `features`


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


def step(forward: Forward, slots: list[Slot], cost: CostModel | None = None, prefill_budget: int | None = None,
         settings: EngineConfig = DEFAULTS, governor: ThreadGovernor | None = None) -> None:
    """Advance every slot that is not done by one forward (see the module docstring). `cost`: the batched
    cost curve (`costmodel.BatchCostCurve`) that `goose` slots' subtrees are chosen under; `prefill_budget`:
    prompt tokens all prefilling slots may add in this step (default: the first one's ``prefill_chunk``);
    `settings`: the engine's (`EngineConfig`); `governor`: the threads the forward runs on (`ThreadGovernor`;
    None: torch's setting as it is). After the call each slot's `new` holds the tokens it committed."""
    with torch.inference_mode():
        _step(forward, [s for s in slots if not s.done], cost, prefill_budget, settings, governor)


def _step(forward: Forward, slots: list[Slot], cost: CostModel | None, budget: int | None,
          settings: EngineConfig, governor: ThreadGovernor | None) -> None:
    for s in slots:
        s.new, s.new_sources = [], []
    decoding = [s for s in slots if s.state == DECODE]
    clock = _Clock(decoding)
    prefills = _prefill_chunks(slots, budget)  # 1. draft
    drafts = [_Work(s) for s in decoding]
    context = _mean_context(decoding + [w.slot for w in prefills])
    drafts = _draft(drafts, prefills, cost, context, settings)
    clock("draft")
    _select(drafts, prefills, cost, context)  # 2. select
    clock("select")
    by_slot = {id(w.slot): w for w in prefills + drafts}
    work = [by_slot[id(s)] for s in slots if id(s) in by_slot and not s.done]  # in the slots' order
    tensors = [(w, _own(w.slot, "building the tree tensors", _tensorize, w)) for w in work]  # 3. tensorize
    tensors = [(w, seg) for w, seg in tensors if seg is not None]
    clock("tensorize")
    if not tensors:
        return
    segments = [seg for _, seg in tensors]
    rows = sum(len(seg.tokens) for seg in segments)
    outs, seconds = _forward(forward, [w for w, _ in tensors], segments, rows, governor)  # 4. forward
    if cost is not None and seconds is not None and not prefills and not (governor and governor.probed):
        cost.observe(len(segments), rows, context, seconds)  # (a decoding forward: the curve learns its time)
    for w, seg in tensors:
        w.hidden = seg.hidden
    clock("forward")
    for w, logits in outs:
        if w.chunk is not None:
            _own(w.slot, "prefilling", _after_prefill_chunk, w, logits)
        else:
            _own(w.slot, "verifying", _verify_and_commit, w, logits)  # 5.-8.


def _own(slot: Slot, stage: str, fn, *args):
    """`fn(*args)`, a stage of `slot`'s own: when it raises, that slot alone fails (`Slot.fail`) and None
    is returned; the batch's other slots go on."""
    try:
        return fn(*args)
    except Exception as exc:
        slot.fail(stage, exc)
        return None


def _forward(forward: Forward, work: list[_Work], segments: list[Segment], rows: int,
             governor: ThreadGovernor | None = None) -> tuple[list[tuple[_Work, torch.Tensor]], float | None]:
    """(work, logits) of one forward over every segment (`rows` query rows in all), and its seconds (None when it
    failed). When the shared forward raises, the segments run again one by one, so only the request whose segment
    fails fails: those whose caches the failed call left untouched are retried (their rows do not depend on the
    others': every committed token stays the one it would have been), a request whose cache it already extended
    fails with the error."""
    lengths = [seg.cache.length for seg in segments]
    try:
        if governor is not None:
            governor.before(rows)
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = forward.run(segments)
        seconds = time.perf_counter() - t0
        if governor is not None:
            governor.after(rows, seconds, time.thread_time() - c0)
        return list(zip(work, outs)), seconds
    except Exception as exc:
        if len(segments) == 1:
            work[0].slot.fail("the forward", exc)
            return [], None
        out = []
        for w, seg, n in zip(work, segments, lengths):
            if seg.cache.length != n:
                w.slot.fail("the forward", exc)
                continue
            logits = _own(w.slot, "the forward", forward.run, [seg])
            if logits is not None:
                out.append((w, logits[0]))
        return out, None


def _prefill_chunks(slots: list[Slot], budget: int | None) -> list[_Work]:
    """The next prompt chunk of each prefilling slot that is not held, in order, while the step's prompt-token
    budget lasts (default: the first one's ``prefill_chunk``)."""
    prefilling = [s for s in slots if s.state == PREFILL and not s.hold]
    out: list[_Work] = []
    if prefilling:
        left = budget or prefilling[0].cfg.prefill_chunk
        for s in prefilling:
            take = min(left, s.cfg.prefill_chunk, len(s.prompt) - s.filled)
            if take <= 0:
                break
            out.append(_Work(s, s.prompt[s.filled : s.filled + take]))
            left -= take
    return out


def _draft(drafts: list[_Work], prefills: list[_Work], cost: CostModel | None, context: float,
           settings: EngineConfig) -> list[_Work]:
    """Each decoding slot's tree, or its candidates when its method offers them (built only where a node can
    pay for its row: `_worth`), cut to the model's context. Returns the work of the slots whose drafting did
    not fail."""
    n_dec = len(drafts)
    n_pre = sum(len(w.chunk) for w in prefills)
    min_prob = _worth(cost, len(prefills) + n_dec, n_pre + n_dec, n_dec, context, settings, n_pre, len(prefills))
    token_ms = 0.0  # tokens a millisecond of this step is worth: its decoding rows' tokens over their price
    if cost is not None and n_dec:
        base = decoding_cost(cost, len(prefills) + n_dec, n_pre + n_dec, context, n_pre, len(prefills))
        token_ms = n_dec / base if base > 0 else 0.0
    return [w for w in drafts if _own(w.slot, "drafting", _draft_one, w, min_prob, token_ms, n_dec) is not None]


def _draft_one(w: _Work, min_prob: float, token_ms: float, batch: int) -> _Work:
    s = w.slot
    anchor = s.out[-1]
    prev = s.out[-2] if len(s.out) > 1 else s.prompt[-1]
    room = None if s.limit is None else s.limit - 1 - s.cache.length
    if s.method.offers_candidates:
        w.cands = s.method.candidates(anchor, prev, room, min_prob, token_ms, batch)
    else:
        tree = s.method.draft(anchor, prev)
        w.tree = tree if room is None else tree.within_depth(room)
    return w


def _select(drafts: list[_Work], prefills: list[_Work], cost: CostModel | None, context: float) -> None:
    """The batch's best subtrees for the slots that offer candidates, around the rows the others fill."""
    offered = [w for w in drafts if w.cands is not None]
    if not offered:
        return
    n_pre = sum(len(w.chunk) for w in prefills)
    fixed = n_pre + sum(len(w.tree.all_tokens) for w in drafts if w.tree)
    n_seq = len(prefills) + len(drafts)
    plain = len(drafts) - len(offered)
    try:
        picks = allocate([w.cands for w in offered], fixed, plain, cost, n_seq, context, n_pre, len(prefills))
    except Exception:  # one request's candidates broke the batch's choice: each is chosen alone, the bad one fails
        picks = [_own(w.slot, "selecting the tree", lambda c: allocate([c], fixed, plain, cost, n_seq, context,
                                                                      n_pre, len(prefills))[0], w.cands)
                 for w in offered]
    for w, tree in zip(offered, picks):
        w.tree = tree


def _tensorize(w: _Work) -> Segment:
    """The slot's segment of the forward: its prompt chunk (logits kept for the harvested positions, at
    least the last), or its tree's tokens with the tree's mask and depths (none for a chain)."""
    s = w.slot
    if w.chunk is not None:
        end = s.filled + len(w.chunk)
        tail = len(s.prompt) if s.method.prefill_harvest is None else s.method.prefill_harvest
        w.harvest = min(len(w.chunk), max(0, end - (len(s.prompt) - tail)))  # harvested positions here
        return Segment(s.cache, w.chunk, keep_last=max(w.harvest, 1), features=s.method.features)
    w.tokens = tokens = w.tree.all_tokens  # tree nodes, then any unverified extras (lookahead window)
    parents = w.tree.topology()
    if len(tokens) == 1 or is_chain(parents):
        return Segment(s.cache, tokens, features=s.method.features)
    return Segment(s.cache, tokens, tree_depths(parents), ancestor_mask(parents), features=s.method.features)


def _verify_and_commit(w: _Work, logits: torch.Tensor) -> None:
    """Stages 5-8 of one decoding slot, each timed on its own."""
    s = w.slot
    t = time.perf_counter()
    walk = _verify(w, logits)
    t = _add(s, "verify", t)
    s.cache.keep(walk.path)  # 6. compact KV
    t = _add(s, "compact", t)
    _harvest(w, logits, walk)
    t = _add(s, "harvest", t)
    _commit(w, walk)
    _add(s, "commit", t)


def _verify(w: _Work, logits: torch.Tensor) -> WalkResult:
    s = w.slot
    return s.chooser.walk(w.tree, logits, s.prompt, s.out)


def _harvest(w: _Work, logits: torch.Tensor, walk: WalkResult) -> None:
    """The method reads the logits of every node (each node's predecessor: its parent's token, the root's
    the token before the anchor) and what was accepted."""
    s, tree, tokens = w.slot, w.tree, w.tokens
    prev_anchor = s.out[-2] if len(s.out) > 1 else s.prompt[-1]
    prevs = [prev_anchor] + [tokens[p] for p in tree.all_parents[1:]]
    s.method.harvest(tokens, prevs, logits)
    s.method.observe(tree, walk)
    if s.method.features:  # the root's and the accepted nodes' hidden states: the positions now cached
        s.method.take_features(w.hidden[walk.path])


def _commit(w: _Work, walk: WalkResult) -> None:
    """The accepted tokens and the target's bonus token, with their draft sources."""
    s, tree = w.slot, w.tree
    s.commit([tree.tokens[i] for i in walk.path[1:]] + [walk.bonus],
             [tree.sources[i] for i in walk.path[1:]] + [ROOT])
    s.method.commit(s.new)
    s.stats.record_step(tree, walk)


def _worth(cost: CostModel | None, sequences: int, rows: int, value: float, context: float = 0.0,
           settings: EngineConfig = DEFAULTS, prefill_rows: int = 0, prefill_sequences: int = 0) -> float:
    """About the acceptance probability a draft node must reach to pay for its row in this step: the decoding
    rows' tokens per millisecond without drafts (`value` tokens; their forward priced alone when
    `prefill_rows` of the `rows` are prompt chunks of `prefill_sequences` of the `sequences`, as
    `selector.allocate_counts` prices them) times the marginal cost of a row in the whole step (its share of
    the cached `context` included, averaged over `settings.worth_rows` rows, or the rows left below the
    curve's end), times `settings.worth_margin`. Only speed depends on it (requests whose root children are
    all below it verify a plain step without building a candidate tree): 0 without a cost curve, infinite
    when the step already fills the curve (`allocate_counts` verifies no draft node past its end)."""
    if cost is None or value <= 0 or rows < 1:
        return 0.0
    span = min(settings.worth_rows, cost.max_size - rows)
    if span < 1:
        return math.inf
    at = cost.pricer(sequences, context)
    base = decoding_cost(cost, sequences, rows, context, prefill_rows, prefill_sequences)
    marginal = (at(rows + span) - at(rows)) / span
    return settings.worth_margin * value * marginal / base if base > 0 else 0.0


def _mean_context(slots: list[Slot]) -> float:
    """Mean cached tokens of the sequences in this step's forward (what each query row's attention reads)."""
    return sum(s.cache.length for s in slots) / len(slots) if slots else 0.0


def _add(s: Slot, name: str, t: float) -> float:
    now = time.perf_counter()
    s.stage_ms[name] = s.stage_ms.get(name, 0.0) + (now - t) * 1e3
    return now


def _after_prefill_chunk(w: _Work, logits: torch.Tensor) -> None:
    s, chunk, k = w.slot, w.chunk, w.harvest
    if s.method.features:
        s.method.take_features(w.hidden)
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
