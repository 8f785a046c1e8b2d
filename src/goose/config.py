"""Every default of every decoding method lives here, as frozen dataclasses.

The numbers are those of the GOOSE paper's main configuration (its spine source, branch source and spine tree)
and of the parent methods it compares with (PLD, Token Recycling, Lookahead, REST). Nothing else in the package
holds a tuning literal.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .errors import GooseError


@dataclass(frozen=True)
class NgramConfig:
    """Context n-gram index (the spine source: what followed an earlier occurrence of the context's last n tokens)."""

    ngram_sizes: tuple[int, ...] = (5, 4, 3)  # looked up longest first
    max_chain: int = 20  # tokens copied after the earliest match
    max_extended_chain: int = 100  # cap on a chain grown by repeated lookups
    extend_threshold: float = 0.6  # chains with confidence above this are extended

    def __post_init__(self) -> None:
        if not self.ngram_sizes or any(n < 1 for n in self.ngram_sizes):
            raise ValueError(f"ngram_sizes must be positive integers, got {self.ngram_sizes}")
        if self.max_chain < 1 or self.max_extended_chain < self.max_chain:
            raise ValueError("need 1 <= max_chain <= max_extended_chain")


@dataclass(frozen=True)
class AdjacencyConfig:
    """Two-tier adjacency table (the branch source: the model's own remembered top-k successors of a token)."""

    top_k: int = 10  # successors remembered per token
    use_bigram: bool = True  # (prev, token) tier, preferred over the unigram row
    with_scores: bool = True  # softmax over the top-k values; Token Recycling keeps ids only
    hot_start: bool = False  # keep the table across requests of one decoder (Token Recycling style)

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError("top_k must be >= 1")


@dataclass(frozen=True)
class SpineTreeConfig:
    """The anisotropic spine tree under a node budget: a deep spine of context-matched tokens, shallow branches."""

    budget: int = 60  # B, nodes including the root
    ema_init: float = 0.5
    ema_rate: float = 0.3  # ema = rate * observed + (1 - rate) * ema
    ema_tiers: tuple[tuple[float, float], ...] = ((0.2, 0.15), (0.4, 0.30))  # (ema below, base ratio)
    ema_top_base: float = 0.50
    spine_branch_share: float = 0.5  # part of the branch budget hung off spine nodes
    min_score: float = 0.01  # adjacency successors below this are never drafted
    max_branch_depth: int = 6  # branch nodes this deep are not expanded further
    bypass_confidence: float = 1.0  # at this confidence the whole budget goes to the spine

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError("budget must be >= 1 (the root)")


@dataclass(frozen=True)
class IsotropicConfig:
    """The paper's balanced (isotropic) control: every node gets up to `width` children, from the same sources."""

    width: int = 3
    min_score: float = 0.01
    max_depth: int = 6


@dataclass(frozen=True)
class PLDConfig:
    """Prompt lookup decoding (a baseline, one of GOOSE's parent methods), with Hugging Face's option names."""

    prompt_lookup_num_tokens: int = 10
    max_matching_ngram_size: int = 3  # tries n = max..1
    min_matching_ngram_size: int = 1


def _tr_template() -> tuple[tuple[int, ...], ...]:
    """Token Recycling's published static tree (80 nodes, 6 levels) as candidate-rank paths."""
    levels = [
        [(i,) for i in range(8)],
        [(0, j) for j in range(8)] + [(1, j) for j in range(4)] + [(2, j) for j in range(3)]
        + [(3, 0), (3, 1), (4, 0), (5, 0), (6, 0), (7, 0)],
        [(0, 0, j) for j in range(8)] + [(0, 1, j) for j in range(3)]
        + [(0, 2, 0), (0, 2, 1), (0, 3, 0), (0, 4, 0), (0, 5, 0), (0, 6, 0), (0, 7, 0), (1, 0, 0),
           (1, 0, 1), (1, 1, 0), (2, 0, 0), (3, 0, 0), (4, 0, 0), (5, 0, 0)],
        [(0, 0, 0, j) for j in range(5)]
        + [(0, 0, 1, 0), (0, 0, 1, 1), (0, 0, 2, 0), (0, 0, 3, 0), (0, 0, 4, 0), (0, 1, 0, 0),
           (0, 2, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0), (3, 0, 0, 0)],
        [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 2), (0, 0, 0, 1, 0), (0, 0, 0, 2, 0),
         (0, 0, 1, 0, 0), (0, 1, 0, 0, 0), (1, 0, 0, 0, 0)],
        [(0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 1), (0, 0, 0, 1, 0, 0)],
    ]
    return tuple(path for level in levels for path in level)


@dataclass(frozen=True)
class TRConfig:
    """Token Recycling (a baseline, a parent method of GOOSE): top-8 id matrix, static 80-node template, hot start."""

    top_k: int = 8
    hot_start: bool = True
    template: tuple[tuple[int, ...], ...] = field(default_factory=_tr_template)



@dataclass(frozen=True)
class LookaheadConfig:
    """Lookahead decoding (a baseline): Jacobi window W, n-gram size N, guess set G.

    Defaults are the reference implementation's recommended setting (``LEVEL=5, WINDOW_SIZE=7,
    GUESS_SET_SIZE=7``), the small one of the paper's settings (7B on an A100 used W = G = 15): at most
    (N - 1) * (W + G) = 56 extra tokens per forward."""

    window: int = 7  # W: Jacobi window columns
    ngram_size: int = 5  # N: the window keeps N - 1 levels; n-grams of N tokens go to the pool
    guess_set_size: int = 7  # G: n-grams kept per key token (most recent), all verified as one trie
    seed: int = 0  # initial window: tokens drawn from the context with this seed

    def __post_init__(self) -> None:
        if self.window < 1 or self.ngram_size < 2 or self.guess_set_size < 0:
            raise ValueError("need window >= 1, ngram_size >= 2, guess_set_size >= 0")


@dataclass(frozen=True)
class RestConfig:
    """REST (a baseline): continuations retrieved from a datastore by longest suffix match, merged into a trie.

    Defaults follow REST: context suffixes of 16 down to 2 tokens, a trie of at most 64 draft nodes."""

    datastore: str = "default"  # name under the user cache dir (`goose datastore build --name`)
    max_suffix: int = 16  # longest context suffix searched (then shorter ones, down to min_suffix)
    min_suffix: int = 2
    max_continuations: int = 1000  # continuations read from the match range (evenly spaced when more)
    continuation_length: int = 10  # tokens per continuation (stops at a document boundary)
    node_budget: int = 64  # draft nodes in the trie, the root not counted

    def __post_init__(self) -> None:
        if not 1 <= self.min_suffix <= self.max_suffix:
            raise ValueError("need 1 <= min_suffix <= max_suffix")
        if self.max_continuations < 1 or self.continuation_length < 1 or self.node_budget < 0:
            raise ValueError("need max_continuations >= 1, continuation_length >= 1, node_budget >= 0")


@dataclass(frozen=True)
class MemoryConfig:
    """The cross-request suffix memory (`goose.drafting.memory`): how a lookup searches and what it proposes.
    Its size is its owner's (`Decoder(memory_mb=...)`, `EngineConfig.memory_mb`)."""

    min_match: int = 3  # k: context suffixes shorter than this are not looked up (the hashed k-gram)
    max_match: int = 32  # match lengths are measured up to this many tokens
    max_candidates: int = 16  # newest occurrences of the k-gram examined per lookup
    count_depth: int = 16  # depths whose next tokens are tallied over the matching occurrences
    max_spine: int = 64  # spine tokens proposed (beyond count_depth: copied from the newest agreeing occurrence)
    max_branches: int = 8  # alternatives (tokens that followed less often) proposed as branches
    branch_length: int = 4  # tokens of each alternative's continuation

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match:
            raise GooseError("need 1 <= min_match <= max_match")
        for name in ("max_candidates", "count_depth", "max_spine", "branch_length"):
            if getattr(self, name) < 1:
                raise GooseError(f"{name} must be >= 1")
        if self.max_branches < 0:
            raise GooseError("max_branches must be >= 0")


@dataclass(frozen=True)
class AcceptanceConfig:
    """Priors and grouping of the online acceptance model used by the device-aware `goose` method."""

    # spine nodes by the match they were copied after: consensus, long (>= 8 tokens), short, and weak (an n-gram of
    # at most `DeviceAwareConfig.weak_ngram` tokens, whatever its followers)
    spine_prior: tuple[float, float, float, float] = (0.7, 0.5, 0.3, 0.3)
    branch_prior: tuple[float, ...] = (0.3, 0.1, 0.05, 0.03, 0.02)  # by adjacency rank (last one repeats)
    # memory nodes, by how often their token followed the match (`goose.selection.acceptance.memory_rank`):
    # all of >= 2 occurrences, all of one, most of them, fewer; after a match of >= 8 tokens, and a shorter one
    memory_prior: tuple[float, float, float, float] = (0.7, 0.5, 0.4, 0.1)
    memory_short_prior: tuple[float, float, float, float] = (0.4, 0.2, 0.2, 0.05)
    prior_strength: float = 4.0  # pseudo-trials behind each prior
    max_rank: int = 9  # ranks above this share a group
    max_branch_depth: int = 6  # branch depths above this share a group
    max_prob: float = 0.98  # keeps path probabilities strictly decreasing
    # spine nodes (n-gram chain or memory spine) a step did not verify count as trials of their group, for groups
    # no verified node has tried yet, up to this many trials (`AcceptanceModel.explore_chain`; 0: never): a group
    # the cost curve prices out still learns its rate
    explore_trials: int = 16

    def __post_init__(self) -> None:
        if self.explore_trials < 0:
            raise GooseError(f"explore_trials must be >= 0, got {self.explore_trials}")
        if len(self.spine_prior) != 4 or not all(0.0 <= p <= 1.0 for p in self.spine_prior):
            raise GooseError("spine_prior needs 4 probabilities (consensus, long, short, weak match), "
                             f"got {self.spine_prior}")


@dataclass(frozen=True)
class DeviceAwareConfig:
    """`goose`: draft a generous spine tree, then verify the subtree with the best tokens per second."""

    candidate_budget: int = 96  # nodes of the candidate tree, root included (capped by the cost curve)
    # adjacency branch nodes of the candidate tree at most (None: as the budget allows); the spine keeps its share.
    # Measured (docs/performance-log.md, "Fewer candidate branches"): the steps verified the same nodes (tau unchanged)
    # with 16 as with 80, and drafting cost 0.1 ms less per step
    candidate_branches: int | None = 16
    # the n-gram sizes `goose` matches the context's suffix with, longest first (`goose-paper` keeps
    # `NgramConfig.ngram_sizes`, the paper's 5, 4, 3). Chains after a match of at most `weak_ngram` tokens are
    # priced as their own group (`AcceptanceConfig.spine_prior`'s weak entry). Measured (docs/performance-log.md,
    # "Two-token matches"): replaying greedy outputs of Spec-Bench questions, a 2-token match was the next token
    # in about half the steps where no longer n-gram matched (3-5-token matches: 80%), and adding them raised the
    # tokens per chain of 4 from 1.49 to 1.61; 1-token matches were right in 17-24%, less than the adjacency
    # table's first successor, so they are not looked up
    ngram_sizes: tuple[int, ...] = (5, 4, 3, 2)
    weak_ngram: int = 2
    carry_over: bool = True  # keep acceptance statistics across requests of one decoder
    # prompt positions (the last k) harvested into the adjacency table at prefill; None: all (as goose-paper).
    # Each costs a vocabulary-wide projection; measured on the CPU (benchmarks/prefill_harvest.py), τ was the
    # same for 0, 64 and all, and 0 was 3-5% faster, so goose harvests from verification steps only.
    prefill_harvest: int | None = 0
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    # under load (a node must reach path probability p to pay for its row) the candidate tree is cut to what
    # could pay: at most 1 / p branch nodes per depth for this many depths, and never fewer nodes than
    # `load_min_budget` (`goose.engine.methods.load_budget`)
    load_depths: int = 4
    load_min_budget: int = 8

    def __post_init__(self) -> None:
        if self.load_depths < 1 or self.load_min_budget < 1:
            raise GooseError("load_depths and load_min_budget must be >= 1")
        if self.candidate_branches is not None and self.candidate_branches < 0:
            raise GooseError(f"candidate_branches must be >= 0 or None, got {self.candidate_branches}")
        if not self.ngram_sizes or any(n < 1 for n in self.ngram_sizes):
            raise GooseError(f"ngram_sizes must be positive integers, got {self.ngram_sizes}")
        if self.weak_ngram < 0:
            raise GooseError(f"weak_ngram must be >= 0, got {self.weak_ngram}")

@dataclass(frozen=True)
class EagleConfig:
    """`eagle2`: EAGLE-2's dynamic draft tree grown by a trained draft head (`goose.backends.head`).

    Each step the head drafts `depth` levels: the root's `top_k` most likely children, then at each level the
    `top_k` nodes of highest joint draft probability get `top_k` children each; every node drafted is a
    candidate, and the device-aware selector verifies the subtree of highest path probability that pays for
    its rows (EAGLE-2's rerank, sized by this device's cost curve). `head`: the head's folder, "packaged" (the
    head packaged for the model, `goose.heads`) or "none"; None: "packaged" for `eagle2`, "none" for `goose`
    (a head drafts inside `goose` only when named: the packaged SmolLM2 head does not pay there on the CPUs
    measured, docs/performance.md)."""

    head: str | None = None
    depth: int = 5
    top_k: int = 4
    # `goose` only: the head drafts while the steps it drafts commit more tokens per millisecond than those it
    # does not (each arm's average over about 1 / `pay_rate` of its steps); the other arm runs one step in
    # `probe_every` to measure again. 0 probes: the head always drafts.
    pay_rate: float = 0.1
    probe_every: int = 16
    # the most pending positions (the prompt's, or a resting head's) one step runs through the head; older ones stay
    # out of its cache. A long prompt's first head step costs `catch_up` rows, not the prompt's length: on Spec-Bench
    # (int8, Zen 3) 64 cut `eagle2`'s drafting to 1.50 ms a step from 1.89 with 256, its τ the same (1.37)
    catch_up: int = 64
    # the head's weights on goose's integer kernels: 4 (GGUF Q4_0 blocks) or 8 (Q8_0). Only drafts depend on them; a
    # head step reads its weights whole, so 4 bits cut its layer 0.204 -> 0.125 ms on a Xeon with AMX (one row,
    # benchmarks/head_cost.py), its top-1 the same
    head_bits: int = 4

    def __post_init__(self) -> None:
        if self.head_bits not in (4, 8):
            raise GooseError(f"eagle head_bits must be 4 or 8, got {self.head_bits}")
        if not 0.0 < self.pay_rate <= 1.0:
            raise GooseError(f"eagle pay_rate must be in (0, 1], got {self.pay_rate}")
        if self.probe_every < 0:
            raise GooseError(f"eagle probe_every must be >= 0, got {self.probe_every}")
        if self.catch_up < 1:
            raise GooseError(f"eagle catch_up must be >= 1, got {self.catch_up}")
        if not 1 <= self.depth <= 32:
            raise GooseError(f"eagle depth must be in 1..32, got {self.depth}")
        if not 1 <= self.top_k <= 64:
            raise GooseError(f"eagle top_k must be in 1..64, got {self.top_k}")


@dataclass(frozen=True)
class GooseConfig:
    """Everything the GOOSE-family decoders need (`goose-paper`, `iso*`, device-aware `goose`)."""

    ngram: NgramConfig = field(default_factory=NgramConfig)
    adjacency: AdjacencyConfig = field(default_factory=AdjacencyConfig)
    tree: SpineTreeConfig = field(default_factory=SpineTreeConfig)
    device_aware: DeviceAwareConfig = field(default_factory=DeviceAwareConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    eagle: EagleConfig = field(default_factory=EagleConfig)

    def with_budget(self, budget: int) -> "GooseConfig":
        return replace(self, tree=replace(self.tree, budget=budget))



@dataclass(frozen=True)
class DecodeConfig:
    """Per-request options shared by every method.

    Greedy by default. With ``do_sample=True`` each emitted token is sampled from the target's distribution
    after temperature, then top-k, then top-p (the order Hugging Face applies them); every method then
    produces exactly the distribution of plain sampling, and with a ``seed`` the same tokens as ``ar``.
    """

    max_new_tokens: int = 128
    prefill_chunk: int = 512  # prompt tokens per prefill forward (bounds the logits held at once)
    do_sample: bool = False
    temperature: float = 1.0  # > 0; only used when sampling
    top_k: int | None = None  # keep the k most likely tokens (None or 0: off)
    top_p: float | None = None  # keep the smallest set with probability >= top_p (None or 1.0: off)
    seed: int | None = None  # sampling seed (None: torch's global generator)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise GooseError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.prefill_chunk < 1:
            raise GooseError("prefill_chunk must be >= 1")
        if not self.temperature > 0:
            raise GooseError(f"temperature must be > 0, got {self.temperature} (use do_sample=False for greedy)")
        if self.top_k is not None and self.top_k < 0:
            raise GooseError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise GooseError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):
            raise GooseError(f"seed must be an integer in 0..2^64-1, got {self.seed!r}")


@dataclass(frozen=True)
class ProposerConfig:
    """Defaults of `goose.integrations.vllm.GooseProposer` (vLLM gives custom proposers no options: subclass to
    change them)."""

    ngram: NgramConfig = field(default_factory=lambda: NgramConfig(ngram_sizes=(5, 4, 3, 2)))
    # P(token accepted | previous accepted) before any observation, by match kind: consensus, long (>= 8
    # tokens), short, and a match in earlier requests' contexts
    prior: tuple[float, float, float, float] = (0.8, 0.6, 0.4, 0.5)
    prior_strength: float = 4.0  # pseudo-trials behind each prior
    weak_ngram: int = 2  # matches of this n or shorter get the short prior whatever their length
    max_prob: float = 0.98
    # verify cost: C(T) = 1 + slope * T in units of a one-token step; slope starts at the prior and is
    # fitted online from step times once `cost_min_samples` clean steps with different T were seen
    cost_prior_slope: float = 0.03
    cost_prior_weight: float = 32.0  # pseudo-samples behind the prior slope
    cost_window: int = 512  # recent (T, seconds) samples kept for the fit
    cost_min_samples: int = 16
    cost_outlier: float = 4.0  # a step slower than this many times the prediction is not a sample
    cost_min_slope: float = 0.005  # a verified token is never free (noise can fit a flat line)
    min_prob: float = 0.02  # never draft a token below this path probability
    state_ttl: int = 64  # steps a request's state survives without being seen
    # contexts of requests that left the batch, searched when a request's own context matches less of its
    # suffix (repeated and similar requests); at most this many tokens (the oldest half is dropped); 0: off
    memory_tokens: int = 1 << 20
    head: int = 16  # leading tokens that identify a request's context


DEFAULT_PREFIX_CACHE_MB = 256  # Engine(prefix_cache_mb=...), goose serve / bench --prefix-cache-mb
DEFAULT_MEMORY_MB = 64  # Engine / Decoder(memory_mb=...), goose serve --memory-mb: the cross-request suffix memory
# goose serve --stall-timeout: seconds without a finished step, while requests wait or run, after which /health
# answers 503
DEFAULT_STALL_S = 60.0
LIMIT_CONNECTIONS = 512  # connections a server holds at once (`goose serve --limit-concurrency`)
HEADER_TIMEOUT_S = 10.0  # seconds a server's client may take to send a request's headers (`--header-timeout`)
BODY_TIMEOUT_S = 30.0  # seconds a server's client may take to send a request's body (`--body-timeout`)
DEFAULT_SNAPSHOT_S = 300.0  # goose serve --snapshot-interval: seconds between memory snapshots (when they changed)
DEFAULT_MAX_TENANTS = 10_000  # Engine(max_tenants=...), goose serve --max-tenants: per memory pool and prefix cache


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of the step loop and of the `Engine` that runs it, checked once here.

    `max_batch`: requests decoded together (more wait in a FIFO queue). `max_queue`: waiting requests beyond
    which `submit` raises (None: unbounded). `prefill_chunk`: prompt tokens all prefilling requests may add in
    one step (None: each request's own ``prefill_chunk``). `prefix_cache_mb`: MiB for reused prompt prefixes
    (0: off). The rest tune speed only, never the tokens."""

    max_batch: int = 8
    max_queue: int | None = None
    prefill_chunk: int | None = None
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB
    memory_mb: float = DEFAULT_MEMORY_MB  # MiB for the suffix memories of all tenants together (0: off)
    # tenants the suffix memory and the prefix cache each keep (the least recently used tenant goes first)
    max_tenants: int = DEFAULT_MAX_TENANTS
    # a request's candidate tree is built when its best child may bring this many times a row's price:
    # building, pricing and harvesting a tree costs Python time that the cost curve does not price
    worth_margin: float = 1.5
    worth_rows: int = 4  # the marginal cost of a draft row is averaged over this many rows (the curve has flat steps)
    # the step loop corrects its measured cost curve from its own forwards' times (`selection.costmodel.TrackedCost`:
    # on a shared machine the price of extra rows moves); False: the curve as measured
    track_cost: bool = True
    tree_room: int = 160  # cache entries reserved beyond prompt + max_new_tokens for a step's tree (more still fit)
    weights_check_steps: int = 8  # steps between weights checks while no request joins or finishes
    # the Engine's constructor collects garbage, then leaves every object alive then (the libraries, the model)
    # out of Python's later cyclic collections (gc.freeze): a full collection otherwise walks them all (~360k
    # objects with torch, transformers and SmolLM2 loaded: ~200 ms, a stall of every request in flight)
    freeze_gc: bool = True
    # the methods requests may name (``submit(method=...)``; "ar", no speculation, always): each prepared when
    # the engine starts, so no request waits for a method's preparation or cost curve. None: any method,
    # each prepared when a request first names it
    methods: tuple[str, ...] | None = None
    # the step loop's forwards move to one thread, whose projections run on the kernels' claim pool (team.h), while
    # that is faster (other processes hold the cores: an OpenMP team then waits for descheduled threads at every
    # parallel region) and back once it is not, as measured by a probe forward of at most 16 query rows on the
    # other setting (2 s after the last, each probe that does not switch doubling the wait up to 32 s; at once
    # when a forward on all threads runs 1.5x slower than usual; `goose.engine.threads`); False: torch's threads
    # as set
    adapt_threads: bool = True

    def __post_init__(self) -> None:
        if self.methods is not None:
            from .names import METHODS

            if isinstance(self.methods, str) or not all(isinstance(m, str) for m in self.methods):
                raise GooseError(f"methods must be a tuple of method names, got {self.methods!r}")
            unknown = [m for m in self.methods if m not in METHODS]
            if unknown:
                raise GooseError(f"unknown method(s) {', '.join(unknown)}; choose among: {', '.join(METHODS)}")
            object.__setattr__(self, "methods", tuple(dict.fromkeys(("ar", *self.methods))))
        if not _is_int(self.max_batch) or self.max_batch < 1:
            raise GooseError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_queue is not None and (not _is_int(self.max_queue) or self.max_queue < 0):
            raise GooseError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.prefill_chunk is not None and (not _is_int(self.prefill_chunk) or self.prefill_chunk < 1):
            raise GooseError(f"prefill_chunk must be >= 1 (or None: each request's own), got {self.prefill_chunk}")
        if isinstance(self.prefix_cache_mb, bool) or not isinstance(self.prefix_cache_mb, (int, float)) \
                or not 0 <= self.prefix_cache_mb < float("inf"):
            raise GooseError(f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")
        check_memory_mb(self.memory_mb)
        if not 0 <= self.worth_margin < float("inf"):
            raise GooseError(f"worth_margin must be >= 0, got {self.worth_margin}")
        for name in ("worth_rows", "weights_check_steps", "max_tenants"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise GooseError(f"{name} must be an integer >= 1, got {getattr(self, name)}")
        if not _is_int(self.tree_room) or self.tree_room < 0:
            raise GooseError(f"tree_room must be an integer >= 0, got {self.tree_room}")
        for name in ("freeze_gc", "adapt_threads", "track_cost"):
            if not isinstance(getattr(self, name), bool):
                raise GooseError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def prefix_cache_bytes(self) -> int:
        return int(self.prefix_cache_mb * 2**20)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_mb * 2**20)


def check_memory_mb(value) -> float:
    """A suffix memory's size in MiB: a finite number >= 0 (0 turns the memory off)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise GooseError(f"memory_mb must be a number >= 0 (0: off), got {value!r}")
    return float(value)
