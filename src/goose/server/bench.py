"""`goose bench-serve`: a bounded load benchmark of any OpenAI-compatible server on this machine.

For each client concurrency (1, 2, 4, 8 by default) it sends greedy streaming chat requests (the first turn of
each prompt, `max_tokens` each) through the `openai` async client and measures output tokens per second over
the level's wall time, time to first token and time per output token (p50 / p95), errors, and whether every
prompt's text equals its text at the first level. A soak then sends N more requests at the highest
concurrency and closes a random ~20% of the streams early (client cancellations), and reads the server's
/metrics (when it has them) for running requests and resident memory before and after. For a soak that
makes a prefix cache evict, `soak_unique` gives every soak request a prompt and a tenant (`user`) of its own
(the prompt plus a numbered tail: the prompts' first blocks are shared, the tails and answers are new, so the
working set outgrows any cache, and the tenants outnumber any tenant cap) and `soak_stop_rate` gives that
fraction of them stop strings (`SOAK_STOPS`, multi-byte ones among them); the prefix cache's evictions and
hits before and after are read from /metrics too. The soak runs in two halves, and the resident memory is
read between them: over the second half, once the caches are full, it should stay flat
(`SOAK_RSS_TOLERANCE`). With `soak_unique` every soak request is its tenant's first, so any cached prompt
token it reports came from another tenant: `merged` counts those requests (it must stay 0).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

from ..errors import GooseError


@dataclass
class Sample:
    prompt: int
    ok: bool
    text: str = ""
    tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float = 0.0
    cancelled: bool = False
    error: str | None = None
    tau: float | None = None
    cached: int = 0  # prompt tokens the server reports as taken from its prefix cache


@dataclass
class Level:
    name: str
    concurrency: int
    requests: int
    wall_s: float
    tokens: int
    errors: int
    cancelled: int
    tok_s: float
    req_s: float
    ttft_p50: float | None
    ttft_p95: float | None
    tpot_p50: float | None
    tpot_p95: float | None
    tau: float | None
    identical: str = "-"  # texts equal to the first level's, "n/m"
    first_error: str | None = None
    merged: int = 0  # with unique tenants: requests that reported cached prompt tokens (another tenant's)
    texts: dict = field(default_factory=dict, repr=False)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


# stop strings of soak requests drawn to have them: common ones that do stop, and multi-byte ones (a swan emoji
# is 9 tokens of SmolLM2's tokenizer) that exercise the byte-sized stop window on every token
SOAK_STOPS = [".", "\n", "🦢🦢🦢", "。"]
SOAK_RSS_TOLERANCE = 0.05  # the soak's resident memory may grow at most 5% ("flat")


async def one_request(client, model: str, prompt: str, i: int, max_tokens: int, extra: dict,
                      cancel_after: int | None = None, stop: list[str] | None = None,
                      user: str | None = None) -> Sample:
    t0 = time.perf_counter()
    first = None
    pieces: list[str] = []
    usage = None
    tau = None
    chunks = 0
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra or None,
            **({"stop": stop} if stop else {}), **({"user": user} if user else {}))
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter()
                pieces.append(ch.choices[0].delta.content)
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    await stream.close()
                    return Sample(i, True, "".join(pieces), chunks, first - t0, None, time.perf_counter() - t0,
                                  cancelled=True)
            if ch.usage is not None:
                usage = ch.usage
                g = (ch.model_extra or {}).get("goose")
                tau = g.get("tau") if isinstance(g, dict) else None
    except Exception as exc:  # counted, never raised: a benchmark reports errors
        return Sample(i, False, error=f"{type(exc).__name__}: {str(exc)[:200]}", e2e_s=time.perf_counter() - t0)
    end = time.perf_counter()
    n = usage.completion_tokens if usage is not None else chunks
    tpot = (end - first) / (n - 1) if first is not None and n > 1 else None
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) or 0
    return Sample(i, True, "".join(pieces), n, None if first is None else first - t0, tpot, end - t0, tau=tau,
                  cached=cached)


async def run_level(client, model: str, prompts: list[str], concurrency: int, n_requests: int, max_tokens: int,
                    extra: dict, timeout: float, name: str, cancel_rate: float = 0.0, seed: int = 0,
                    unique: bool = False, stop_rate: float = 0.0) -> Level:
    """`n_requests` requests over `prompts` (in turn) at `concurrency`; `cancel_rate` of them closed after 1-7
    chunks, `stop_rate` of them with stop strings (`SOAK_STOPS`), and with `unique` each prompt gets a tail of
    its own (" (request SEED-N)") and its own tenant (``user`` "soak-SEED-N")."""
    rng = random.Random(seed)
    order = [i % len(prompts) for i in range(n_requests)]
    plan = [(i, rng.randrange(1, 8) if rng.random() < cancel_rate else None,
             f" (request {seed}-{n})" if unique else "", SOAK_STOPS if rng.random() < stop_rate else None,
             f"soak-{seed}-{n}" if unique else None)
            for n, i in enumerate(order)]
    samples: list[Sample] = []
    queue = list(reversed(plan))

    async def worker():
        while queue:
            i, cancel_after, tail, stop, user = queue.pop()
            samples.append(await one_request(client, model, prompts[i] + tail, i, max_tokens, extra, cancel_after,
                                             stop, user))

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    wall = time.perf_counter() - t0
    full = [s for s in samples if s.ok and not s.cancelled]
    errors = [s for s in samples if not s.ok] + [None] * len(pending)
    taus = [s.tau for s in full if s.tau is not None]
    toks = sum(s.tokens for s in samples if s.ok)
    texts: dict = {}
    for s in full:
        texts.setdefault(s.prompt, set()).add(s.text)
    return Level(name, concurrency, len(samples), wall, toks, len(errors), sum(s.cancelled for s in samples),
                 toks / wall if wall > 0 else 0.0, len(full) / wall if wall > 0 else 0.0,
                 pct([s.ttft_s for s in full if s.ttft_s is not None], 0.5),
                 pct([s.ttft_s for s in full if s.ttft_s is not None], 0.95),
                 pct([s.tpot_s for s in full if s.tpot_s is not None], 0.5),
                 pct([s.tpot_s for s in full if s.tpot_s is not None], 0.95),
                 statistics.fmean(taus) if taus else None,
                 first_error=next((s.error for s in samples if s.error), "timed out" if pending else None),
                 texts=texts, merged=sum(s.cached > 0 for s in samples if s.ok) if unique else 0)


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


async def scrape(base: str) -> dict:
    """Numbers from the server's /metrics (goose's; empty when it has none)."""
    try:
        text = await asyncio.to_thread(_get, base.rstrip("/").removesuffix("/v1") + "/metrics")
    except Exception:
        return {}
    out = {}
    for line in text.splitlines():
        for name in SCRAPED:
            if line.startswith(name + " "):
                out[name] = float(line.split()[-1])
    return out


SCRAPED = ("goose_requests_running", "goose_requests_waiting", "process_resident_memory_bytes",
           "goose_prefix_cache_evicted_blocks_total", "goose_prefix_cache_hit_tokens_total", "goose_prefix_cache_bytes",
           "goose_prefix_cache_limit_bytes", "goose_prompt_tokens_total", "goose_prompt_tokens_cached_total")


def fmt(x, scale=1.0, digits=0) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def table(levels: list[Level]) -> str:
    rows = ["| run | concurrency | requests | errors | output tok/s | req/s | TTFT p50 / p95 ms | "
            "TPOT p50 / p95 ms | τ | identical texts |", "|---|---|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        rows.append(f"| {lv.name} | {lv.concurrency} | {lv.requests} | {lv.errors} | {lv.tok_s:.1f} | "
                    f"{lv.req_s:.2f} | {fmt(lv.ttft_p50, 1e3)} / {fmt(lv.ttft_p95, 1e3)} | "
                    f"{fmt(lv.tpot_p50, 1e3, 1)} / {fmt(lv.tpot_p95, 1e3, 1)} | {fmt(lv.tau, 1, 2)} | "
                    f"{lv.identical} |")
    return "\n".join(rows)


async def bench(url: str, model: str | None, api_key: str, concurrencies: list[int], n_requests: int | None,
                prompts: list[str], max_tokens: int, extra: dict, soak: int, timeout: float, seed: int,
                label: str, soak_unique: bool = False, soak_stop_rate: float = 0.0) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=timeout)
    if model is None:
        try:
            model = (await client.models.list()).data[0].id
        except openai.OpenAIError as exc:
            await client.close()
            raise GooseError(f"cannot list the models of {url}: {type(exc).__name__}: {exc}") from None
    levels: list[Level] = []
    for c in concurrencies:
        n = n_requests or max(len(prompts), 2 * c)
        lv = await run_level(client, model, prompts, c, n, max_tokens, extra, timeout, label, seed=seed)
        if levels:
            ref = levels[0].texts
            same = sum(1 for i, t in lv.texts.items() if i in ref and t == ref[i] and len(t) == 1)
            lv.identical = f"{same}/{len(lv.texts)}"
        else:
            lv.identical = f"{sum(1 for t in lv.texts.values() if len(t) == 1)}/{len(lv.texts)}"
        levels.append(lv)
        print(f"  concurrency {c}: {lv.tok_s:.1f} tok/s, {lv.errors} errors", file=sys.stderr, flush=True)
    result = {"url": url, "model": model, "max_tokens": max_tokens, "extra": extra,
              "levels": [{k: v for k, v in asdict(lv).items() if k != "texts"} for lv in levels]}
    # each prompt's greedy text at the first level (compare runs, e.g. speculation on and off)
    result["texts"] = {str(i): sorted(t)[0] for i, t in sorted(levels[0].texts.items())}
    if soak:
        before = await scrape(url)
        c = max(concurrencies)
        halves, mids = [], []
        for h, n in enumerate((soak // 2, soak - soak // 2)):
            halves.append(await run_level(client, model, prompts, c, n, max_tokens, extra, timeout,
                                          f"{label} soak {h + 1}/2", cancel_rate=0.2, seed=seed + 1 + h,
                                          unique=soak_unique, stop_rate=soak_stop_rate))
            await asyncio.sleep(1.0)
            mids.append(await scrape(url))
        mid, after = mids
        rss = [m.get("process_resident_memory_bytes") for m in (before, mid, after)]

        def grew(name):
            return None if name not in after or name not in before else after[name] - before[name]

        def mb(x):
            return None if x is None else x / 2**20

        result["soak"] = {"requests": sum(lv.requests for lv in halves), "errors": sum(lv.errors for lv in halves),
                          "cancelled": sum(lv.cancelled for lv in halves), "merged": sum(lv.merged for lv in halves),
                          "tok_s": sum(lv.tokens for lv in halves) / sum(lv.wall_s for lv in halves),
                          "wall_s": sum(lv.wall_s for lv in halves),
                          "first_error": next((lv.first_error for lv in halves if lv.first_error), None),
                          "unique_prompts": soak_unique, "stop_rate": soak_stop_rate,
                          "running_after": after.get("goose_requests_running"),
                          "waiting_after": after.get("goose_requests_waiting"),
                          "rss_before_mb": mb(rss[0]), "rss_mid_mb": mb(rss[1]), "rss_after_mb": mb(rss[2]),
                          "rss_growth": None if None in (rss[0], rss[2]) else rss[2] / rss[0] - 1,
                          "rss_growth_second_half": None if None in rss[1:] else rss[2] / rss[1] - 1,
                          "prefix_evicted_blocks": grew("goose_prefix_cache_evicted_blocks_total"),
                          "prefix_hit_tokens": grew("goose_prefix_cache_hit_tokens_total"),
                          "prompt_tokens": grew("goose_prompt_tokens_total"),
                          "prefix_cache_mb_after": None if "goose_prefix_cache_bytes" not in after
                          else after["goose_prefix_cache_bytes"] / 2**20}
        levels.extend(halves)
    result["table"] = table(levels)
    await client.close()
    return result


def run_cli(args) -> int:
    from ..bench import datasets

    check_loopback(args.url)
    try:
        concurrencies = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    except ValueError:
        raise GooseError(f"--concurrency must be comma-separated integers, got '{args.concurrency}'") from None
    if not concurrencies or min(concurrencies) < 1 or max(concurrencies) > 64:
        raise GooseError("--concurrency levels must be in 1..64")
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as exc:
            raise GooseError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise GooseError("--extra-body must be a JSON object")
    if args.speculative:
        extra["speculative"] = args.speculative
    prompts = [q.turns[0] for q in datasets.load(args.prompts, limit=args.limit)]
    print(f"bench-serve: {args.url}, {len(prompts)} prompts, max_tokens {args.max_tokens}, concurrency "
          f"{','.join(map(str, concurrencies))}" + (f", soak {args.soak}" if args.soak else ""), file=sys.stderr)
    stop_rate = getattr(args, "soak_stop_rate", 0.0)
    if not 0.0 <= stop_rate <= 1.0:
        raise GooseError(f"--soak-stop-rate must be in 0..1, got {stop_rate}")
    result = asyncio.run(bench(args.url, args.model, args.api_key, concurrencies, args.requests, prompts,
                               args.max_tokens, extra, args.soak, args.timeout, args.seed, args.label or args.url,
                               soak_unique=getattr(args, "soak_unique", False), soak_stop_rate=stop_rate))
    print(result["table"])
    if "soak" in result:
        s = result["soak"]
        print(f"soak: {s['requests']} requests, {s['cancelled']} cancelled by the client, {s['errors']} errors, "
              f"{s['merged']} saw another tenant's cached tokens; running after: {s['running_after']}, "
              f"RSS {fmt(s['rss_before_mb'])} -> {fmt(s['rss_mid_mb'])} -> {fmt(s['rss_after_mb'])} MiB"
              + ("" if s["rss_growth_second_half"] is None else
                 f" ({s['rss_growth_second_half']:+.1%} over the second half)")
              + ("" if s["prefix_evicted_blocks"] is None else
                 f"; prefix cache: {s['prefix_evicted_blocks']:.0f} blocks evicted, "
                 f"{s['prefix_hit_tokens']:.0f} of {s['prompt_tokens']:.0f} prompt tokens reused"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    soak = result.get("soak") or {}
    failed = sum(lv["errors"] for lv in result["levels"]) + soak.get("errors", 0) + soak.get("merged", 0)
    return 1 if failed else 0


def check_loopback(url: str) -> None:
    """Refuse any server that is not on this machine: the load benchmark sends traffic to loopback only."""
    from urllib.parse import urlparse

    host = urlparse(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise GooseError(f"bench-serve only talks to a server on this machine (loopback), not {host!r}")
