"""Integer arithmetic over GGUF weight blocks: goose's integer-dot kernels (``int8_kernels.cpp``).

The same packed weights as `goose.backends.quant` (a `QuantWeight`, formats Q8_0, Q4_0, Q4_1, Q4_K, Q6_K),
multiplied another way: each row of the input is quantized to 8-bit integers in blocks of 32 (one float32
scale per block, ``d = max|x| / 127``, ``q = rint(x / d)`` as ``rint(x * (1 / d))``), each weight group's
integer quants are multiplied with them exactly in int32 (``vpdpbusd`` on VNNI), and each output sums the
groups' scaled integer dot products in one fixed order (see the source for the exact float operations).

`LeanForward(model, arith="int8")` runs every projection and the output head on these kernels, and keeps its KV
caches in bfloat16 (`cpukernel.CpuKernels.attention_step`: each key and value rounded once when written, read
back as the float32 it denotes; half the cache's memory traffic): both are part of what "int8" means.

What is guaranteed (tests check each point):

* Row independence: a row's result depends on that row alone, not on how many rows are computed with it,
  their tile, the thread count or the variant: every variant gives the same bits (a NumPy reference with
  exact integer sums too). So a forward in this arithmetic gives the same tokens with every decoding method.
* Not the float32 model's values: the activations are rounded to 8 bits, and the MLP's gated activation
  silu(g) * u is computed with goose's own exp (8 values per instruction, within ~2 float32 ulps of the true
  value, as torch's float32 silu), so logits differ from the float32
  path (`goose.backends.quant`, bit-identical to the float32 model) by about the quantization error. Plain
  greedy decoding *in this arithmetic* is the reference for losslessness.

Variants, chosen from the CPU flags (``/proc/cpuinfo``), in this fallback order: ``amx`` (AMX-INT8 tiles for
calls of 12 rows or more: per weight group the integer products of up to 16 rows x 16 columns in one tile
instruction, pipelined two groups deep; fewer rows run as ``vnni512``; Linux must grant the tile state),
``vnni512`` (AVX-512 F/BW/VL + AVX512-VNNI + AVX512-VBMI: 16 columns per register, up to 8 rows per tile),
``avxvnni`` (AVX2 + AVX-VNNI, ``vpdpbusd`` on 8 lanes), ``avx2`` (AVX2 ``vpmaddubsw``; FMA and F16C for the
rest; nibble formats below 6 rows read each 64 bytes of quants as two pairs of byte rows against activation
operands expanded once per call; 6 rows or more (Q8_0: 32) unpack each 16-column panel's weights once per call;
both sum a group's products in int16 before widening). All give the same bits. ``GOOSE_INT8_VARIANT=<name>`` drops
the ones above <name> (for comparisons and tests), and ``GOOSE_KERNEL_VARIANT=avx2`` (goose's float kernels on
AVX2) caps these at ``avx2`` too. Built once per variant and machine into ``$XDG_CACHE_HOME/goose/kernels/``
like goose's other kernels (`goose.backends.cpukernel`); ``GOOSE_CPU_KERNEL=0`` switches them off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import cpukernel
from .quant import FORMATS, QuantWeight, run_linear

SOURCE = Path(__file__).with_name("int8_kernels.cpp")
ABI = 1
BLOCK = 32  # activation values per scale
BASE_FLAGS = [*cpukernel.BASE_FLAGS, "-ffp-contract=off", "-fno-math-errno"]
_F16 = ["-mavx2", "-mfma", "-mf16c"]
# name -> (compiler flags, CPU flags it needs); ORDER: the fallback order
VARIANTS = {
    "amx": ([*_F16, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512vbmi", "-mamx-tile",
             "-mamx-int8"],
            {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "amx_tile",
             "amx_int8"}),
    "vnni512": ([*_F16, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512vbmi"],
                {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"}),
    "avxvnni": ([*_F16, "-mavxvnni"], {"avx2", "fma", "f16c", "avx_vnni"}),
    "avx2": (_F16, {"avx2", "fma", "f16c"}),
}
ORDER = ("amx", "vnni512", "avxvnni", "avx2")
ISA = {"amx": 1024, "vnni512": 512, "avxvnni": 257, "avx2": 256}  # goose_int8_isa() of each variant
ENV_VARIANT = "GOOSE_INT8_VARIANT"

class Int8Kernels:
    """One loaded variant: `linear` any number of rows against a `QuantWeight`, `op` for a layer plan,
    `quantize` (the activations' quantization, for tests and references)."""

    def __init__(self, lib: ctypes.CDLL, path: Path, variant: str) -> None:
        self.path, self.variant = path, variant
        self.isa = lib.goose_int8_isa()
        self._fn = lib.goose_int8_linear
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                             ctypes.c_int, ctypes.c_int]
        self._quantize = lib.goose_int8_quantize
        self._quantize.restype = None
        self._quantize.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]

    def __repr__(self) -> str:
        return f"Int8Kernels({self.variant})"

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [M, K]`` (float32, K a multiple of 32) -> ``(q [M, K] int8, d [M, K / 32] float32)``."""
        if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] % BLOCK:
            raise ValueError(f"x must be a float32 CPU [M, K] tensor with K a multiple of {BLOCK}")
        x = x.contiguous()
        m, k = x.shape
        q = torch.empty(m, k, dtype=torch.int8)
        d = torch.empty(m, k // BLOCK, dtype=torch.float32)
        if m:
            self._quantize(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr())
        return q, d

    def op(self, weight: QuantWeight, n: int, bias: torch.Tensor | None) -> cpukernel.PlanOp:
        """A projection of a `CpuKernels.layer_plan` in this arithmetic (the call shape of the float32 one)."""
        self._check_weight(weight, n)
        return cpukernel.PlanOp(ctypes.cast(self._fn, ctypes.c_void_p).value, FORMATS[weight.fmt][0], weight.data,
                                n, weight.k, bias)

    @staticmethod
    def _check_weight(weight: QuantWeight, n: int) -> None:
        if not isinstance(weight, QuantWeight):
            raise TypeError("weight must be a QuantWeight")
        if n != weight.n:
            raise ValueError(f"n = {n}, the weight has {weight.n} rows")
        want = weight.kernels.packed_bytes(weight.fmt, weight.n, weight.k)
        if weight.data.numel() != want or not weight.data.is_contiguous() or weight.k % BLOCK:
            raise ValueError("the packed weight has the wrong size")

    def linear(self, x: torch.Tensor, weight: QuantWeight, n: int, bias: torch.Tensor | None = None, *,
               norm: tuple[torch.Tensor, float] | None = None, gated: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``in(x) [M, K]`` times the ``[n, K]`` weight, plus bias: ``[M, n]`` float32, the call of
        `QuantKernels.linear` (`norm`, `gated`, `out` as there; `bias` padded to whole 16-column panels)."""
        self._check_weight(weight, n)
        return run_linear(self._fn, x, weight, n, bias, norm, gated, out)


LIBRARY = cpukernel.KernelLibrary(SOURCE, "goose_int8", ABI, Int8Kernels, VARIANTS, ORDER, BASE_FLAGS,
                                  caps=(ENV_VARIANT, cpukernel.ENV_VARIANT), ready="goose_int8_ready")
# ``GOOSE_INT8_VARIANT=<name>`` drops the variants above <name>, ``GOOSE_KERNEL_VARIANT=avx2`` the ones above avx2
runnable_variants = LIBRARY.runnable_variants
kernels = LIBRARY.kernels  # the best runnable variant that loads (amx needs Linux to grant the tile state)
unavailable_reason = LIBRARY.unavailable_reason
_state = LIBRARY.state
_load = LIBRARY.load  # (uncached)
