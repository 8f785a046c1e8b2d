"""Many requests at once: the batched step loop, the batch allocation, the Engine and its failure modes.

The reference for every request is its own greedy `model.generate` run alone (sampling: `ar` alone with the
same seed), whatever arrived before, beside or after it."""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_EOS, TINY_VOCAB, greedy_memo, hf_greedy, make_tiny_llama, method_for
from goose import DecodeConfig, Decoder, Engine, GooseError
from goose.backends.forward import HFForward
from goose.backends.lean import LeanForward
from goose.config import GooseConfig
from goose.drafting.tree import BRANCH, SPINE, DraftTree
from goose.engine.methods import make_method
from goose.engine.step import Slot, step
from goose.selection.costmodel import BatchCostCurve, CostCurve
from goose.selection.selector import Candidates, allocate_counts

METHODS = ["ar", "pld", "tr", "goose-paper", "goose", "lookahead", "rest", "eagle2"]
FLAT = CostCurve((1, 128), (10.0, 10.0))  # every tree free: the largest candidates are verified
STEEP = CostCurve((1, 2, 128), (10.0, 20.0, 1280.0))  # every extra token as dear as a step


@pytest.fixture(scope="module")
def models():
    return {"float64": make_tiny_llama(torch.float64), "float32": make_tiny_llama(torch.float32, seed=3)}


def _forward(kind, model):
    return LeanForward(model) if kind == "lean" else HFForward(model)


# ---- the step loop over a batch, driven by hand (deterministic arrivals) -------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_batched_steps_equal_greedy_alone(models, data):
    """Random prompts arriving at random steps, random max_new_tokens, stop tokens, prefill chunks and
    cancellations, one method per request, both forwards, float64 and the float32 kernel path: every
    finished request's tokens equal its greedy decoding alone; a cancelled one's tokens are its prefix."""
    dtype = data.draw(st.sampled_from(["float64", "float32"]))
    model = models[dtype]
    fwd = _forward(data.draw(st.sampled_from(["lean", "hf"])), model)
    curve = data.draw(st.sampled_from([None, FLAT, STEEP]))
    cost = None if curve is None else BatchCostCurve.single(curve)
    n = data.draw(st.integers(1, 5))
    budget = data.draw(st.sampled_from([None, 3, 16]))
    plan = []
    for _ in range(n):
        prompt = data.draw(st.lists(st.integers(2, TINY_VOCAB - 1), min_size=1, max_size=24))
        if data.draw(st.booleans()):
            prompt = prompt + prompt[: data.draw(st.integers(1, len(prompt)))]  # a repeat for the spine
        plan.append(dict(prompt=prompt, arrive=data.draw(st.integers(0, 6)), new=data.draw(st.integers(1, 24)),
                         method=data.draw(st.sampled_from(METHODS)),
                         stop=data.draw(st.sampled_from([None, TINY_EOS, 7])),
                         chunk=data.draw(st.sampled_from([512, 5])),
                         cancel=data.draw(st.sampled_from([None, None, None, 2]))))
    slots, live = [None] * n, []
    for t in itertools.count():
        for i, p in enumerate(plan):
            if p["arrive"] == t:
                method = make_method(p["method"], TINY_VOCAB, cost=curve or FLAT) \
                    if p["method"] not in ("rest", "eagle2") else method_for(p["method"], model, curve or FLAT)
                method.prepare(model, fwd)
                eos = {TINY_EOS} | ({p["stop"]} if p["stop"] else set())
                s = Slot(p["prompt"], DecodeConfig(p["new"], prefill_chunk=p["chunk"]), method, fwd.new_cache(),
                         eos, model.config.max_position_embeddings)
                s.begin()
                slots[i] = s
                live.append((i, s, t))
        live = [(i, s, t0) for i, s, t0 in live
                if not s.done and not (plan[i]["cancel"] and t - t0 >= plan[i]["cancel"])]
        if not live and t > 6:
            break
        step(fwd, [s for _, s, _ in live], cost, budget)
    for p, s in zip(plan, slots):
        eos = p["stop"] if p["stop"] else TINY_EOS
        ref = greedy_memo(model, p["prompt"], p["new"]) if eos == TINY_EOS else _greedy_stop(model, p, eos)
        if s.done:
            assert s.out == ref, p
        else:  # cancelled mid-way
            assert s.out == ref[: len(s.out)], p


def _greedy_stop(model, p, extra):
    ref = greedy_memo(model, p["prompt"], p["new"])
    for i, t in enumerate(ref):
        if t == extra:
            return ref[: i + 1]
    return ref


# ---- batch allocation against brute force --------------------------------------------------------------
def _random_tree(rng, n):
    tree = DraftTree.root(0)
    tok = 1
    while len(tree) < n:
        if tree.add(rng.randrange(len(tree)), tok, rng.choice([SPINE, BRANCH])) >= 0:
            tok += 1
    return tree


def _subtrees(tree):
    """Every rooted subtree (closed under parents) as a set of nodes."""
    out = []
    for mask in range(1 << (len(tree) - 1)):
        keep = {0} | {i for i in range(1, len(tree)) if mask >> (i - 1) & 1}
        if all(tree.parents[i] in keep for i in keep if i):
            out.append(keep)
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n_req=st.integers(1, 3), fixed=st.integers(0, 4),
       shape=st.sampled_from(["flat", "knee", "steep", "linear"]), context=st.sampled_from([0.0, 100.0, 1500.0]))
def test_allocation_is_the_best_set_of_subtrees(seed, n_req, fixed, shape, context):
    """No combination of rooted subtrees (one per request) commits more expected tokens per millisecond, with
    rows priced at the sequences' cached context too."""
    rng = random.Random(seed)
    cands = []
    for _ in range(n_req):
        tree = _random_tree(rng, rng.randint(1, 5))
        q = [1.0] + [rng.uniform(0.01, 0.98) for _ in range(len(tree) - 1)]
        cands.append(Candidates(tree, q))
    ms = {"flat": [10] * 3, "knee": [10, 11, 30], "steep": [10, 25, 90], "linear": [10, 20, 40]}[shape]
    two = CostCurve((1, 4, 24), tuple(float(m) for m in ms), context_ms=0.004, cache_len=256)
    cost = BatchCostCurve(((1, two), (4, CostCurve((4, 24), (two(4) * 1.3, two(24) * 1.3)))))
    seqs = n_req + 1
    counts = allocate_counts(cands, fixed, 0.5, cost, seqs, context)

    def rate(sizes_and_values):
        n = fixed + sum(k for k, _ in sizes_and_values)
        return (0.5 + sum(v for _, v in sizes_and_values)) / cost(seqs, n, context)

    got = rate([(1 + k, 1 + c.expected(k)) for c, k in zip(cands, counts)])
    best = 0.0
    for combo in itertools.product(*[_subtrees(c.tree) for c in cands]):
        best = max(best, rate([(len(keep), 1 + sum(c.probs[i] for i in keep if i)) for keep, c in zip(combo, cands)]))
    assert got >= best * (1 - 1e-9)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n_req=st.integers(1, 3), chunk=st.integers(1, 40),
       shape=st.sampled_from(["knee", "steep", "linear"]))
def test_allocation_beside_a_prompt_chunk_prices_tokens_by_the_decoding_rows(seed, n_req, chunk, shape):
    """With a prompt chunk in the step, the allocation is the best set of subtrees for tokens per millisecond of
    the decoding rows' own forward plus what the drafts add to the whole step."""
    rng = random.Random(seed)
    cands = []
    for _ in range(n_req):
        tree = _random_tree(rng, rng.randint(1, 5))
        cands.append(Candidates(tree, [1.0] + [rng.uniform(0.01, 0.98) for _ in range(len(tree) - 1)]))
    ms = {"knee": [10, 11, 30, 90], "steep": [10, 25, 90, 300], "linear": [10, 20, 40, 120]}[shape]
    one = CostCurve((1, 4, 24, 64), tuple(float(m) for m in ms))
    cost = BatchCostCurve(((1, one), (4, CostCurve((4, 24, 64), (one(4) * 1.3, one(24) * 1.3, one(64) * 1.3)))))
    seqs = n_req + 1
    counts = allocate_counts(cands, chunk, 0.0, cost, seqs, 0.0, chunk, 1)

    def rate(sizes_and_values):
        n = chunk + sum(k for k, _ in sizes_and_values)
        alone = cost(n_req, n_req)
        return sum(v for _, v in sizes_and_values) / (alone + cost(seqs, n) - cost(seqs, chunk + n_req))

    got = rate([(1 + k, 1 + c.expected(k)) for c, k in zip(cands, counts)])
    best = 0.0
    for combo in itertools.product(*[_subtrees(c.tree) for c in cands]):
        best = max(best, rate([(len(keep), 1 + sum(c.probs[i] for i in keep if i)) for keep, c in zip(combo, cands)]))
    assert got >= best * (1 - 1e-9)


def test_a_prompt_chunk_does_not_make_draft_rows_look_cheap():
    """The same candidates beside a long prompt chunk: priced as plain rows of the step, the chunk made a token
    look dear and drew in nodes that a decoding step would not verify; priced apart, they stay out."""
    curve = CostCurve((1, 8, 16, 32, 64, 128), (10.0, 11.0, 13.0, 20.0, 40.0, 80.0))
    cost = BatchCostCurve.single(curve)
    tree = DraftTree.root(0)
    tree.add_chain(0, list(range(1, 20)), SPINE)
    cands = [Candidates(tree, [1.0] + [0.6] * 19) for _ in range(4)]
    alone = sum(allocate_counts(cands, 0, 0.0, cost, 4))
    as_rows = sum(allocate_counts(cands, 60, 0.0, cost, 5))
    apart = sum(allocate_counts(cands, 60, 0.0, cost, 5, 0.0, 60, 1))
    assert as_rows > alone >= apart


def test_allocation_speculates_less_at_longer_contexts():
    """Rows that read a longer cached context cost more: the same candidates get fewer draft nodes."""
    curve = CostCurve((1, 8, 16, 32, 64, 128), (10.0, 11.0, 13.0, 20.0, 40.0, 80.0), context_ms=0.002, cache_len=256)
    cost = BatchCostCurve.single(curve)
    assert cost.row_context_ms(100.0) == 0.0 and cost.row_context_ms(1256.0) == pytest.approx(2.0)
    assert cost(1, 8, 1256.0) == pytest.approx(11.0 + 8 * 2.0)
    tree = DraftTree.root(0)
    tree.add_chain(0, list(range(1, 20)), SPINE)
    cands = [Candidates(tree, [1.0] + [0.8] * 19) for _ in range(2)]
    drafted = [sum(allocate_counts(cands, cost=cost, context=c)) for c in (0.0, 1256.0, 4256.0)]
    assert drafted[0] > drafted[1] > drafted[2]


def test_allocation_turns_speculation_down_as_the_batch_grows():
    """With a forward whose cost grows with the batch's rows, more requests get fewer draft nodes each."""
    curve = CostCurve((1, 8, 16, 32, 64, 128), (10.0, 11.0, 13.0, 20.0, 40.0, 80.0))
    cost = BatchCostCurve.single(curve)
    tree = DraftTree.root(0)
    tree.add_chain(0, list(range(1, 20)), SPINE)
    per_request = []
    for b in (1, 4, 16):
        cands = [Candidates(tree, [1.0] + [0.8] * 19) for _ in range(b)]
        per_request.append(sum(allocate_counts(cands, cost=cost)) / b)
    assert per_request[0] > per_request[1] > per_request[2]


# ---- the Engine ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["lean", "hf"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_engine_concurrent_submissions_equal_greedy(models, kind, dtype):
    model = models[dtype]
    rng = random.Random(7)
    prompts = [[rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(10)]
    head = method_for("eagle2", model).cfg  # a random draft head for the model
    with Engine(model, None, "goose", 3, GooseConfig(eagle=head), forward=_forward(kind, model)) as eng:
        reqs = []
        for i, p in enumerate(prompts):
            reqs.append(eng.submit(p, 20 + i, method=METHODS[i % len(METHODS)] if i % 7 != 6 else "ar"))
            time.sleep(rng.random() * 0.01)
        got = [r.result(timeout=120).token_ids for r in reqs]
    assert got == [greedy_memo(model, p, 20 + i) for i, p in enumerate(prompts)]
    assert max(eng.batch_sizes) > 1  # requests really shared forwards


def test_engine_sampling_equals_ar_alone(models):
    model = models["float32"]
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11], [3] * 7]
    opts = dict(do_sample=True, temperature=0.8, top_k=20)
    alone = [Decoder(model, None, "ar").generate_ids(p, DecodeConfig(25, seed=i, **opts))[0]
             for i, p in enumerate(prompts)]
    with Engine(model, None, "goose", max_batch=4) as eng:
        reqs = [eng.submit(p, 25, seed=i, **opts) for i, p in enumerate(prompts)]
        assert [r.result(timeout=60).token_ids for r in reqs] == alone


def test_engine_streams_cancels_and_isolates_failures(models):
    model = models["float32"]
    ref = greedy_memo(model, [4, 5, 6], 30)
    with Engine(model, None, "goose", max_batch=2) as eng:
        boom = eng.submit([4, 5, 6], 30, on_tokens=lambda block: 1 / 0)
        bad_stop = eng.submit([4, 5, 6], 30, stop=lambda toks: {}["x"])
        ok = eng.submit([4, 5, 6], 30)
        blocks = list(ok.tokens(timeout=60))
        assert sum(blocks, []) == ok.result().token_ids == ref
        with pytest.raises(ZeroDivisionError):
            boom.result(timeout=60)
        with pytest.raises(KeyError):
            bad_stop.result(timeout=60)
        slow = eng.submit([4, 5, 6], 500)
        it = slow.tokens(timeout=60)
        next(it)
        it.close()  # the consumer went away: the request is cancelled at the next step
        assert slow.wait(60) and slow.finish_reason == "cancelled"
        with pytest.raises(GooseError, match="cancelled"):
            slow.result()
        assert eng.submit([4, 5, 6], 30).result(timeout=60).token_ids == ref  # the engine goes on
    assert boom.finish_reason == "error" and ok.finish_reason in ("stop", "length")


def test_engine_rejects_bad_requests_alone(models):
    model = models["float64"]
    limit = model.config.max_position_embeddings
    with Engine(model, None, "ar", max_batch=2, max_queue=1) as eng:
        with pytest.raises(GooseError, match="exceeds the model's context"):
            eng.submit([3] * 10, limit)
        with pytest.raises(GooseError, match="unknown option"):
            eng.submit([3], 5, temprature=0.5)
        with pytest.raises(GooseError, match="token ids"):
            eng.submit([TINY_VOCAB + 5], 5)
        with pytest.raises(GooseError, match="tokenizer"):
            eng.submit("text", 5)
        assert eng.submit([3, 4], 8).result(timeout=60).token_ids == greedy_memo(model, [3, 4], 8)
    with pytest.raises(GooseError, match="closed"):
        eng.submit([3], 5)


def test_engine_queue_bound(models):
    model = models["float64"]
    gate = threading.Event()
    with Engine(model, None, "ar", max_batch=1, max_queue=1) as eng:
        first = eng.submit([3, 4], 5, on_tokens=lambda b: gate.wait(30))
        while eng.load()[0] == 0:  # running
            time.sleep(0.01)
        eng.submit([3, 4], 5)  # waits
        with pytest.raises(GooseError, match="queue is full"):
            eng.submit([3, 4], 5)
        gate.set()
        assert first.result(timeout=60).token_ids == greedy_memo(model, [3, 4], 5)


# ---- stale weights -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_changed_weights_are_never_decoded_stale(dtype):
    """After an in-place update (optimizer step, load_state_dict) new Decoders, reused Decoders and
    Engines decode with the new weights; a forward given by the caller is refused."""
    model = make_tiny_llama(dtype, seed=11)
    prompt = [5, 6, 7, 8, 5, 6]
    dec = Decoder(model, None, "goose")
    given_fwd = LeanForward(model)
    mine = Decoder(model, None, "ar", forward=given_fwd)
    assert dec.generate_ids(prompt, DecodeConfig(20))[0] == greedy_memo(model, prompt, 20)
    other = make_tiny_llama(dtype, seed=12)
    model.load_state_dict(other.state_dict())  # in place
    new_ref = hf_greedy(model, prompt, 20)
    assert dec.generate_ids(prompt, DecodeConfig(20))[0] == new_ref
    assert Decoder(model, None, "pld").generate_ids(prompt, DecodeConfig(20))[0] == new_ref
    with pytest.raises(GooseError, match="weights changed"):
        mine.generate_ids(prompt, DecodeConfig(20))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)  # an optimizer-like step
    ref2 = hf_greedy(model, prompt, 20)
    with Engine(model, None, "goose", max_batch=2) as eng:
        assert eng.submit(prompt, 20).result(timeout=60).token_ids == ref2
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)
        ref3 = hf_greedy(model, prompt, 20)
        assert eng.submit(prompt, 20).result(timeout=60).token_ids == ref3


@pytest.mark.parametrize("max_new", [3, 30])
def test_a_request_running_when_weights_change_fails_instead_of_finishing(max_new):
    """Weights changed between two steps of a running request: it never completes on the old cache, whether
    it would have finished at once (3 tokens) or runs on (30: checked within WEIGHTS_CHECK_STEPS steps)."""
    model = make_tiny_llama(torch.float32, seed=5)
    changed = []

    def on_tokens(block):
        if not changed:
            changed.append(True)
            with torch.no_grad():
                model.lm_head.weight.mul_(-1.0)

    with Engine(model, None, "ar", max_batch=2) as eng:
        req = eng.submit([5, 6, 7, 8], max_new, on_tokens=on_tokens)
        with pytest.raises(GooseError, match="weights changed"):
            req.result(timeout=60)
        prompt = [4, 5, 6]
        assert eng.submit(prompt, 10).result(timeout=60).token_ids == hf_greedy(model, prompt, 10)


def test_engine_loop_on_the_callers_thread(models):
    """Engine(thread=False): run() drives the step loop on the calling thread until close() from another."""
    model = models["float32"]
    prompts = [[4, 5, 6], [7, 8, 9, 7, 8], [3] * 5]
    eng = Engine(model, None, "goose", max_batch=2, thread=False)
    out = []

    def client():
        try:
            out.extend(eng.generate_batch(prompts, 20))
        finally:
            eng.close()

    th = threading.Thread(target=client)
    th.start()
    eng.run()
    th.join(60)
    assert [r.token_ids for r in out] == [greedy_memo(model, p, 20) for p in prompts]
    with pytest.raises(GooseError, match="already running|closed"):
        eng.submit([3], 5)
    with Engine(model, None, "ar") as threaded, pytest.raises(GooseError, match="own thread"):
        threaded.run()


def test_engines_stepped_in_turns_on_one_thread(models):
    """Engine(thread=False).step(): two engines driven in turns from one loop, one step each, decode what greedy
    decoding does; step() does nothing (False) once no request is queued or running, and a threaded engine
    refuses it."""
    model = models["float32"]
    prompts = [[4, 5, 6], [7, 8, 9, 7, 8], [3] * 5]
    engines = [Engine(model, None, m, max_batch=2, thread=False) for m in ("goose", "ar")]
    reqs = [[eng.submit(p, 12) for p in prompts] for eng in engines]
    steps = [0, 0]
    while any(not r.done for rs in reqs for r in rs):
        for i, eng in enumerate(engines):
            steps[i] += eng.step()
    assert [[r.result().token_ids for r in rs] for rs in reqs] == [[greedy_memo(model, p, 12) for p in prompts]] * 2
    assert all(n >= 12 for n in steps) and not any(eng.step() for eng in engines)
    for eng in engines:
        eng.close()
    with Engine(model, None, "ar") as threaded, pytest.raises(GooseError, match="own thread"):
        threaded.step()
