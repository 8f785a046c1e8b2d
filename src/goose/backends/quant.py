"""GGUF weights kept as they are: goose's quantized-block kernels (``quant_kernels.cpp``).

A GGUF file stores most weight matrices as blocks of small integers with half-float scales (Q8_0, Q4_0,
Q4_1, Q4_K, Q6_K here). `goose.loading.gguf.use_gguf_weights` packs each such tensor once into goose's panel layout (one
copy: the float32 weight it replaces is released) and swaps the model's `nn.Linear` / `nn.Embedding`
modules for `PackedLinear` / `PackedEmbedding` (`goose.backends.packed`), which multiply with the blocks
directly: a step reads the quantized bytes (~98 MB for SmolLM2's Q4_1 file) instead of 538 MB of float32.

What is guaranteed (tests check each point):

* Same weights. Every weight the kernel multiplies is bit for bit the float32 value gguf's own
  dequantization gives (the one transformers loads): all products of these formats are exact in float32,
  and the kernel rounds the final add once, as numpy does.
* Same logits as the float32 model on goose's float32 kernel. Each output is one FMA chain over k in order,
  then bias, then the residual add, exactly as ``cpu_kernels.cpp``'s ``goose_linear``; so `LeanForward` on
  the GGUF weights gives logits bit-identical to `LeanForward` on the dequantized float32 model with goose's
  kernels, and therefore the same tokens with every method (no near-tie can flip). Against other float32
  kernels (PyTorch's, HF's forward) the usual float32 summation-order rounding separates them.
* Row independence: a row's result does not depend on how many rows are computed with it, on the tile it
  falls in, on the thread count, or on the instruction-set variant (AVX-512 and AVX2 give the same bits).

Kernel variants, chosen from the CPU flags (``/proc/cpuinfo``), in this fallback order: ``avx512``
(AVX-512 F/BW/VL + FMA + F16C), ``avx2`` (AVX2 + FMA + F16C), none (the GGUF is used dequantized to float32,
with a one-line notice). The source is compiled once per variant and machine into
``$XDG_CACHE_HOME/goose/kernels/``, like ``cpu_kernels.cpp`` (`goose.backends.cpukernel`), and shares torch's OpenMP
threads. ``GOOSE_CPU_KERNEL=0`` switches these kernels off too.

The embedding and the output head: a quantized ``token_embd`` stays quantized; a lookup dequantizes just the
requested rows (`PackedEmbedding`); a tied output head multiplies with the same blocks (one copy). Tensors of
other types (F32 norms, F16, other quantizations) stay float32 as transformers loaded them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from ..errors import GooseError
from . import cpukernel
from .packed import PackedWeight

SOURCE = Path(__file__).with_name("quant_kernels.cpp")
ABI = 1
PANEL = 16  # output columns per panel (kCols in the source)
ORDER = cpukernel.ORDER  # the variants (cpukernel.VARIANTS), best first
# GGUF type name -> (code in the source, weights per GGUF block, bytes per GGUF block)
FORMATS = {"Q8_0": (0, 32, 34), "Q4_0": (1, 32, 18), "Q4_1": (2, 32, 20), "Q4_K": (3, 256, 144),
           "Q6_K": (4, 256, 210)}
_NAMES = {code: name for name, (code, _, _) in FORMATS.items()}

class QuantKernels:
    """One loaded variant: `pack` GGUF rows once, `linear` any number of rows, `rows` of the weight."""

    def __init__(self, lib: ctypes.CDLL, path: Path, variant: str) -> None:
        self.path, self.variant = path, variant
        self.isa = lib.goose_quant_isa()
        self._bytes = lib.goose_quant_packed_bytes
        self._bytes.restype = ctypes.c_int64
        self._bytes.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        self._pack = lib.goose_quant_pack
        self._pack.restype = ctypes.c_int
        self._pack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self._rows = lib.goose_quant_rows
        self._rows.restype = None
        self._rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_void_p]
        self._fn = lib.goose_quant_linear
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                             ctypes.c_int, ctypes.c_int]

    def op(self, packed: "QuantWeight", n: int, bias: torch.Tensor | None):
        """A projection of a `CpuKernels.layer_plan`: `linear` against this packed weight (checked here once)."""
        self._check_weight(packed, n)
        return cpukernel.PlanOp(ctypes.cast(self._fn, ctypes.c_void_p).value, FORMATS[packed.fmt][0], packed.data, n,
                                packed.k, bias)

    def _check_weight(self, packed: "QuantWeight", n: int) -> None:
        """`packed` is a whole packed QuantWeight of `n` rows."""
        if not isinstance(packed, QuantWeight):
            raise TypeError("packed must be a QuantWeight")
        if n != packed.n:
            raise ValueError(f"n = {n}, the weight has {packed.n} rows")
        if packed.data.numel() != self.packed_bytes(packed.fmt, packed.n, packed.k) or not packed.data.is_contiguous():
            raise ValueError("the packed weight has the wrong size")

    def packed_bytes(self, fmt: str, n: int, k: int) -> int:
        return int(self._bytes(FORMATS[fmt][0], n, k))

    def pack(self, fmt: str, rows: list[np.ndarray], k: int) -> "QuantWeight":
        """GGUF rows (each a uint8 array of one row's blocks, K weights) -> a packed ``[len(rows), K]`` weight."""
        if fmt not in FORMATS:
            raise GooseError(f"no quantized kernel for {fmt}; formats: {', '.join(FORMATS)}")
        code, block, bbytes = FORMATS[fmt]
        n = len(rows)
        size = self.packed_bytes(fmt, n, k) if n else 0
        if size <= 0:
            raise GooseError(f"{fmt}: a [{n}, {k}] weight is not a whole number of {block}-weight blocks")
        want = k // block * bbytes
        for r in rows:  # sizes checked before C++ reads a byte
            if r.dtype != np.uint8 or r.ndim != 1 or r.nbytes != want or not r.flags.c_contiguous:
                raise GooseError(f"{fmt}: a row of {k} weights must be {want} contiguous bytes, got {r.nbytes}")
        ptrs = np.array([r.ctypes.data for r in rows], dtype=np.uint64)
        data = torch.empty(size, dtype=torch.uint8)
        if self._pack(code, ptrs.ctypes.data, n, k, data.data_ptr()) != 0:
            raise GooseError(f"{fmt}: packing failed")
        return QuantWeight(self, fmt, n, k, data)

    def rows(self, weight: "QuantWeight", ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized weight: float32 ``[*ids.shape, K]`` (`PackedWeight.rows`)."""
        return weight.rows(ids)

    def gather(self, weight: "QuantWeight", flat: torch.Tensor) -> torch.Tensor:
        """Rows `flat` (int64, contiguous, each checked to be in range) of the dequantized weight:
        float32 ``[len(flat), K]``."""
        out = torch.empty(flat.numel(), weight.k, dtype=torch.float32)
        if flat.numel():
            self._rows(FORMATS[weight.fmt][0], weight.data.data_ptr(), weight.n, weight.k, flat.data_ptr(),
                       flat.numel(), out.data_ptr())
        return out

    def linear(self, x: torch.Tensor, packed: "QuantWeight", n: int, bias: torch.Tensor | None = None, *,
               norm: tuple[torch.Tensor, float] | None = None, gated: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``in(x) [M, K]`` times the packed ``[N, K]`` weight, plus bias: ``[M, N]`` (float32, CPU); the call
        shape of `CpuKernels.linear` (see there for `norm`, `gated`, `out`). `bias` is padded to a whole
        number of 16-column panels (`CpuKernels.pack_bias`)."""
        self._check_weight(packed, n)
        return run_linear(self._fn, x, packed, n, bias, norm, gated, out)


LIBRARY = cpukernel.KernelLibrary(SOURCE, "goose_quant", ABI, QuantKernels, cpukernel.VARIANTS, cpukernel.ORDER,
                                  cpukernel.BASE_FLAGS)
runnable_variants = LIBRARY.runnable_variants  # the variants this CPU can run, best first (as cpukernel's)
kernels = LIBRARY.kernels  # the loaded kernels of a variant (None: the best), or None (see unavailable_reason)
unavailable_reason = LIBRARY.unavailable_reason  # why kernels(variant) is None here (None when available)
_load = LIBRARY.load  # (uncached)


def run_linear(fn, x: torch.Tensor, weight: "QuantWeight", n: int, bias: torch.Tensor | None,
               norm: tuple[torch.Tensor, float] | None, gated: bool, out: torch.Tensor | None) -> torch.Tensor:
    """Check the arguments of a quantized linear (`QuantKernels.linear`, `Int8Kernels.linear`: one call shape
    for both arithmetics) and call the kernel `fn` on them; `weight` is already checked against `n`."""
    k_in = weight.k
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError("x must be a float32 CPU [M, K] tensor")
    x = x.contiguous()
    m, k = x.shape
    if k != (2 * k_in if gated else k_in):
        raise ValueError(f"input has {k} features, the weight {k_in}" + (" (x2 when gated)" if gated else ""))
    if norm is not None and (gated or tuple(norm[0].shape) != (k_in,) or norm[0].dtype != torch.float32):
        raise ValueError("norm needs an ungated input and a float32 [K] weight")
    padded = -(-n // PANEL) * PANEL
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.numel() < padded
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 tensor of at least {padded} values (padded)")
    if out is None:
        y = torch.empty(m, n, dtype=torch.float32)
    elif tuple(out.shape) != (m, n) or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError(f"out must be a contiguous float32 [{m}, {n}] tensor")
    else:
        y = out
    if m == 0:
        return y
    nw, eps = (None, 0.0) if norm is None else (norm[0].contiguous(), float(norm[1]))
    fn(FORMATS[weight.fmt][0], x.data_ptr(), m, k_in, weight.data.data_ptr(), n,
       None if bias is None else bias.data_ptr(), y.data_ptr(), None if nw is None else nw.data_ptr(), eps,
       int(gated), int(out is not None))
    return y


# ---- the weight and the modules -------------------------------------------------------------------------

class QuantWeight(PackedWeight):
    """A packed quantized ``[n, k]`` weight (GGUF blocks in goose's panel layout; see `PackedWeight`)."""

    def _gather(self, flat: torch.Tensor) -> torch.Tensor:
        return self.kernels.gather(self, flat)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, **fused) -> torch.Tensor:
        return self.kernels.linear(x, self, self.n, bias, **fused)


def kernels_or_none() -> QuantKernels | None:
    """The best variant that loads here, or None (`kernels()`, under a name that reads beside a `kernels`
    argument)."""
    return kernels()


def format_name(code: int) -> str:
    return _NAMES[code]


def weights_kind(model) -> str:
    """What a model multiplies with, for reports: ``gguf (Q4_1, Q8_0)`` when it holds GGUF blocks (their
    formats), else its parameters' dtype (``float32``)."""
    fmts = sorted({m.weight.fmt for m in model.modules() if isinstance(getattr(m, "weight", None), QuantWeight)})
    if fmts:
        return f"gguf ({', '.join(fmts)})"
    return str(next(model.parameters()).dtype).removeprefix("torch.")
