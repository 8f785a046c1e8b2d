"""A forward for the Llama family on a GPU: static KV cache, tree mask built on the device, CUDA graphs per
node-count bucket. Device-generic PyTorch (it runs on CPU for tests), read from a Hugging Face model's weights.

Layout (B rows in a call, S cache slots of C entries, L layers, K KV heads of D, H query heads, G = H / K)::

    kv    [L, 2, S + 1, C, K, D]   every cache of this forward is one slot (the last: scratch for graph capture)
    rows of a call: token ids [B], depths [B], ancestor mask allowed [B, B], ancestor table anc [B, B]
    meta  [2] = (slot * C, P) on the device: where the sequence's slot starts, entries cached before the call

Row i of a call sits at position P + depths[i] (RoPE from a table of the model's own rotary module) and writes its
keys and values at cache entry P + i; `keep(path)` moves the accepted entries down on the device.

Modes (`mode`), each an arithmetic of its own (`arith`, which `Decoder` compares for equality):

* ``"bf16"`` (default on CUDA): bfloat16 weights and activations, PyTorch's kernels (cuBLAS, SDPA with a boolean
  mask). Agrees with plain decoding by this forward up to floating-point near-ties: a GEMM or attention kernel
  may reduce in another order when a call holds more rows.
* ``"fp32"`` (default on CPU): the same in float32, TF32 off.
* ``"fixed"``: the kernels of `goose.backends.fixed_kernels` (Triton; PyTorch's row loop where Triton cannot run),
  whose result for a row does not depend on how many rows the call holds nor on the tree around it: every
  method's output equals this forward's own plain greedy decoding bit for bit. Weights in `fixed_dtype`
  (bfloat16 on CUDA, float32 elsewhere), float32 accumulation, float32 logits.

CUDA graphs (`graphs`, default on CUDA): one graph per bucket of rows (`BUCKETS`: 1, 2, 4, ..., 128), captured
once when the forward is built and replayed; a call of n rows replays the smallest bucket >= n with its padding
rows masked out (`GraphRunner`). Calls of more rows than the largest bucket (a long prompt's prefill), or whose
padded rows would pass the cache's capacity, run eagerly. A bucket whose capture runs out of GPU memory is left
out, and so are the larger ones: those sizes run eagerly (the fallback is named in `backend`).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import GooseError
from ..progress import note
from ..protocols import Forward, KVCache, Segment, check_taps, feature_taps, with_taps
from .fixed_kernels import fixed_kernels
from .forward import weights_fingerprint
from .packed import PackedWeight

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # rows per captured graph
MODES = ("bf16", "fp32", "fixed")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
DEFAULT_MAX_LEN = 2048  # cache entries per slot
DEFAULT_SLOTS = 8  # caches alive at once (one request's, the forward's own, a cost measurement's)
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def bucket_for(n: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket holding n rows, or None when n is larger than every bucket."""
    if n < 1:
        raise GooseError(f"a forward needs at least one row, not {n}")
    return next((b for b in buckets if b >= n), None)


def ancestor_table(allowed: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """``anc [n, n]`` (long): row i's ancestor at depth d is row ``anc[i, d]`` (d <= depths[i]; itself at its own
    depth; 0 beyond). Raises GooseError when `allowed` is not the ancestor mask of a tree with these depths: each
    row sees exactly one row at each depth 0..depths[i], itself at its own."""
    n = allowed.shape[0]
    if allowed.shape != (n, n) or depths.shape != (n,):
        raise GooseError(f"a tree needs allowed [n, n] and depths [n], not {list(allowed.shape)} and "
                         f"{list(depths.shape)}")
    allowed, depths = allowed.to("cpu", torch.bool), depths.to("cpu", torch.long)
    idx = torch.arange(n)
    if ((depths < 0) | (depths >= n)).any() or not allowed[idx, idx].all() \
            or not torch.equal(allowed.sum(1), depths + 1):
        raise GooseError("allowed is not a tree's ancestor mask for these depths (each row sees itself and one "
                         "ancestor at each smaller depth)")
    rows, cols = allowed.nonzero(as_tuple=True)
    at = depths[cols]  # the depth of each row seen
    seen = torch.zeros(n, n, dtype=torch.long).index_put_((rows, at), torch.ones_like(rows), accumulate=True)
    if (at > depths[rows]).any() or seen.max() > 1:
        raise GooseError("allowed is not a tree's ancestor mask: a row sees two rows at one depth, or a deeper one")
    anc = torch.zeros(n, n, dtype=torch.long)
    anc[rows, at] = cols
    return anc


def graph_mask(allowed: torch.Tensor, p: torch.Tensor, capacity: int) -> torch.Tensor:
    """Boolean attention mask ``[B, capacity]`` built on the device without reading `p` on the host (so it can be
    captured in a graph): row i sees the p cached entries and the rows j of its call with allowed[i, j], which sit
    at entries p + j."""
    B = allowed.shape[0]
    col = torch.arange(capacity, device=allowed.device)  # [C]
    t = col - p  # [C] the call's row at each entry (negative: the prefix)
    inside = (t >= 0) & (t < B)
    tree = allowed.gather(1, t.clamp(0, B - 1).expand(B, capacity)) & inside  # [B, C]
    return tree | (t < 0)


class _Static:
    """One bucket's input buffers on the device (what a graph reads) and their pinned host staging."""

    def __init__(self, rows: int, device: torch.device, pinned: bool) -> None:
        self.rows = rows
        self.ints = torch.zeros(2 + 2 * rows + rows * rows, dtype=torch.long, device=device)  # meta, ids, depths, anc
        self.allowed = torch.zeros(rows, rows, dtype=torch.bool, device=device)
        self.host_ints = torch.zeros(self.ints.shape, dtype=torch.long, pin_memory=pinned)
        self.host_allowed = torch.zeros(rows, rows, dtype=torch.bool, pin_memory=pinned)
        self.copied = None  # a CUDA event after the last copy (the staging is not refilled before it)
        self._views()

    def _views(self) -> None:
        B = self.rows
        self.meta, self.ids, self.depths = self.ints[:2], self.ints[2 : 2 + B], self.ints[2 + B : 2 + 2 * B]
        self.anc = self.ints[2 + 2 * B :].view(B, B)

    def fill(self, base: int, p: int, tokens: list[int], depths: torch.Tensor, allowed: torch.Tensor,
             anc: torch.Tensor) -> None:
        """Stage a call of n <= rows rows; padding rows see only the prefix and themselves, at depth 0."""
        B, n = self.rows, len(tokens)
        if self.copied is not None:
            self.copied.synchronize()
        h = self.host_ints
        h.zero_()
        h[0], h[1] = base, p
        h[2 : 2 + n] = torch.tensor(tokens, dtype=torch.long)
        h[2 + B : 2 + B + n] = depths
        hv = h[2 + 2 * B :].view(B, B)
        hv[:n, :n] = anc
        hv[n:, 0] = torch.arange(n, B)
        a = self.host_allowed
        a.zero_()
        a[:n, :n] = allowed
        pad = torch.arange(n, B)
        a[pad, pad] = True
        self.ints.copy_(h, non_blocking=True)
        self.allowed.copy_(a, non_blocking=True)
        if self.ints.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()


class CudaGraph:
    """`torch.cuda.CUDAGraph` behind the two calls `GraphRunner` makes: `capture(fn)` (warm-up on a side stream,
    then capture into a memory pool shared by all buckets) and `replay()`."""

    def __init__(self, pool=None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], tuple]) -> tuple:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class GraphRunner:
    """Which graph serves a call, and the static buffers it reads: captured once per bucket (`capture_all`), never
    again; a call of n rows fills the smallest bucket >= n (padding rows masked out) and replays its graph.

    `step(static) -> outputs` computes a call from a bucket's `_Static` buffers; `make_graph()` makes a graph object
    with ``capture(fn) -> outputs`` and ``replay()`` (`CudaGraph` on CUDA; tests pass a stand-in that re-runs fn).
    Outputs are the tensors the capture returned, updated in place by each replay."""

    def __init__(self, step: Callable[[_Static], tuple], make_graph: Callable[[], object], device: torch.device,
                 buckets: tuple[int, ...] = BUCKETS) -> None:
        self.step, self.make_graph, self.device, self.buckets = step, make_graph, device, tuple(buckets)
        self.graphs: dict[int, tuple[object, _Static, tuple]] = {}
        self.captured = False
        self.captures = 0  # graphs captured (never more than the buckets)
        self.replays = 0
        self.failed: int | None = None  # the first bucket that did not fit in memory

    def capture_all(self, prepare: Callable[[_Static], None]) -> None:
        """Capture every bucket's graph, smallest first; `prepare(static)` stages a harmless call (the scratch slot).
        A bucket whose capture runs out of memory is dropped with every larger one (those sizes run eagerly)."""
        if self.captured:
            raise GooseError("the graphs are captured once, when the forward is built: never again")
        pinned = self.device.type == "cuda"
        for b in self.buckets:
            static = _Static(b, self.device, pinned)
            prepare(static)
            try:
                graph = self.make_graph()
                out = graph.capture(lambda s=static: self.step(s))
            except torch.OutOfMemoryError:
                self.failed = b
                note(f"the graph for {b} rows does not fit in GPU memory: calls of {b} rows or more run eagerly")
                break
            self.graphs[b] = (graph, static, out)
            self.captures += 1
        self.captured = True

    def bucket(self, n: int, p: int, capacity: int) -> int | None:
        """The captured bucket that serves n rows after p cached entries, or None (run eagerly)."""
        b = bucket_for(n, self.buckets)
        if b is None or b not in self.graphs or p + b > capacity:
            return None
        return b

    def run(self, b: int, base: int, p: int, tokens: list[int], depths: torch.Tensor, allowed: torch.Tensor,
            anc: torch.Tensor) -> tuple:
        graph, static, out = self.graphs[b]
        static.fill(base, p, tokens, depths, allowed, anc)
        graph.replay()
        self.replays += 1
        return out


class _Layer:
    __slots__ = ("ln1", "eps1", "qkv", "qkv_b", "o", "o_b", "ln2", "eps2", "gu", "gu_b", "down", "down_b", "qk_norm")


def unsupported_reason(model) -> str | None:
    """Why `GPUForward` cannot run `model`, or None when it can (goose's Llama-family structure, no sliding window,
    a rotary embedding whose values depend on the position alone)."""
    from .lean import unsupported_reason as lean_reason

    why = lean_reason(model)
    if why is not None:
        return why
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope"):
        return f"rope type '{rope_type}' rescales with the sequence length"
    return None


def _plain(weight) -> torch.Tensor:
    """A weight as a plain tensor (goose's packed panels or GGUF blocks dequantized)."""
    if isinstance(weight, PackedWeight):
        return weight.dequantize()
    return weight.detach()


class GPUForward(Forward):
    """The Llama family on a GPU (or any PyTorch device) with a static cache and CUDA graphs: see the module doc."""

    plan = None

    def __init__(self, model, *, device: str | torch.device | None = None, mode: str | None = None,
                 fixed_dtype: str | None = None, graphs: bool | None = None, max_len: int = DEFAULT_MAX_LEN,
                 slots: int = DEFAULT_SLOTS, buckets: tuple[int, ...] = BUCKETS, make_graph=None,
                 use_triton: bool | None = None, kernels=None) -> None:
        """`device`: None = CUDA when available, else the model's device; "cuda" without a GPU is refused.
        `mode`: "bf16", "fp32" or "fixed" (None: "bf16" on CUDA, "fp32" elsewhere). `fixed_dtype`: the weights'
        dtype in fixed mode (None: "bf16" on CUDA, "fp32" elsewhere). `graphs`: capture CUDA graphs per bucket
        (None: on CUDA); `make_graph` makes the graph objects (a stand-in, for tests off CUDA). `max_len`: cache
        entries per sequence; `slots`: caches alive at once. `use_triton`: the fixed mode's Triton kernels (None:
        on CUDA; True: also under Triton's interpreter on CPU; see `fixed_kernels.fixed_kernels`); `kernels`: the
        fixed mode's kernels themselves (a `TritonFixed` or `TorchFixed`), instead."""
        why = unsupported_reason(model)
        if why is not None:
            raise GooseError(f"GPUForward does not support this model: {why}")
        self.device = self._device(model, device)
        on_cuda = self.device.type == "cuda"
        mode = mode or ("bf16" if on_cuda else "fp32")
        if mode not in MODES:
            raise GooseError(f"unknown mode '{mode}'; choose one of: {', '.join(MODES)}")
        if mode == "fixed":
            name = fixed_dtype or ("bf16" if on_cuda else "fp32")
            if name not in DTYPES:
                raise GooseError(f"unsupported dtype '{name}' for the fixed mode; choose bf16 or fp32")
            self.dtype = DTYPES[name]
            self.fixed = kernels if kernels is not None else fixed_kernels(self.device, use_triton)
            if on_cuda and not self.fixed.name.startswith("triton"):
                raise GooseError("the fixed mode on CUDA needs Triton (pip install triton)")
        else:
            if fixed_dtype is not None or kernels is not None:
                raise GooseError("fixed_dtype and kernels apply to mode='fixed' only")
            self.dtype, self.fixed = DTYPES[mode], None
        self.mode = mode
        if max_len < 1 or slots < 1:
            raise GooseError(f"max_len and slots must be >= 1 (got {max_len}, {slots})")
        self.capacity, self.slots = int(max_len), int(slots)
        self._model = weakref.ref(model)
        self.fingerprint = weights_fingerprint(model)
        with torch.no_grad():
            self._copy_weights(model)
            self._rope_table(model)
        L = len(self.layers)
        # every slot's cache, and a scratch slot for captures: [L, 2, S + 1, C, K, D]
        try:
            self.kv = torch.zeros(L, 2, self.slots + 1, self.capacity, self.n_kv, self.head_dim, dtype=self.dtype,
                                  device=self.device)
        except torch.OutOfMemoryError as exc:
            raise GooseError(f"a KV cache of {self.slots} slots x {self.capacity} entries does not fit in memory: "
                             f"pass fewer slots or a smaller max_len") from exc
        self._free = list(range(self.slots))
        dt = {torch.bfloat16: "bf16", torch.float32: "fp32"}[self.dtype]
        self.arith = f"gpu-fixed-{dt}" if mode == "fixed" else f"gpu-{dt}"
        use_graphs = on_cuda if graphs is None else bool(graphs)
        if use_graphs and make_graph is None and not on_cuda:
            raise GooseError("CUDA graphs need a CUDA device (or a stand-in graph: make_graph)")
        self.runner = None
        if use_graphs:
            pool = torch.cuda.graph_pool_handle() if make_graph is None else None
            fit = tuple(b for b in buckets if b <= self.capacity)  # (a larger one never fits a slot)
            self.runner = GraphRunner(self._graph_step, make_graph or (lambda: CudaGraph(pool)), self.device, fit)
            with self._numerics(), torch.inference_mode():
                self.runner.capture_all(self._stage_scratch)
        self.backend = self._backend_name()
        self.cache = self.new_cache()  # the single-sequence API's (reset / __call__ / keep)

    # ---- construction ------------------------------------------------------------------------------------------
    @staticmethod
    def _device(model, device) -> torch.device:
        if device is None:
            if torch.cuda.is_available():
                return torch.device("cuda")
            return next(model.parameters()).device
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise GooseError(f"unknown device '{device}'") from exc
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise GooseError("device 'cuda' requested but no CUDA device is available (is this a GPU machine with "
                             "a CUDA build of PyTorch?)")
        return dev

    def _copy_weights(self, model) -> None:
        cfg, base = model.config, model.model
        attn0 = base.layers[0].self_attn
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, attn0.head_dim
        self.group, self.scale = self.n_heads // self.n_kv, attn0.scaling
        dev, dt = self.device, self.dtype

        def put(t):
            return None if t is None else _plain(t).to(dev, dt).contiguous()

        def cat(mods, attr="weight"):
            parts = [getattr(m, attr) for m in mods]
            if attr == "bias" and all(p is None for p in parts):
                return None
            parts = [_plain(p) if p is not None else torch.zeros(m.out_features) for p, m in zip(parts, mods)]
            return torch.cat([p.to(dev, dt) for p in parts]).contiguous()

        self.embed = put(base.embed_tokens.weight)  # [V, hid]
        self.vocab = self.embed.shape[0]
        self.layers = []
        for layer in base.layers:
            a, m, L = layer.self_attn, layer.mlp, _Layer()
            L.ln1, L.eps1 = put(layer.input_layernorm.weight), layer.input_layernorm.variance_epsilon
            L.ln2, L.eps2 = put(layer.post_attention_layernorm.weight), layer.post_attention_layernorm.variance_epsilon
            L.qkv, L.qkv_b = cat([a.q_proj, a.k_proj, a.v_proj]), cat([a.q_proj, a.k_proj, a.v_proj], "bias")
            L.o, L.o_b = put(a.o_proj.weight), put(a.o_proj.bias)
            L.gu, L.gu_b = cat([m.gate_proj, m.up_proj]), cat([m.gate_proj, m.up_proj], "bias")
            L.down, L.down_b = put(m.down_proj.weight), put(m.down_proj.bias)
            L.qk_norm = None
            if hasattr(a, "q_norm"):
                L.qk_norm = (put(a.q_norm.weight), a.q_norm.variance_epsilon, put(a.k_norm.weight),
                             a.k_norm.variance_epsilon)
            self.layers.append(L)
        self.norm, self.norm_eps = put(base.norm.weight), base.norm.variance_epsilon
        tied = model.lm_head.weight is base.embed_tokens.weight
        self.lm_head = self.embed if tied else put(model.lm_head.weight)  # [V, hid] (a tied head: one copy)
        self.lm_head_b = put(model.lm_head.bias)

    def _rope_table(self, model) -> None:
        """cos, sin ``[C, D]`` of the model's rotary module for every cache position, in the compute dtype."""
        rotary = model.model.rotary_emb
        pdev = next(model.parameters()).device
        pos = torch.arange(self.capacity + max(BUCKETS), device=pdev)[None]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32, device=pdev), pos)
        self.cos = cos[0].to(self.device, self.dtype).contiguous()
        half = self.head_dim // 2  # rotate_half(x) * sin == cat(x[half:], x[:half]) * [-sin_lo, sin_hi]
        sin = sin[0]
        self.sin = torch.cat([-sin[:, :half], sin[:, half:]], -1).to(self.device, self.dtype).contiguous()

    def _backend_name(self) -> str:
        where = self.device.type
        if self.device.type == "cuda":
            where = f"cuda:{torch.cuda.get_device_name(self.device)}"
        parts = [f"gpu[{where}]", self.mode, {torch.bfloat16: "bf16", torch.float32: "fp32"}[self.dtype]]
        if self.fixed is not None:
            parts.append(self.fixed.name)
        if self.runner is not None:
            top = max(self.runner.graphs, default=0)
            parts.append(f"graphs<={top}" if self.runner.failed else "graphs")
        return "-".join(parts)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights every forward reads whole (projections and the output head)."""
        ts = [t for L in self.layers for t in (L.qkv, L.o, L.gu, L.down)] + [self.lm_head]
        return sum(t.numel() * t.element_size() for t in ts)

    def stale(self) -> bool:
        """True when the model's weights changed since they were copied here."""
        model = self._model()
        return model is None or weights_fingerprint(model) != self.fingerprint

    # ---- caches ------------------------------------------------------------------------------------------------
    @property
    def free_caches(self) -> int:
        return len(self._free)

    @property
    def max_entries(self) -> int:
        return self.capacity

    def new_cache(self) -> "GPUCache":
        """A cache of its own for one sequence: a slot of the static cache, given back when the cache object goes."""
        if not self._free:
            raise GooseError(f"all {self.slots} cache slots of this GPUForward are in use: build it with more slots")
        slot = self._free.pop(0)
        cache = GPUCache(self, slot)
        weakref.finalize(cache, self._free.append, slot)
        return cache

    # ---- forward -----------------------------------------------------------------------------------------------
    @contextmanager
    def _numerics(self):
        """TF32 off for the float32 modes (cuBLAS and cuDNN read the flags when a kernel is chosen or captured)."""
        if self.device.type != "cuda":
            yield
            return
        m, c = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = m, c

    @torch.inference_mode()
    def run(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Each segment's logits (``[n or keep_last, vocab]``), one sequence after another (a graph per call); returns
        when the device has computed them (so `goose.engine.measure` times whole forwards)."""
        if len({id(s.cache) for s in segments}) != len(segments):
            raise GooseError("a forward cannot append to one cache twice")
        with self._numerics():
            out = [self._one(s) for s in segments]
        if self.device.type == "cuda":  # the caller reads the logits next; a cost measurement times the whole call
            torch.cuda.synchronize(self.device)
        return out

    def _one(self, s: Segment) -> torch.Tensor:
        c = s.cache
        if not isinstance(c, GPUCache) or c.forward is not self:
            raise GooseError("a GPUForward runs only on caches it made (forward.new_cache())")
        n = len(s.tokens)
        if n == 0:
            raise GooseError("no tokens to forward")
        if min(s.tokens) < 0 or max(s.tokens) >= self.vocab:  # (on a GPU a bad index would stop the device)
            raise GooseError(f"token ids must lie in 0..{self.vocab - 1}")
        taps = feature_taps(s.features)
        check_taps(taps, len(self.layers))
        p = c.length
        if p + n > self.capacity:
            raise GooseError(f"the sequence needs {p + n} cache entries; this GPUForward holds {self.capacity} per "
                             f"sequence (build it with a larger max_len)")
        if s.allowed is None:
            depths, allowed = torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril_()
            anc = torch.arange(n).expand(n, n) * allowed  # row i: 0, 1, ..., i
        else:
            depths, allowed = s.depths.to("cpu", torch.long), s.allowed.to("cpu", torch.bool)
            anc = ancestor_table(allowed, depths) if self.fixed is not None else torch.zeros(n, n, dtype=torch.long)
        base = c.slot * self.capacity
        # (a fused head's taps run eagerly: the graphs return the final state only)
        b = self.runner.bucket(n, p, self.capacity) if self.runner is not None and not taps else None
        if b is not None:
            logits, hidden = self.runner.run(b, base, p, list(s.tokens), depths, allowed, anc)
            rows = slice(n - s.keep_last, n) if s.keep_last else slice(0, n)
            out = logits[rows].clone()
            if s.features:
                s.hidden = hidden[:n].clone()
        else:
            dev = self.device
            ints = torch.tensor([base, p] + list(s.tokens), dtype=torch.long).to(dev)
            meta, ids = ints[:2], ints[2:]
            keep = s.keep_last if s.keep_last else None
            tapped = []
            out, hidden = self._compute(ids, depths.to(dev), allowed.to(dev), anc.to(dev), meta, (base, p), keep,
                                        taps, tapped)
            if s.features:
                s.hidden = with_taps(hidden, tapped)
        c.appended(p, n)
        return out

    def _stage_scratch(self, static: _Static) -> None:
        """A capture's staged call: rows of a chain on the scratch slot (what it writes there is never read)."""
        B = static.rows
        allowed = torch.ones(B, B, dtype=torch.bool).tril_()
        static.fill(self.slots * self.capacity, 0, [0] * B, torch.arange(B), allowed,
                    torch.arange(B).expand(B, B) * allowed)

    def _graph_step(self, st: _Static) -> tuple[torch.Tensor, torch.Tensor]:
        """A bucket's whole call from its static buffers (what the graph captures): logits and hidden of all rows."""
        return self._compute(st.ids, st.depths, st.allowed, st.anc, st.meta, None, None)

    def _compute(self, ids, depths, allowed, anc, meta, host: tuple[int, int] | None, keep_last: int | None,
                 taps: tuple[int, ...] = (), tapped: list | None = None):
        """The call's logits and final hidden rows. `host`: (first slot row, P) known on the host (an eager call:
        attention reads only the filled entries), or None (a graph: attention reads the whole slot, masked).
        `taps`: the residual stream after those layers is appended to `tapped`."""
        B = ids.shape[0]
        C, K, D = self.capacity, self.n_kv, self.head_dim
        x = self.embed.index_select(0, ids)  # [B, hid]
        pos = meta[1] + depths  # [B]
        cos, sin = self.cos.index_select(0, pos)[:, None], self.sin.index_select(0, pos)[:, None]  # [B, 1, D]
        entries = meta[0] + meta[1] + torch.arange(B, device=ids.device)  # [B] flat cache rows written
        if self.fixed is None:
            if host is None:
                mask = graph_mask(allowed, meta[1], C)  # [B, C]
            else:
                mask = torch.cat([torch.ones(B, host[1], dtype=torch.bool, device=ids.device), allowed], 1)
            mask = mask.repeat(self.group, 1)[None, None]  # [1, 1, G*B, ctx]: rows grouped like the queries
        for li, L in enumerate(self.layers):
            h = self._rms(x, L.ln1, L.eps1)
            qkv = self._linear(h, L.qkv, L.qkv_b)  # [B, (H + 2K) D]
            q = qkv[:, : self.n_heads * D].view(B, self.n_heads, D)
            k = qkv[:, self.n_heads * D : (self.n_heads + K) * D].view(B, K, D)
            v = qkv[:, (self.n_heads + K) * D :].view(B, K, D)
            if L.qk_norm is not None:
                qw, qe, kw, ke = L.qk_norm
                q, k = self._rms(q, qw, qe), self._rms(k, kw, ke)
            q = q * cos + torch.roll(q, D // 2, -1) * sin  # RoPE
            k = k * cos + torch.roll(k, D // 2, -1) * sin
            kf = self.kv[li, 0].view(-1, K, D)  # [(S + 1) C, K, D]
            vf = self.kv[li, 1].view(-1, K, D)
            kf.index_copy_(0, entries, k.to(self.dtype))
            vf.index_copy_(0, entries, v.to(self.dtype))
            if self.fixed is not None:
                a = self.fixed.attention(q, kf, vf, meta, depths, anc, self.scale).view(B, -1)
            else:
                a = self._sdpa(q, kf, vf, meta, host, mask)
            x = x + self._linear(a, L.o, L.o_b)
            h = self._rms(x, L.ln2, L.eps2)
            gu = self._linear(h, L.gu, L.gu_b)
            x = x + self._linear(self._act(gu), L.down, L.down_b)
            if li in taps:
                tapped.append(x)
        hidden = self._rms(x, self.norm, self.norm_eps)
        rows = hidden if keep_last is None else hidden[B - keep_last :]
        if self.fixed is not None:
            logits = self.fixed.linear(rows, self.lm_head, self.lm_head_b, out_dtype=torch.float32)
        else:
            logits = F.linear(rows, self.lm_head, self.lm_head_b)
        return logits, hidden

    def _sdpa(self, q, kf, vf, meta, host, mask) -> torch.Tensor:
        """PyTorch's attention over the slot: q [B, H, D] -> [B, H * D]; the G query heads of a KV head stacked
        along the rows, so the call is one multi-head SDPA over the K KV heads."""
        B, H, D = q.shape
        K, G, C = self.n_kv, self.group, self.capacity
        if host is None:  # a graph: the slot read through its device index, all C entries (masked)
            idx = meta[0] + torch.arange(C, device=q.device)
            keys, vals = kf.index_select(0, idx), vf.index_select(0, idx)  # [C, K, D]
        else:
            keys = kf[host[0] : host[0] + host[1] + B]  # [P + B, K, D]
            vals = vf[host[0] : host[0] + host[1] + B]
        qg = q.view(B, K, G, D).permute(1, 2, 0, 3).reshape(1, K, G * B, D)
        o = F.scaled_dot_product_attention(qg, keys.transpose(0, 1)[None], vals.transpose(0, 1)[None],
                                           attn_mask=mask, scale=self.scale)  # [1, K, G*B, D]
        return o.view(K, G, B, D).permute(2, 0, 1, 3).reshape(B, H * D)

    def _linear(self, x, w, b) -> torch.Tensor:
        if self.fixed is not None:
            return self.fixed.linear(x, w, b)
        return F.linear(x, w, b)

    def _rms(self, x, w, eps) -> torch.Tensor:
        if self.fixed is not None:
            return self.fixed.rms_norm(x, w, eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    def _act(self, gu) -> torch.Tensor:
        if self.fixed is not None:
            return self.fixed.silu_mul(gu)
        half = gu.shape[-1] // 2
        return F.silu(gu[:, :half]) * gu[:, half:]


class GPUCache(KVCache):
    """One sequence's slot of a `GPUForward`'s static cache: entries ``kv[:, :, slot, :length]``."""

    def __init__(self, forward: GPUForward, slot: int) -> None:
        self.forward, self.slot = forward, slot
        self._len = 0
        self._prefix = 0  # length before the last call

    @property
    def length(self) -> int:
        return self._len

    def expect(self, total: int) -> None:
        if total > self.forward.capacity:
            raise GooseError(f"a request needing {total} cache entries (prompt, new tokens and a step's tree) does "
                             f"not fit this GPUForward's {self.forward.capacity}: build it with a larger max_len")

    def reset(self) -> None:
        self._len = self._prefix = 0

    def appended(self, prefix: int, n: int) -> None:
        self._prefix, self._len = prefix, prefix + n

    def keep(self, path: list[int]) -> None:
        """Keep the prefix and the nodes `path` of the last call (in that order); drop the rest (on the device)."""
        p, m = self._prefix, len(path)
        if path != list(range(m)):
            kv = self.forward.kv
            with torch.inference_mode():
                src = torch.tensor(path, dtype=torch.long).to(kv.device) + p  # [m]
                kv[:, :, self.slot, p : p + m] = kv[:, :, self.slot].index_select(2, src)  # [L, 2, m, K, D]
        self._len = p + m
