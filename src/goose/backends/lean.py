"""A lean, fast forward for the Llama family (llama, mistral, qwen2, qwen3): same interface as `HFForward`.

Why: on a small CPU the Hugging Face forward costs ~3x the weight-reading floor, mostly per-op Python
overhead and MKL's slow small-M `F.linear` (ENGINEERING.md, "How close a forward can get to the floor").
`LeanForward` runs the same network straight from the HF modules' weights, with:

* fused weights: one QKV projection ``[(H + 2K) * D, hidden]`` and one gate/up projection ``[2I, hidden]``
  per layer (biases, when present, are fused alongside: qwen2's q/k/v bias, llama's attention/mlp bias);
  qwen3's per-head q/k RMSNorms run on the fused output, before RoPE, as in HF;
* float32 on an x86-64 CPU with AVX2: every projection on goose's own kernel (`cpukernel`,
  ``cpu_kernels.cpp``), which reads each weight once per call whatever the number of tokens and fuses the
  RMSNorm before QKV / gate-up / the output projection, silu(gate) * up before the down projection, and
  the residual adds after the o / down projections (one packed copy of the weights); and each layer's
  attention in one call of its attention kernel (rotary embedding, cache write, scores, softmax, weighted
  sum; head dims that are a multiple of 8), where PyTorch needs ~15 small operations; and then all decoder
  layers run in one kernel call per forward (`plan`, `CpuKernels.layer_plan`: the same kernel calls, made
  from C++, so the same bits; 1.3 -> 0.5 ms of Python per forward), except qwen3's (its q/k norms run here);
* otherwise (``kernel=False``, or the kernel unavailable) PyTorch's kernels: oneDNN-prepacked float32
  weights (``torch.ops.mkldnn._reorder_linear_weight`` once, then ``_linear_pointwise``) for calls of
  several tokens, a private API, so anything else (other dtypes, other devices, the op missing) falls back
  to `F.linear` with the plain weights; and for single-token calls a second copy of each weight stored
  transposed, ``[in, out]`` (MKL's ``x @ W^T`` over that layout streams ~1.5-2x faster than oneDNN at one
  row; it doubles the weight memory: pass ``gemv=False`` for large models);
* one preallocated KV tensor for all layers, ``[layers, 2, K, capacity, D]``, grown by doubling: a call
  writes its keys/values in place, and `keep` moves only the accepted entries with one `index_select`
  over all layers (nothing moves when the accepted path is already in place);
* per call, everything shared by the layers is computed once: RoPE cos/sin from the model's own
  ``model.model.rotary_emb`` (so every rope variant HF implements is right), and the additive mask. Where
  a position's cos/sin cannot depend on anything else (`_RopeTable`), they are computed once per position,
  by the same module, and read from a table afterwards;
* grouped-query attention without expanding the KV heads: the G = H / K query heads that share a KV head
  are stacked along the query axis, so attention is two batched matmuls over the K KV heads::

      q   [n, H, D] -> [K, G * n, D]          (row g * n + i: query head k * G + g, token i)
      s = q @ k^T     [K, G * n, P + n]        (+ mask [G * n, P + n], broadcast over K)
      o = softmax(s) @ v  [K, G * n, D] -> [n, H * D]

  A single token (n == 1) needs no mask; causal runs and trees share one additive float mask per call.

Numerics follow the HF modules: RMSNorm is computed in float32 and cast back (as HF does for every
dtype), rotary tables come from HF's module in the model's dtype, attention softmax runs in the model's
dtype. Logits match `HFForward` to float rounding (float64: ~1e-12).

Semantics (identical to `HFForward`): a call appends n tokens after the P cached ones. Without `allowed`
they are a causal run at positions P..P+n-1; with `allowed` (``[n, n]`` bool, allowed[i, j] iff j is i
or an ancestor of i) and `depths` (``[n]``) they form a tree, node i at position P + depths[i], seeing
the P prefix entries and its allowed tree nodes. `keep(path)` keeps the prefix and the nodes `path` of
the last call, in that order.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import GooseError
from ..names import ARITHS  # LeanForward's arithmetics (see its `arith`)
from ..protocols import Forward, KVCache, Segment, check_taps, feature_taps, with_taps
from . import cpukernel, int8
from .cpukernel import CpuKernels
from .forward import active_sliding_window, weights_fingerprint
from .packed import PackedEmbedding, PackedLinear, PackedWeight, PanelWeight
from .packed import cat as _cat_packed
from .quant import QuantWeight

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
INITIAL_CAPACITY = 512  # cache slots per layer before the first doubling


def _mkldnn_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return (torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def unsupported_reason(model) -> str | None:
    """Why `LeanForward` cannot run `model` exactly, or None when it can."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_TYPES:
        return f"model type '{mtype}' is not one of {', '.join(SUPPORTED_TYPES)}"
    base = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            return f"model.model has no '{name}'"
    if (type(getattr(model, "lm_head", None)) not in (nn.Linear, PackedLinear)
            or type(base.embed_tokens) not in (nn.Embedding, PackedEmbedding)):
        return "lm_head / embed_tokens are not plain nn.Linear / nn.Embedding"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation '{getattr(cfg, 'hidden_act', None)}' is not silu"
    window = active_sliding_window(cfg)
    if window is not None:
        return f"sliding-window attention ({window} tokens) is not implemented"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1 is not implemented"
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        return "query heads are not a multiple of KV heads"
    for norm in [base.norm] + [m for layer in base.layers
                               for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
        if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
            return f"norm {type(norm).__name__} is not an RMSNorm"
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        names = {n for n, _ in attn.named_children()}
        if names not in ({"q_proj", "k_proj", "v_proj", "o_proj"}, {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "q_norm", "k_norm"}):
            return f"attention has extra/missing parts: {sorted(names)}"
        for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
            if norm is not None and (not type(norm).__name__.endswith("RMSNorm")
                                     or not hasattr(norm, "variance_epsilon")
                                     or tuple(norm.weight.shape) != (attn.head_dim,)):
                return f"q/k norm {type(norm).__name__} is not a per-head RMSNorm"
        if {n for n, _ in mlp.named_children()} != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
            return "MLP is not gate/up/down"
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(m) not in (nn.Linear, PackedLinear) for m in linears):
            return "projections are not plain nn.Linear (quantized?)"
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention layers are not implemented"
    head_dim = base.layers[0].self_attn.head_dim
    try:
        w = base.embed_tokens.weight
        with torch.no_grad():
            cos, _ = base.rotary_emb(w[:1], torch.zeros(1, 1, dtype=torch.long, device=w.device))
    except Exception as exc:  # any rope module failure means we cannot reuse it
        return f"rotary embedding cannot be called with position ids: {exc}"
    if cos.shape[-1] != head_dim:
        return f"partial rotary embeddings (dim {cos.shape[-1]} != head_dim {head_dim}) are not implemented"
    return None


def supports(model) -> bool:
    """True when `LeanForward` can run `model` (llama / mistral / qwen2 / qwen3 structure, no sliding window)."""
    return unsupported_reason(model) is None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalize in float32, cast back, scale by the weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


ROPE_BLOCK = 256  # positions per call of the rotary module when `_RopeTable` grows
ROPE_TABLE_MAX = 16384  # positions `_RopeTable` holds at most (beyond: the module per forward)


def _rotary_rows(rotary, dtype: torch.dtype, device, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[n, D]`` (in `dtype`) of the model's rotary module for `positions` ``[n]`` (it reads only
    the dtype and device of the tensor it is given)."""
    cos, sin = rotary(torch.zeros(1, dtype=dtype, device=device), positions.to(device)[None])
    return cos[0], sin[0]


class _RopeTable:
    """cos and sin ``[positions, D]`` of the model's own rotary module, computed once per position.

    Used only where a position's values depend on the position alone: a rope type that does not rescale
    with the sequence (not "dynamic", not "longrope") and a head size whose rows PyTorch computes with
    the same vector code whatever a call's shape (D a multiple of 32: no row falls in an elementwise loop's
    scalar tail). `make` checks the bits once against calls of one and of several positions and gives None
    on any difference. Saves the module's half a dozen small tensor operations per forward (about 0.1 ms
    each forward on a 2-core CPU, where those operations run with cold caches after the kernels)."""

    def __init__(self, rotary, dtype: torch.dtype, device) -> None:
        self.rotary, self.dtype, self.device = rotary, dtype, device
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin), replaced whole when it grows

    @property
    def cos(self) -> torch.Tensor:
        return self.table[0]

    @property
    def sin(self) -> torch.Tensor:
        return self.table[1]

    @classmethod
    def make(cls, rotary, dtype: torch.dtype, device, head_dim: int) -> "_RopeTable | None":
        rope_type = getattr(rotary, "rope_type", None)
        if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope" or head_dim % 32:
            return None
        table = cls(rotary, dtype, device)
        probe = [0, 1, 37, ROPE_BLOCK - 1, ROPE_BLOCK, 2 * ROPE_BLOCK + 5]
        if not table.grow(probe[-1] + 1):
            return None
        for ps in [[p] for p in probe] + [probe[1:4]]:
            cos, sin = table.module(torch.tensor(ps))
            if not (torch.equal(cos, table.cos[ps]) and torch.equal(sin, table.sin[ps])):
                return None
        return table

    def module(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's own cos, sin ``[n, D]`` for `positions` ``[n]``."""
        return _rotary_rows(self.rotary, self.dtype, self.device, positions)

    def grow(self, upto: int) -> bool:
        """Hold positions 0..upto-1 (whole blocks of ROPE_BLOCK); False past ROPE_TABLE_MAX."""
        have = 0 if self.table is None else self.table[0].shape[0]
        if upto <= have:
            return True
        if upto > ROPE_TABLE_MAX:
            return False
        want = min(ROPE_TABLE_MAX, max(2 * have, -(-upto // ROPE_BLOCK) * ROPE_BLOCK))
        parts = [self.module(torch.arange(a, a + ROPE_BLOCK)) for a in range(have, want, ROPE_BLOCK)]
        old = [] if self.table is None else [self.table]
        self.table = (torch.cat([t[0] for t in old + parts]), torch.cat([t[1] for t in old + parts]))
        return True


class _Linear:
    """y = x W^T + b with the fastest kernel available for float32 on this CPU:

    * goose's own kernel (`cpukernel`, AVX2): W packed in 16-column panels, every row count;
    * otherwise a oneDNN-prepacked W for several rows, and W^T stored [in, out] for a single row (MKL's
      gemv over that layout is ~2x faster than oneDNN at M = 1);
    * otherwise `F.linear` with the plain weight."""

    __slots__ = ("weight", "bias", "packed", "wt", "kernel", "out")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool, gemv: bool,
                 kernel: CpuKernels | None = None) -> None:
        if isinstance(weight, PackedWeight):  # packed once at load (`goose.backends.packed`): adopted, no copy
            self.kernel, self.packed, self.out = weight.kernels, weight.operand, weight.n
            self.bias = CpuKernels.pack_bias(bias, self.out)
            self.weight = self.wt = None
            return
        self.weight = weight.detach().contiguous()  # [out, in]
        self.bias = None if bias is None else bias.detach().contiguous()  # [out]
        self.out = self.weight.shape[0]
        self.packed = self.wt = None
        self.kernel = kernel
        if kernel is not None:
            self.packed = kernel.pack(self.weight)  # [out / 16, in, 16]
            self.bias = kernel.pack_bias(self.bias, self.out)
            self.weight = None
            return
        if gemv:
            self.wt = self.weight.t().contiguous()  # [in, out]
        if prepack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
            self.weight = None  # the packed copy replaces it (tied lm_head keeps the embedding alive)

    def __call__(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, gated: bool = False,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``in(x) W^T + b`` (``[n, out]``), where in(x) is x, its RMSNorm (``norm=(weight, eps)``) or, with
        `gated`, ``silu(x[:, :I]) * x[:, I:]``; with `out`, the result is added to `out` in place."""
        if self.kernel is not None:  # all fused into one call
            return self.kernel.linear(x, self.packed, self.out, self.bias, norm=norm, gated=gated, out=out)
        if norm is not None:
            x = _rms(x, *norm)
        elif gated:
            half = x.shape[1] // 2
            x = F.silu(x[:, :half]) * x[:, half:]
        y = self._mul(x)
        return y if out is None else out.add_(y)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as held here (the largest of its held forms; a forward reads one of them whole)."""
        held = [t.data if isinstance(t, PackedWeight) else t for t in (self.packed, self.wt, self.weight)]
        return max((t.numel() * t.element_size() for t in held if t is not None), default=0)

    def op(self):
        """This projection as a step of goose's layer plan (`CpuKernels.layer_plan`), or None (PyTorch's kernels)."""
        return None if self.kernel is None else self.kernel.op(self.packed, self.out, self.bias)

    def _mul(self, x: torch.Tensor) -> torch.Tensor:  # x [n, in] contiguous -> [n, out]
        if self.wt is not None and x.shape[0] == 1:
            return torch.mm(x, self.wt) if self.bias is None else torch.addmm(self.bias, x, self.wt)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _cat_weights(linears: list[nn.Linear]) -> torch.Tensor | PackedWeight:
    """The fused weight of `linears` (packed ones fused in place: one copy of their data)."""
    weights = [m.weight.detach() for m in linears]
    if all(isinstance(w, PackedWeight) for w in weights):
        try:
            return _cat_packed(weights)
        except GooseError:  # mixed kinds or row counts that cannot share panels
            pass
    return torch.cat([w.dequantize() if isinstance(w, PackedWeight) else w for w in weights])


def _cat_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                      for m in linears])


class _Layer:
    """One decoder layer's weights, fused and (maybe) prepacked."""

    __slots__ = ("ln1", "eps1", "qkv", "o", "ln2", "eps2", "gate_up", "down", "qk_norm")

    def __init__(self, layer, prepack: bool, gemv: bool, kernel: CpuKernels | None) -> None:
        a, m = layer.self_attn, layer.mlp
        self.ln1, self.eps1 = layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon
        post = layer.post_attention_layernorm
        self.ln2, self.eps2 = post.weight.detach(), post.variance_epsilon
        qkv = [a.q_proj, a.k_proj, a.v_proj]
        self.qkv = _Linear(_cat_weights(qkv), _cat_bias(qkv), prepack, gemv, kernel)  # [(H+2K)D, hid]
        self.o = _Linear(a.o_proj.weight, a.o_proj.bias, prepack, gemv, kernel)  # [hid, H*D]
        gu = [m.gate_proj, m.up_proj]
        self.gate_up = _Linear(_cat_weights(gu), _cat_bias(gu), prepack, gemv, kernel)  # [2I, hid]
        self.down = _Linear(m.down_proj.weight, m.down_proj.bias, prepack, gemv, kernel)  # [hid, I]
        self.qk_norm = None  # qwen3: (q weight [D], q eps, k weight [D], k eps)
        if hasattr(a, "q_norm"):
            self.qk_norm = (a.q_norm.weight.detach(), a.q_norm.variance_epsilon,
                            a.k_norm.weight.detach(), a.k_norm.variance_epsilon)


class LeanForward(Forward):
    """Fast forward for llama / mistral / qwen2 / qwen3 models with a static in-place KV cache (see module doc)."""

    def __init__(self, model, *, kernel: bool | None = None, attention_kernel: bool = True,
                 prepack: bool | None = None, gemv: bool | None = None, arith: str = "exact") -> None:
        """`kernel`: None = goose's own AVX2 kernels when they are available here (float32 on an x86-64
        CPU, see `cpukernel`); True = require them; False = PyTorch's kernels, as follows.
        `attention_kernel`: with goose's kernels, also run attention on goose's kernel (head dims that are a
        multiple of 8); False = PyTorch's attention with goose's linear kernel (for comparisons).
        `prepack`: None = oneDNN prepacked weights when available (float32, CPU); False = `F.linear`.
        `gemv`: also keep W^T for single-row calls (None = when prepacked; doubles the weight memory).
        `arith`: "exact" (the float32 products of the weights' values) or "int8": the projections and output
        head over GGUF blocks multiply 8-bit activations in integers (`goose.backends.int8`; float32 weights
        are refused, never quantized here). Each is lossless against plain greedy decoding in the same arith."""
        if arith not in ARITHS:
            raise GooseError(f"unknown arith '{arith}'; choose one of: {', '.join(ARITHS)}")
        reason = unsupported_reason(model)
        if reason is not None:
            raise GooseError(f"LeanForward does not support this model: {reason}; use HFForward")
        cfg, base = model.config, model.model
        self._model = weakref.ref(model)  # (a weak reference: a per-model registry may hold this forward)
        w = base.embed_tokens.weight
        self.device, self.dtype = w.device, w.dtype
        cpu_fp32 = self.device.type == "cpu" and self.dtype == torch.float32
        kern = None
        if kernel and (prepack or gemv):
            raise GooseError("prepack / gemv select PyTorch's kernels: they cannot be combined with kernel=True")
        if kernel or (kernel is None and not prepack and not gemv):
            why = "it needs float32 weights on CPU" if not cpu_fp32 else cpukernel.unavailable_reason()
            if why is None:
                kern = cpukernel.kernel()
            elif kernel:
                raise GooseError(f"goose's CPU kernel cannot be used: {why}")
        can_pack = kern is None and _mkldnn_available() and cpu_fp32
        if prepack and not can_pack:
            raise GooseError("oneDNN prepacking needs float32 weights on CPU and torch's mkldnn ops")
        self.prepacked = can_pack if prepack is None else bool(prepack)
        self.gemv = self.prepacked if gemv is None else bool(gemv)
        attn = base.layers[0].self_attn
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads  # H, K
        self.head_dim = attn.head_dim  # D
        self.group = self.n_heads // self.n_kv  # G
        self.scale = attn.scaling
        self.rotary = base.rotary_emb
        self.rope = _RopeTable.make(self.rotary, self.dtype, self.device, self.head_dim)  # None: the module per call
        self.embed = w.detach()  # [vocab, hid]
        panels = any(isinstance(m.weight, PanelWeight) for m in model.modules() if isinstance(m, PackedLinear))
        if kern is None and panels:
            raise GooseError("this model's weights are held as goose's float32 panels (load_model packs them), which "
                             "only goose's kernel multiplies; load it with pack=False for PyTorch's kernels")
        self.layers = [_Layer(layer, self.prepacked, self.gemv, kern) for layer in base.layers]
        self.norm, self.norm_eps = base.norm.weight.detach(), base.norm.variance_epsilon
        # [vocab, hid]
        self.lm_head = _Linear(model.lm_head.weight, model.lm_head.bias, self.prepacked, self.gemv, kern)
        # goose's attention kernel along with its linear kernel (head dims that are a multiple of 8)
        self.attn_kernel = kern if (kern is not None and attention_kernel
                                    and cpukernel.attention_reason(self.head_dim, self.dtype) is None) else None
        # which kernels run the weight multiplies and attention (part of the cost-curve cache key)
        self.backend = (f"goose-{kern.variant}" if kern is not None else "onednn" if self.prepacked else "torch") + (
            "+gemv" if self.gemv else "") + ("+attention" if self.attn_kernel is not None else "")
        self.arith = arith
        self.kv_dtype = self.dtype  # the KV cache's entries (`new_cache`)
        if arith == "int8":
            self._use_int8()
        quantized = sorted({lin.packed.fmt for L in self.layers for lin in (L.qkv, L.o, L.gate_up, L.down)
                            if isinstance(lin.packed, QuantWeight)})
        if quantized:  # GGUF blocks on goose's quantized kernels (`goose.backends.quant`)
            self.backend += f"+gguf-{'-'.join(quantized)}-{self.layers[0].qkv.kernel.variant}"
        # every layer in one kernel call per forward (goose's kernels for all of it; qwen3's q/k norms run in PyTorch)
        self.plan = self._layer_plan()
        self.cache = self.new_cache()  # the cache of the single-sequence API (reset / __call__ / keep)
        # the weights this forward copied, packed or adopted (taken after fusing: `cat` may re-point them)
        self.fingerprint = weights_fingerprint(model)

    def _use_int8(self) -> None:
        """Every projection over GGUF blocks (and the output head) on the integer kernels; all of them must be."""
        linears = [lin for L in self.layers for lin in (L.qkv, L.o, L.gate_up, L.down)] + [self.lm_head]
        if not all(isinstance(lin.packed, QuantWeight) for lin in linears):
            raise GooseError('arith="int8" needs every projection and the output head held as GGUF blocks '
                             "(a model loaded with --weights gguf); float32 weights are not quantized")
        ik = int8.kernels()
        if ik is None:
            raise GooseError(f"goose's integer kernels cannot run here: {int8.unavailable_reason()}")
        for lin in linears:
            lin.kernel = ik
        self.backend += f"+int8-{ik.variant}"
        if self.attn_kernel is not None:  # keys and values in bfloat16 (halves the cache's memory traffic)
            self.kv_dtype = torch.bfloat16
            self.backend += "+kv16"

    def _layer_plan(self) -> cpukernel.LayerPlan | None:
        if self.attn_kernel is None or any(L.qk_norm is not None for L in self.layers):
            return None
        entries = []
        for L in self.layers:
            ops = [lin.op() for lin in (L.qkv, L.o, L.gate_up, L.down)]
            if any(op is None for op in ops):
                return None
            entries.append((L.ln1.contiguous(), L.eps1, L.ln2.contiguous(), L.eps2, *ops))
        return self.attn_kernel.layer_plan(entries)

    # ---- caches ------------------------------------------------------------------------------------
    def new_cache(self) -> "LeanCache":
        """A KV cache of its own for one sequence (one per request: nothing is shared between caches)."""
        return LeanCache(len(self.layers), self.n_kv, self.head_dim, self.kv_dtype, self.device)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights every forward reads whole: each layer's projections and the output head (a cost
        measurement whose smallest forward reads them implausibly slowly is not cached: `measure.starved`)."""
        return sum(lin.nbytes for L in self.layers for lin in (L.qkv, L.o, L.gate_up, L.down)) + self.lm_head.nbytes

    def stale(self) -> bool:
        """True when the model's weights changed since they were packed here (an optimizer step,
        ``load_state_dict``, a merged adapter, a replaced parameter): this forward would decode old weights."""
        model = self._model()
        return model is None or weights_fingerprint(model) != self.fingerprint

    # ---- forward -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, segments: list[Segment]) -> list[torch.Tensor]:
        """One forward over several sequences, each appending its tokens to its own cache: the weight
        multiplies run once over all segments' rows (goose's kernels are row-independent, so every row's
        logits are bit-identical to a forward of its segment alone), attention runs per segment over its
        own prefix, positions and tree mask. Returns each segment's logits (``[n_s or keep_last_s, vocab]``)."""
        if not segments:
            return []
        if len({id(s.cache) for s in segments}) != len(segments):
            raise GooseError("a forward cannot append to one cache twice")
        dev = self.device
        spans, ids = [], []
        row = 0
        for s in segments:
            n = len(s.tokens)
            if n == 0:
                raise GooseError("no tokens to forward")
            c = s.cache
            if c.kv is None:
                c.reset()
            c.reserve(c.length + n)
            spans.append((row, row + n, c.length))
            row += n
            ids.extend(s.tokens)
        if isinstance(self.embed, PackedWeight):
            x = self.embed.rows_of(ids)  # [N, hid]
        else:
            x = F.embedding(torch.tensor(ids, dtype=torch.long, device=dev), self.embed)
        rope = self._rope_rows(segments, spans)  # per segment: cos, sin [n, D]
        if self.attn_kernel is not None:  # rotary, cache write and attention in one call per layer and segment
            attends = [self.attn_kernel.attention_step(self.n_heads, cos, sin, s.cache.kv, p, s.allowed, self.scale)
                       for s, (_, _, p), (cos, sin) in zip(segments, spans, rope)]
        else:
            attends = [self._torch_attention(s, cos, sin, p) for s, (_, _, p), (cos, sin) in zip(segments, spans, rope)]
        one = len(segments) == 1
        taps = sorted({t for s in segments for t in feature_taps(s.features)})  # layers a fused head reads
        check_taps(taps, len(self.layers))
        if self.plan is not None:  # all layers in one kernel call (one per stretch between taps)
            tapped = self.plan(x, self.attn_kernel.attention_batch(attends), tuple(taps))
        else:
            tapped = self._layer_by_layer(x, attends, spans, taps)
        rows = []  # hidden rows whose logits are wanted
        feats = None  # every row's final hidden state, when a segment wants its own (one norm call for all)
        for s, (a, b, p) in zip(segments, spans):
            s.cache.appended(p, b - a)
            rows.append((b - s.keep_last, b) if s.keep_last else (a, b))
            if s.features:  # (the norm is fused into the output head's kernel: computed here for these rows)
                if feats is None:
                    feats = _rms(x, self.norm, self.norm_eps)
                s.hidden = with_taps(feats[a:b], [tapped[taps.index(t)][a:b] for t in feature_taps(s.features)])
        if one:
            h = x[rows[0][0] : rows[0][1]]
        else:
            h = torch.cat([x[r0:r1] for r0, r1 in rows])
        logits = self.lm_head(h, norm=(self.norm, self.norm_eps))  # [rows, vocab]
        if one:
            return [logits]
        return list(logits.split([r1 - r0 for r0, r1 in rows]))

    def _rope_rows(self, segments: list[Segment], spans: list[tuple[int, int, int]]) -> list[tuple]:
        """Each segment's cos, sin ``[n, D]`` (model dtype): token i of a causal run at position P + i, tree node
        i at P + depths[i]; from the table where it holds them, else from one call of the rotary module."""
        top = max(p + b - a for a, b, p in spans)  # (a node's depth is below its segment's size)
        if self.rope is not None and self.rope.grow(top):
            cos_t, sin_t = self.rope.table  # (one read: a table that grows is replaced whole)
            out = []
            for s, (a, b, p) in zip(segments, spans):
                if s.allowed is None:
                    out.append((cos_t[p : p + b - a], sin_t[p : p + b - a]))
                else:
                    at = s.depths.cpu() + p
                    out.append((cos_t[at], sin_t[at]))
            return out
        pos = torch.cat([torch.arange(p, p + b - a) if s.allowed is None else s.depths.cpu() + p
                         for s, (a, b, p) in zip(segments, spans)])
        cos, sin = _rotary_rows(self.rotary, self.dtype, self.device, pos)
        return [(cos[a:b], sin[a:b]) for a, b, _ in spans]

    def _layer_by_layer(self, x: torch.Tensor, attends: list, spans: list[tuple[int, int, int]],
                        taps: list[int] = ()) -> list[torch.Tensor]:
        """The decoder layers on the residual stream ``x [N, hid]`` (in place), one call per projection and
        attention (where `plan` cannot run them: qwen3's q/k norms, PyTorch's kernels); a copy of ``x`` after
        each layer of `taps`."""
        tapped = []
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        one = len(attends) == 1
        batch = None if one or self.attn_kernel is None else self.attn_kernel.attention_batch(attends)
        for li, L in enumerate(self.layers):
            qkv = L.qkv(x, norm=(L.ln1, L.eps1))  # [N, (H + 2K) * D], of RMSNorm(x)
            if L.qk_norm is not None:  # qwen3: per-head q/k RMSNorm, before RoPE
                qw, qe, kw, ke = L.qk_norm
                qk = qkv[:, : (H + K) * D].view(-1, H + K, D)
                normed = torch.cat([_rms(qk[:, :H], qw, qe), _rms(qk[:, H:], kw, ke)], 1)
                qkv[:, : (H + K) * D] = normed.view(len(x), -1)
            if one:
                a = attends[0](li, qkv)  # [N, H*D]
            elif batch is not None:  # every segment's attention in one kernel call
                a = batch(li, qkv)
            else:
                a = torch.cat([att(li, qkv[r0:r1]) for att, (r0, r1, _) in zip(attends, spans)])  # [N, H*D]
            self._mlp(L, a, x)
            if li in taps:
                tapped.append(x.clone())
        return tapped

    def _torch_attention(self, seg: Segment, cos: torch.Tensor, sin: torch.Tensor, p: int):
        """PyTorch's attention for one segment: a function (layer, qkv [n, (H + 2K) D]) -> [n, H D]."""
        H, K, D, G = self.n_heads, self.n_kv, self.head_dim, self.group
        n, total, dev, dt = len(seg.tokens), p + len(seg.tokens), self.device, self.dtype
        half = D // 2
        cos = cos[:, None, :]  # [n, 1, D]
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi]
        sin = torch.cat([-sin[:, :half], sin[:, half:]], -1)[:, None, :]  # [n, 1, D]
        mask = None
        if n > 1:
            ok = torch.ones(n, total, dtype=torch.bool, device=dev)  # [n, P + n]
            ok[:, p:] = (seg.allowed.to(dev) if seg.allowed is not None
                         else torch.ones(n, n, dtype=torch.bool, device=dev).tril())
            mask = torch.zeros(n, total, dtype=dt, device=dev).masked_fill_(~ok, torch.finfo(dt).min)
            mask = mask.repeat(G, 1)  # [G * n, P + n]: rows grouped like the queries
        kv = seg.cache.kv

        def attend(li: int, qkv: torch.Tensor) -> torch.Tensor:
            qk = qkv[:, : (H + K) * D].view(n, H + K, D)  # [n, H + K, D]
            qk = torch.addcmul(qk * cos, torch.roll(qk, half, -1), sin)  # RoPE on q and k at once
            kv[li, 0, :, p:total] = qk[:, H:].transpose(0, 1)  # [K, n, D]
            kv[li, 1, :, p:total] = qkv[:, (H + K) * D :].view(n, K, D).transpose(0, 1)  # [K, n, D]
            keys = kv[li, 0, :, :total]  # [K, P + n, D]
            vals = kv[li, 1, :, :total]  # [K, P + n, D]
            if n == 1:
                q = qk[0, :H].view(K, G, D)  # [K, G, D]
            else:
                q = qk[:, :H].reshape(n, K, G, D).permute(1, 2, 0, 3).reshape(K, G * n, D)  # [K, G*n, D]
            if mask is None:
                s = torch.bmm(q, keys.transpose(1, 2)).mul_(self.scale)  # [K, G*n, P+n]
            else:
                s = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=self.scale)  # [K, G*n, P+n]
            a = torch.bmm(torch.softmax(s, -1), vals)  # [K, G*n, D]
            if n == 1:
                return a.view(1, H * D)  # [1, H*D]
            return a.view(K, G, n, D).permute(2, 0, 1, 3).reshape(n, H * D)  # [n, H*D]

        return attend

    @staticmethod
    def _mlp(L: _Layer, a: torch.Tensor, x: torch.Tensor) -> None:
        """The rest of a layer after attention `a [n, H*D]`: output projection and MLP, residuals into x."""
        L.o(a, out=x)  # x += o(a), in place
        gu = L.gate_up(x, norm=(L.ln2, L.eps2))  # [n, 2I], of RMSNorm(x)
        L.down(gu, gated=True, out=x)  # x += down(silu(gate) * up), in place


class LeanCache(KVCache):
    """One sequence's static KV cache ``[layers, 2, K, capacity, D]``, written in place and grown by doubling.

    A forward appends n entries after the P cached ones; `keep(path)` keeps the prefix and the nodes `path`
    of that call, in that order, moving only entries that are out of place (one `index_select` over all
    layers)."""

    def __init__(self, layers: int, n_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (layers, 2, n_kv, head_dim)
        self.dtype, self.device = dtype, device
        self.kv = None  # [layers, 2, K, capacity, D]
        self._len = 0  # filled cache entries
        self._prefix = 0  # cache length before the last call
        self._expected = 0  # entries the sequence is expected to need (`expect`)

    def expect(self, total: int) -> None:
        """The sequence will need about `total` entries (prompt + max_new_tokens + a step's tree): the cache is
        then allocated once with the capacity doubling would reach (512, 1024, 2048, ...) instead of growing
        step by step, which copies the cache and briefly holds both copies (a 1,000-token prompt: 512 -> 1024
        -> 2048 slots). The sizes stay the few powers of two, so a server's allocator reuses freed caches
        (sizes to the slot fragmented its heap: +40% resident memory over a 500-request soak). Growth past
        it still doubles."""
        cap = INITIAL_CAPACITY
        while cap < total:
            cap *= 2
        self._expected = cap

    @torch.inference_mode()
    def reset(self) -> None:
        if self.kv is None:
            L, two, K, D = self.shape
            cap = self._expected or INITIAL_CAPACITY
            self.kv = torch.empty(L, two, K, cap, D, dtype=self.dtype, device=self.device)
        self._len = 0
        self._prefix = 0

    @property
    def length(self) -> int:
        return self._len

    def reserve(self, total: int) -> None:
        cap = self.kv.shape[3]
        if total <= cap:
            return
        if self._expected >= total:
            cap = self._expected
        while cap < total:
            cap *= 2
        kv = self.kv.new_empty(*self.kv.shape[:3], cap, self.kv.shape[4])  # [L, 2, K, cap, D]
        kv[:, :, :, : self._len] = self.kv[:, :, :, : self._len]
        self.kv = kv

    def entries(self, start: int, end: int) -> torch.Tensor:
        """The cached keys and values of positions start..end-1: a view ``[layers, 2, K, end - start, D]``."""
        if not 0 <= start <= end <= self._len:
            raise GooseError(f"cache positions {start}..{end} are not all filled ({self._len} are)")
        return self.kv[:, :, :, start:end]

    @torch.inference_mode()
    def write_prefix(self, kv: torch.Tensor) -> None:
        """Make ``kv [layers, 2, K, n, D]`` (entries computed for the first n tokens of this sequence) the whole
        cache."""
        if self.kv is None:
            self.reset()
        shape = (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) if kv.dim() == 5 else None
        if shape != self.shape or kv.dtype != self.dtype:
            raise GooseError(f"cache entries of shape {list(kv.shape)} / {kv.dtype} do not fit this cache")
        n = kv.shape[3]
        self._len = 0
        self.reserve(n)
        self.kv[:, :, :, :n] = kv
        self._prefix = self._len = n

    def appended(self, prefix: int, n: int) -> None:
        """A forward wrote n entries after `prefix`."""
        self._prefix, self._len = prefix, prefix + n

    def keep(self, path: list[int]) -> None:
        """Keep the prefix and the nodes `path` of the last call (in that order); drop the rest."""
        p, m = self._prefix, len(path)
        if path != list(range(m)):  # move accepted entries down; the in-place prefix never moves
            with torch.inference_mode():
                src = torch.tensor(path, dtype=torch.long, device=self.device) + p  # [m]
                self.kv[:, :, :, p : p + m] = self.kv.index_select(3, src)  # [L, 2, K, m, D]
        self._len = p + m
