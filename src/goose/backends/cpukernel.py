"""goose's own float32 CPU kernels for x86-64 (AVX-512 or AVX2, + FMA), built on first use: a small-batch
linear layer, a decoder layer's attention on a static KV cache, and the top k of logit rows.

`LeanForward` multiplies every weight matrix by the 1..~16 rows of a decoding step or a draft tree, and
runs a forward's decoder layers in one call of ``goose_layers`` over a plan built once (`layer_plan`). On a
small CPU, PyTorch's kernels for those shapes (MKL, oneDNN) stream the weights at about half the memory
bandwidth and get slower with every added row; ``cpu_kernels.cpp`` reads each weight once per call
whatever the row count (see that file for the layout and the numerics). Its attention does a layer's
rotary embedding, cache write, scores, softmax and weighted sum in one call, where PyTorch needs ~15
small operations of ~10-100 us each.

Variants, chosen from the CPU flags (``/proc/cpuinfo``), in this fallback order: ``avx512`` (AVX-512
F/BW/VL + AVX2 + FMA: the linear layer on 16-lane registers, tiles of up to 12 rows x 32 columns) and
``avx2`` (AVX2 + FMA: 8-lane registers, tiles of up to 6 rows x 16 columns). Attention on AVX-512 takes the
query rows of a sequence that read one kv head (the query heads of all its new tokens, up to 48 rows per
group) over blocks of 16 KB of keys, then of values, so each key and value is read from memory once per
layer for all of them; two rows per register in the scores; the threads split a group's keys, rows or columns
when there are fewer groups than threads. On AVX2 a work item is one token's query heads of a kv head.
Top-k is the same 8-lane code in both. Both give bit-identical results (same packed layout, same FMA chain
per output, the same per-lane arithmetic in attention);
``GOOSE_KERNEL_VARIANT=avx2`` picks a lower variant (for comparisons; the quantized kernels of
`goose.backends.quant` follow it too).

Each variant is compiled once per machine with the system C++ compiler into
``$XDG_CACHE_HOME/goose/kernels/`` (~2 s; the file name carries a hash of the source and the local headers it
includes, the flags and the compiler, so an edit or another compiler rebuilds it; its digest is kept beside it,
``<name>.so.digest``, and a library that does not match it is compiled again) and loaded with ctypes. A
library (or a folder above it up to the cache root) that another user owns or that group or others may write
is never loaded: `kernel()` raises `goose.cachefs.UnsafeCache` naming it (loading it would run their code). Its
OpenMP threads are torch's own (the library links the libgomp torch has already loaded), so
``torch.set_num_threads`` governs it too.

`kernel()` returns the loaded kernel, or None, and `unavailable_reason()` says why not. It is None when:
the CPU lacks AVX2/FMA or is not x86-64, torch is not built with GNU OpenMP, no compiler is found (``$CXX``,
then ``c++``, ``g++``), the build fails, or ``GOOSE_CPU_KERNEL=0`` is set. Callers then use PyTorch's own
kernels; results are the same up to float32 rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import operator
import os
import platform
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from .. import cachefs
from ..machine import cpu_flags
from ..paths import cache_root
from ..progress import note

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
BASE_FLAGS = ["-std=c++17", "-O3", "-fopenmp", "-shared", "-fPIC"]
# name -> (compiler flags, CPU flags it needs); ORDER is the fallback order (shared with goose.backends.quant)
VARIANTS = {
    "avx512": (["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"],
               {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}),
}
ORDER = ("avx512", "avx2")
PANEL = 16  # output columns per packed panel (must match kPanel in the source)
ABI = 12  # goose_kernels_abi() of this version of the source
ENV_SWITCH = "GOOSE_CPU_KERNEL"
ENV_VARIANT = "GOOSE_KERNEL_VARIANT"

_pause: dict[str, object] = {}  # libgomp's omp_pause_resource_all, once looked up (False: none)
_CLAIMS: dict = {}  # library path -> its `<prefix>_claim(width)` (team.h), once per library however often loaded
_claimed = threading.local()  # .width: what `claim_threads` last set on this thread


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (tests replace this function to force a variant's fallback)."""
    return cpu_flags()


def switched_off() -> bool:
    """True when ``GOOSE_CPU_KERNEL`` switches goose's kernels off."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


_INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)


def source_text(source: Path) -> str:
    """The text of a kernel source and of the local headers it includes (``#include "name"``, from its folder,
    recursively, each once): what a compiled library depends on, so what its cache name hashes."""
    seen: list[Path] = []

    def visit(path: Path) -> None:
        if path in seen:
            return
        seen.append(path)
        for name in _INCLUDE.findall(path.read_text()):
            visit(path.with_name(name))

    visit(source)
    return "\n".join(path.read_text() for path in seen)


def built(cxx: str, flags: list[str], source: Path, variant: str) -> tuple[Path, str | None]:
    """The library of `source` compiled with `flags` in the kernel cache, compiled first when missing (`_build`):
    ``(path, None)``, or ``(path, why the build failed)``. Its name hashes the source with its headers
    (`source_text`), the flags and the compiler's version, so an edit or another compiler builds a new one; a
    library that does not match its digest is compiled again, and one another user owns or may write raises
    `cachefs.UnsafeCache` (`cachefs.check_file`)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha1("\n".join([source_text(source), " ".join(flags), cxx, version]).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"{source.stem}-{variant}-{digest}.so"
    return path, None if _whole(path) else _build(cxx, flags, source, path)


def _whole(path: Path) -> bool:
    """True when the library at `path` is there and matches its digest (raises `cachefs.UnsafeCache`)."""
    return path.is_file() and cachefs.check_file(path) is None


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def _gnu_openmp_loaded() -> bool:
    """True when torch runs on GNU OpenMP and this process has its libgomp loaded (so -fopenmp shares it)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        with open("/proc/self/maps") as f:
            return any("libgomp" in line for line in f)
    except OSError:
        return False


def _libgomp_path() -> str | None:
    """torch's libgomp as this process loaded it, or None. Other wheels bundle their own (sentencepiece
    does): the one in torch's directory wins, then one loaded under the plain soname."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
    for path in sorted(paths):
        if os.path.realpath(path).startswith(torch_dir):
            return path
    return next((p for p in sorted(paths) if os.path.basename(p) == "libgomp.so.1"), None)


def release_thread_team() -> bool:
    """Free the OpenMP worker threads of the calling thread's team (libgomp's ``omp_pause_resource_all``).

    libgomp keeps one team of worker threads per thread that ever ran a parallel region, and when the
    process holds more such threads than CPUs it makes every team's idle workers sleep at once instead of
    spinning (its "throttled" spin count). A forward runs hundreds of short parallel regions, each then
    waking sleeping workers: on 2 cores a step loop on a second thread ran 2.8x slower (13 -> 37 ms per
    4-sequence forward) while the thread that loaded the model still held its idle team. `Engine` calls
    this on the threads that did torch work for it (its constructor's caller) so that its own thread's team
    is the only one. The caller's next parallel region builds a new team (~0.1 ms). Returns True when
    released; False without GNU OpenMP (nothing to do) or when the runtime lacks the call."""
    if _pause.get("fn") is None:
        fn = False
        path = _libgomp_path() if "OpenMP" in torch.__config__.parallel_info() else None
        if path is not None:
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all
                fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
            except (OSError, AttributeError):
                fn = False
        _pause["fn"] = fn
    fn = _pause["fn"]
    return bool(fn) and fn(2) == 0  # 2 = omp_pause_hard: the team's threads exit


def claim_threads(width: int) -> None:
    """The calling thread's projections, in every kernel library loaded so far, run on the library's claim pool
    with `width` threads (width <= 1: on torch's OpenMP team; team.h): the caller and width - 1 worker threads
    take blocks of a projection's panels from one counter, and the caller does the blocks no running thread took,
    so a worker the scheduler took off its core holds a projection up only while it holds a block (an OpenMP team
    waits for it at every region). Used while torch runs the thread's regions on one thread (`engine.threads`):
    the pool serves regions of one thread only. The bits do not depend on it."""
    for claim in _CLAIMS.values():
        claim(int(width))
    _claimed.width = int(width) if width > 1 else 0


def claimed() -> int:
    """The claim pool's width `claim_threads` last set for the calling thread (0: OpenMP's team)."""
    return getattr(_claimed, "width", 0)


class CpuKernels:
    """The loaded kernels: ``pack`` a weight once, then ``linear`` any number of rows against it;
    ``attention_step`` for the layers of one forward; ``topk`` of logit rows."""

    def __init__(self, lib: ctypes.CDLL, path: Path, variant: str) -> None:
        self.path, self.variant = path, variant
        self.isa = lib.goose_kernels_isa()  # vector width the library was built for: 512 or 256
        self._fn = lib.goose_linear
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int,
                             ctypes.c_int]
        self._topk = lib.goose_topk
        self._topk.restype = None
        self._topk.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_void_p]
        self._harvest = lib.goose_harvest
        self._harvest.restype = ctypes.c_int64
        self._harvest.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._attn = lib.goose_attention
        self._attn.restype = None
        self._attn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        # the plain arrangement (bit reference); absent from an older source a benchmark may load (--baseline)
        self._attn_plain = getattr(lib, "goose_attention_plain", None)
        if self._attn_plain is not None:
            self._attn_plain.restype, self._attn_plain.argtypes = None, self._attn.argtypes
        self._attn_batch = lib.goose_attention_batch
        self._attn_batch.restype = None
        self._attn_batch.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
        self._layers = lib.goose_layers
        self._layers.restype = None
        self._layers.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float]
        self._head_layer = lib.goose_head_layer
        self._head_layer.restype = None
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._head_layer.argtypes = [ptr] * 3 + [i64] + [ptr] * 4 + [i64] * 3 + [ptr] * 4 + [i64] * 2 + [ptr, i64,
                                                                                                     ctypes.c_float]
        self._linear_address = ctypes.cast(lib.goose_linear, ctypes.c_void_p).value

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` float32 -> panels of 16 columns, each stored as two halves of 8: ``[ceil(N / 16), 2, K, 8]``
        (rows past N are zero)."""
        _check(weight, "pack: weight", dims=2)
        n, k = weight.shape
        if n < 1 or k < 1:
            raise ValueError(f"pack: weight must have rows and columns, not shape {list(weight.shape)}")
        return CpuKernels.pack_into(weight, torch.empty(-(-n // PANEL), 2, k, PANEL // 2, dtype=torch.float32))

    @staticmethod
    def pack_into(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`pack` into the given ``[ceil(N / 16), 2, K, 8]`` float32 tensor (a slice of a fused weight's panels),
        with no other copy of the weight; returns `out`."""
        _check(weight, "pack: weight", dims=2)
        n, k = weight.shape
        if tuple(out.shape) != (-(-n // PANEL), 2, k, PANEL // 2) or out.dtype != torch.float32:
            raise ValueError(f"pack_into: out has shape {list(out.shape)}, a [{n}, {k}] weight needs "
                             f"[{-(-n // PANEL)}, 2, {k}, {PANEL // 2}]")
        full = n // PANEL
        w = weight.detach()
        if full:
            out[:full].copy_(w[:full * PANEL].reshape(full, 2, PANEL // 2, k).transpose(2, 3))
        if n % PANEL:  # the last panel's rows past N are zero
            tail = w.new_zeros(PANEL, k)
            tail[:n % PANEL] = w[full * PANEL:]
            out[full].copy_(tail.view(2, PANEL // 2, k).transpose(1, 2))
        return out

    @staticmethod
    def pack_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """``[N]`` -> zero-padded to a whole number of panels (the kernel reads 16 at a time)."""
        if bias is None:
            return None
        _check(bias, "pack_bias: bias", dims=1)
        if bias.shape[0] != n:
            raise ValueError(f"pack_bias: bias has {bias.shape[0]} entries, the layer {n} outputs")
        b = bias.detach().contiguous()
        return torch.cat([b, b.new_zeros((-n) % PANEL)]) if n % PANEL else b

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None, *,
               norm: tuple[torch.Tensor, float] | None = None, gated: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``in(x) [M, K]`` times the packed ``[N, K]`` weight, plus bias: ``[M, N]`` (float32, CPU).

        ``in(x)`` is x itself; with ``norm=(weight [K], eps)`` the RMSNorm of x; with ``gated`` the
        activation ``silu(x[:, :K]) * x[:, K:]`` of x ``[M, 2K]``. With ``out`` (``[M, N]``, contiguous)
        the result is added to it in place (a residual connection) and ``out`` is returned.

        Every argument is checked here (dtype float32, CPU, shapes, and contiguity of the packed weight,
        bias and ``out``; x is made contiguous): the kernel itself trusts its pointers."""
        _check(x, "linear: x", dims=2)
        panels, k_in = _panels(packed, n, "linear")
        x = x.contiguous()
        m, k = x.shape
        if k != (2 * k_in if gated else k_in):
            raise ValueError(f"input has {k} features, the weight {k_in}" + (" (x2 when gated)" if gated else ""))
        if bias is not None:
            _check(bias, "linear: bias", dims=1, contiguous=True)
            if bias.shape[0] != panels * PANEL:
                raise ValueError(f"linear: bias has {bias.shape[0]} entries, not {panels * PANEL} (use pack_bias)")
        if norm is not None:
            if gated or not isinstance(norm, (tuple, list)) or len(norm) != 2:
                raise ValueError("norm needs an ungated input and a (weight [K], eps) pair")
            _check(norm[0], "linear: norm weight", dims=1)
            if norm[0].shape != (k_in,):
                raise ValueError("norm needs an ungated input and a [K] weight")
        if out is None:
            y = torch.empty(m, n, dtype=torch.float32)
        elif (not isinstance(out, torch.Tensor) or out.shape != (m, n) or not out.is_contiguous()
              or out.dtype != torch.float32 or out.device.type != "cpu"):
            raise ValueError(f"out must be a contiguous float32 CPU [{m}, {n}] tensor")
        else:
            y = out
        nw, eps = (None, 0.0) if norm is None else (norm[0].contiguous(), float(norm[1]))
        self._fn(x.data_ptr(), m, k_in, packed.data_ptr(), n, None if bias is None else bias.data_ptr(), y.data_ptr(),
                 None if nw is None else nw.data_ptr(), eps, int(gated), int(out is not None))
        return y

    def op(self, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> "PlanOp":
        """A projection of a `layer_plan`: `linear` against this packed weight and bias (checked here once)."""
        _, k_in = _panels(packed, n, "op")
        return PlanOp(self._linear_address, -1, packed, n, k_in, bias)

    def layer_plan(self, layers: list[tuple]) -> "LayerPlan":
        """Decoder layers run by one call per forward (``goose_layers`` in the source): each entry is
        ``(ln1 [hid], eps1, ln2 [hid], eps2, qkv, o, gate_up, down)``, the last four `PlanOp`s (from this
        kernel's or the quantized kernel's `op`)."""
        return LayerPlan(self._layers, layers)

    def head_layer(self, fc: "PlanOp", layer: tuple, n_heads: int) -> "HeadLayer":
        """A draft head's input projection `fc` (``[hid, fc.k]``) and its one decoder layer (a `layer_plan` entry;
        `ln1` may be None: no norm before attention) over one sequence's cache, in one kernel call per step."""
        return HeadLayer(self._head_layer, fc, LayerPlan(self._layers, [layer]), n_heads)

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest values of each row of ``x [n, V]`` (float32, CPU, unit stride along rows), in
        descending order, ties to the lower index: ``(values [n, k], indices [n, k] int64)``, as
        ``torch.topk`` (whose tie order is unspecified) but one vectorized pass per row (~10x faster for
        a 49k vocabulary here). NaNs are never taken."""
        _check(x, "topk: x", dims=2)
        if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
            raise ValueError("topk needs a float32 CPU [n, V] tensor with unit stride along rows")
        n, v = x.shape
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= v:
            raise ValueError(f"k = {k} must be in 1..{v}")
        vals = torch.empty(n, k, dtype=torch.float32)
        ids = torch.empty(n, k, dtype=torch.int64)
        if n:
            self._topk(x.data_ptr(), n, v, x.stride(0), k, vals.data_ptr(), ids.data_ptr())
        return vals, ids

    def harvester(self, tab_ids: np.ndarray, tab_scores: np.ndarray, observed: np.ndarray,
                  with_scores: bool) -> Callable[[torch.Tensor, Sequence[int]], tuple[np.ndarray, np.ndarray] | None]:
        """An adjacency table's harvest (`goose.drafting.adjacency.AdjacencyTable`) as one call per harvest:
        ``run(x [n, V], tokens)`` takes the top k of each row of x as `topk`, their scores (`with_scores`: the
        softmax over the k values, else 1 / k), and sets row ``tokens[i]`` of the table (``tab_ids [rows, k]``
        int64, ``tab_scores [rows, k]`` float32, ``observed [rows]`` bool, C-contiguous, checked here once) to
        row i's, the last of duplicate tokens winning; it returns ``(ids [n, k], scores [n, k])``, or None for an
        x that is not a float32 CPU tensor of unit stride along rows. After a forward has streamed the weights,
        every small array operation in Python runs with cold caches (~10 us each), so a harvest is one call."""
        rows = observed.shape[0] if observed.ndim == 1 else -1
        k = tab_ids.shape[1] if tab_ids.ndim == 2 else 0
        if (tab_ids.dtype != np.int64 or tab_scores.dtype != np.float32 or observed.dtype != np.bool_ or k < 1
                or tab_ids.shape != (rows, k) or tab_scores.shape != (rows, k) or not tab_ids.flags.c_contiguous
                or not tab_scores.flags.c_contiguous or not observed.flags.c_contiguous):
            raise ValueError("harvester: a table of int64 ids and float32 scores [rows, k >= 1] and bool observed "
                             "[rows], C-contiguous")
        fn, scored = self._harvest, int(bool(with_scores))
        ptrs = (rows, tab_ids.ctypes.data, tab_scores.ctypes.data, observed.ctypes.data)

        def run(x: torch.Tensor, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
            n, v = x.shape
            if x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1 or (n > 1 and x.stride(0) < v):
                return None
            if len(tokens) != n or k > v:
                raise ValueError(f"harvest: {len(tokens)} tokens for {n} rows, k = {k} of {v} values")
            toks = np.array(tokens, dtype=np.int64)
            ids = np.empty((n, k), dtype=np.int64)
            scores = np.empty((n, k), dtype=np.float32)
            if n and fn(x.data_ptr(), n, v, x.stride(0), k, toks.ctypes.data, scored, ids.ctypes.data,
                        scores.ctypes.data, *ptrs):
                raise ValueError(f"harvest: a token outside the table's 0..{rows - 1}")
            return ids, scores

        run.table = (tab_ids, tab_scores, observed)  # the arrays behind `ptrs` live as long as `run`
        return run

    def attention_step(self, n_heads: int, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, prefix: int,
                       allowed: torch.Tensor | None, scale: float, *, plain: bool = False) -> AttentionStep:
        """Attention for the ``n`` new tokens of one forward, on every layer of a static KV cache
        ``cache [layers, 2 (keys, values), Kh, capacity, D]`` (float32, or bfloat16: each entry rounded once when
        written, then read as the float32 it denotes) holding ``prefix`` tokens: rotary embedding
        (``cos, sin [n, D]``, Hugging Face's rotate_half convention), cache write at ``prefix..prefix+n-1``,
        scores, softmax, weighted sum. ``allowed [n, n]`` (bool): which new tokens each one sees (None:
        causal; each token must see itself). Everything is checked here once; the returned step is then called
        per layer. ``plain=True`` runs the plain arrangement (one token's query heads per work item), the bit
        reference that the default grouped one matches (for tests and benchmarks)."""
        fn = self._attn
        if plain:
            if self._attn_plain is None:
                raise ValueError("this kernel library has no plain attention (goose_attention_plain)")
            fn = self._attn_plain
        return AttentionStep(fn, n_heads, cos, sin, cache, prefix, allowed, scale)

    def attention_batch(self, steps: list["AttentionStep"]) -> "AttentionBatch":
        """The attention of several sequences' steps (from `attention_step`, same heads, layers and scale),
        whose rows follow each other in that order, in one call per layer: ``batch(layer, qkv)`` for
        ``qkv [sum n, (H + 2 Kh) D]`` gives ``[sum n, H D]``, each segment's rows exactly as its own step
        gives them (one parallel region per layer instead of one per sequence)."""
        return AttentionBatch(self._attn_batch, steps)


class AttentionStep:
    """``step(layer, qkv)``: that layer's attention output ``[n, H D]`` (heads in order, query head h reading
    kv head ``h // (H / Kh)``) for ``qkv [n, (H + 2 Kh) D]``, the new tokens' q, k and v projections."""

    def __init__(self, fn, n_heads: int, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, prefix: int,
                 allowed: torch.Tensor | None, scale: float) -> None:
        for name, t, dims in (("cos", cos, 2), ("sin", sin, 2)):
            _check(t, f"attention: {name}", dims=dims)
        if not isinstance(cache, torch.Tensor):
            raise ValueError(f"attention: cache must be a torch.Tensor, not {type(cache).__name__}")
        if cache.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"attention: cache must be float32 or bfloat16, not {cache.dtype}")
        if cache.device.type != "cpu":
            raise ValueError(f"attention: cache must be on the CPU, not {cache.device}")
        if cache.dim() != 5:
            raise ValueError(f"attention: cache must have 5 dimensions, not shape {list(cache.shape)}")
        if not cache.is_contiguous():
            raise ValueError("attention needs float32 CPU tensors and a contiguous cache")
        if allowed is not None:
            if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool or allowed.device.type != "cpu":
                raise ValueError("attention: allowed must be a bool CPU [n, n] tensor")
        try:
            n_heads, prefix, scale = operator.index(n_heads), operator.index(prefix), float(scale)
        except TypeError:
            raise ValueError("attention: n_heads and prefix must be integers, scale a number") from None
        if n_heads < 1 or not math.isfinite(scale):
            raise ValueError(f"attention: n_heads = {n_heads} must be >= 1 and scale = {scale} finite")
        n, d = cos.shape
        layers, two, kh, cap, d_cache = cache.shape
        if kh < 1 or d < 8 or d % 8:
            raise ValueError(f"attention: head dim {d} must be a multiple of 8, with at least one kv head")
        if (two != 2 or d_cache != d or n_heads % kh or sin.shape != cos.shape or prefix < 0 or prefix + n > cap
                or (allowed is not None and allowed.shape != (n, n))):
            raise ValueError("attention: inconsistent shapes")
        self._keep = [t.contiguous() for t in (cos, sin)]  # alive as long as the step
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in self._keep):  # (the cache: above)
            raise ValueError("attention needs float32 CPU tensors and a contiguous float32 or bfloat16 cache")
        if allowed is not None and not bool(allowed.diagonal().all()):
            raise ValueError("attention: every new token must see itself (allowed[i, i])")
        mask = None if allowed is None or n == 1 else allowed.to(torch.uint8).contiguous()
        if mask is not None:
            self._keep.append(mask)
        self._fn, self._cache, self.layers = fn, cache, layers
        self._args = (n, n_heads, kh, d, self._keep[0].data_ptr(), self._keep[1].data_ptr())
        self._tail = (cap, prefix, None if mask is None else mask.data_ptr(), float(scale))
        self.kv16 = int(cache.dtype == torch.bfloat16)
        self._half = kh * cap * d * cache.element_size()
        self._layer_bytes = 2 * self._half
        self._shape = (n, (n_heads + 2 * kh) * d)
        self._out = (n, n_heads * d)

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        _check_layer_input(layer, self.layers, qkv, self._shape)
        out = torch.empty(self._out, dtype=torch.float32)
        keys = self._cache.data_ptr() + layer * self._layer_bytes
        self._fn(qkv.data_ptr(), *self._args, keys, keys + self._half, *self._tail, out.data_ptr(), self.kv16)
        return out


class AttentionBatch:
    """``batch(layer, qkv)``: the attention of every step's rows at once (see `CpuKernels.attention_batch`)."""

    def __init__(self, fn, steps: list[AttentionStep]) -> None:
        if not steps:
            raise ValueError("attention_batch: no steps")
        first = steps[0]
        heads = first._args[1:4]  # (H, Kh, D)
        if any(s._args[1:4] != heads or s._tail[3] != first._tail[3] or s.layers != first.layers for s in steps):
            raise ValueError("attention_batch: the steps differ in heads, head size, scale or layers")
        desc, row = [], 0
        for s in steps:
            n, _, _, _, cos, sin = s._args
            cap, prefix, mask, _ = s._tail
            desc.append([n, row, cos, sin, s._cache.data_ptr(), cap, prefix, mask or 0, s.kv16])
            row += n
        self._desc = torch.tensor(desc, dtype=torch.int64)  # [segments, 9]
        self._steps = steps  # their tables and masks stay alive
        self._fn, self.layers = fn, first.layers
        self._heads, self._scale = heads, first._tail[3]
        h, kh, d = heads
        self._shape, self._out = (row, (h + 2 * kh) * d), (row, h * d)

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        _check_layer_input(layer, self.layers, qkv, self._shape)
        out = torch.empty(self._out, dtype=torch.float32)
        self._fn(qkv.data_ptr(), *self._heads, len(self._steps), self._desc.data_ptr(), layer, self._scale,
                 out.data_ptr())
        return out


class PlanOp:
    """One projection of a `LayerPlan`: the kernel function's address, its format code (-1: float32 panels),
    the packed weight (kept alive here), its outputs and inputs, and the padded bias (or None)."""

    __slots__ = ("fn", "fmt", "weight", "n", "k", "bias")

    def __init__(self, fn: int, fmt: int, weight: torch.Tensor, n: int, k: int, bias: torch.Tensor | None) -> None:
        padded = -(-n // PANEL) * PANEL
        if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.dim() != 1
                                 or bias.numel() < padded or not bias.is_contiguous()):
            raise ValueError(f"op: bias must be a contiguous float32 CPU tensor of at least {padded} values (padded)")
        self.fn, self.fmt, self.weight, self.n, self.k, self.bias = fn, fmt, weight, n, k, bias


class _PlanLinear(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("fmt", ctypes.c_int64), ("w", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("bias", ctypes.c_void_p)]


class _PlanLayer(ctypes.Structure):
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("eps1", ctypes.c_float),
                ("eps2", ctypes.c_float), ("qkv", _PlanLinear), ("o", _PlanLinear), ("gate_up", _PlanLinear),
                ("down", _PlanLinear)]


class LayerPlan:
    """``plan(x, batch)``: every decoder layer of one forward on the residual stream ``x [M, hid]`` (in
    place), attention by ``batch`` (an `AttentionBatch` of the forward's segments), in one kernel call;
    bit-identical to calling each layer's projections and attention in turn (see `CpuKernels.layer_plan`)."""

    def __init__(self, fn, layers: list[tuple]) -> None:
        if not layers:
            raise ValueError("layer_plan: no layers")
        hid = layers[0][4].k
        qkv_n, inter = layers[0][4].n, layers[0][7].k
        table = (_PlanLayer * len(layers))()
        keep = []
        for entry, (ln1, eps1, ln2, eps2, *ops) in zip(table, layers):
            qkv, o, gate_up, down = ops
            if (qkv.k != hid or o.n != hid or gate_up.k != hid or down.n != hid or qkv.n != qkv_n
                    or gate_up.n != 2 * inter or down.k != inter):
                raise ValueError("layer_plan: the layers' projections do not chain (hid -> qkv, o -> hid, "
                                 "hid -> 2 I, I -> hid)")
            for norm in (ln1, ln2) if ln1 is not None else (ln2,):  # (a draft head may have no ln1)
                _check(norm, "layer_plan: norm weight", dims=1, contiguous=True)
                if norm.shape[0] != hid:
                    raise ValueError(f"layer_plan: a norm weight has {norm.shape[0]} entries, not {hid}")
            entry.ln1 = None if ln1 is None else ln1.data_ptr()
            entry.ln2, entry.eps1, entry.eps2 = ln2.data_ptr(), float(eps1), float(eps2)
            for name, op in zip(("qkv", "o", "gate_up", "down"), ops):
                setattr(entry, name, _PlanLinear(op.fn, op.fmt, op.weight.data_ptr(), op.n, op.k,
                                                 None if op.bias is None else op.bias.data_ptr()))
            keep.append((ln1, ln2, *ops))
        self._fn, self._table, self._keep = fn, table, keep
        self.layers, self.hidden, self.qkv_width, self.intermediate = len(layers), hid, qkv_n, inter

    def __call__(self, x: torch.Tensor, batch: "AttentionBatch", taps: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """Runs the layers on `x` (in place); returns a copy of ``x`` after each layer of `taps` (0-based layer
        indices, ascending: the residual stream a fused draft head reads), the layers between them in one call."""
        m = x.shape[0] if x.dim() == 2 else -1
        if (x.dim() != 2 or x.shape[1] != self.hidden or not x.is_contiguous() or x.dtype != torch.float32
                or x.device.type != "cpu"):
            raise ValueError(f"layer plan: x must be a contiguous float32 CPU [M, {self.hidden}] tensor")
        h, kh, d = batch._heads
        if batch.layers != self.layers or batch._shape != (m, self.qkv_width) or self.qkv_width != (h + 2 * kh) * d:
            raise ValueError("layer plan: the attention batch does not match the plan's layers or rows")
        qkv = torch.empty(m, self.qkv_width, dtype=torch.float32)
        att = torch.empty(batch._out, dtype=torch.float32)
        if att.shape[1] != self._keep[0][3].k:
            raise ValueError("layer plan: the attention output does not match the output projection")
        gu = torch.empty(m, 2 * self.intermediate, dtype=torch.float32)
        if list(taps) != sorted(set(taps)) or any(not 0 <= t < self.layers for t in taps):
            raise ValueError(f"layer plan: taps must be ascending layer indices below {self.layers}, got {taps}")
        out, first = [], 0
        for last in [t + 1 for t in taps] + [self.layers]:
            if last > first:
                self._fn(ctypes.addressof(self._table), first, last, x.data_ptr(), m, qkv.data_ptr(), att.data_ptr(),
                         gu.data_ptr(), h, kh, d, len(batch._steps), batch._desc.data_ptr(), batch._scale)
            first = last
            if len(out) < len(taps):
                out.append(x.clone())
        return out


class HeadLayer:
    """``layer(inp, cos, sin, keys, vals, p)``: a draft head's step in one kernel call (``goose_head_layer`` in the
    source; `CpuKernels.head_layer`): ``x = fc(inp [M, fc.k])``, then the decoder layer over one sequence's float32
    cache ``keys, vals [Kh, cap, D]``, the M rows written at ``p .. p + M - 1`` (rotary tables ``cos, sin
    [M, D]``). The rows see every cached key before ``p - back``; keys ``p - back .. p + M - 1`` as ``allowed
    [M, back + M]`` (bool) says, or causally (allowed None). Returns ``x [M, hid]``."""

    def __init__(self, fn, fc: PlanOp, plan: "LayerPlan", n_heads: int) -> None:
        if fc.n != plan.hidden:
            raise ValueError(f"head_layer: fc gives {fc.n} features, the layer takes {plan.hidden}")
        self._fn, self._plan, self._fc_op, self.heads = fn, plan, fc, int(n_heads)
        self._fc = _PlanLinear(fc.fn, fc.fmt, fc.weight.data_ptr(), fc.n, fc.k,
                               None if fc.bias is None else fc.bias.data_ptr())

    def __call__(self, inp: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                 vals: torch.Tensor, p: int, allowed: torch.Tensor | None = None, back: int = 0) -> torch.Tensor:
        plan = self._plan
        m = inp.shape[0]
        kh, cap, d = keys.shape if keys.dim() == 3 else (0, 0, 0)
        h = self.heads
        if (inp.dim() != 2 or inp.shape[1] != self._fc_op.k or m < 1 or kh < 1 or h % kh
                or (h + 2 * kh) * d != plan.qkv_width or vals.shape != keys.shape or not 0 <= p <= cap - m
                or cos.shape != (m, d) or sin.shape != (m, d)):
            raise ValueError("head layer: inconsistent shapes")
        for t in (inp, cos, sin, keys, vals):
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("head layer: float32 contiguous CPU tensors only")
        mask = None
        if allowed is not None:
            if allowed.shape != (m, back + m) or not 0 <= back <= p or allowed.dtype != torch.bool:
                raise ValueError(f"head layer: allowed must be bool [{m}, {back + m}] with back in 0..{p}")
            mask = allowed.to(torch.uint8).contiguous()
        x = torch.empty(m, plan.hidden, dtype=torch.float32)
        qkv = torch.empty(m, plan.qkv_width, dtype=torch.float32)
        att = torch.empty(m, h * d, dtype=torch.float32)
        gu = torch.empty(m, 2 * plan.intermediate, dtype=torch.float32)
        self._fn(ctypes.addressof(self._fc), ctypes.addressof(plan._table), inp.data_ptr(), m, x.data_ptr(),
                 qkv.data_ptr(), att.data_ptr(), gu.data_ptr(), h, kh, d, cos.data_ptr(), sin.data_ptr(),
                 keys.data_ptr(), vals.data_ptr(), cap, p, None if mask is None else mask.data_ptr(),
                 back if mask is not None else 0, d ** -0.5)
        return x


def _panels(packed, n: int, what: str) -> tuple[int, int]:
    """``(panels, K)`` of a packed ``[N/16, 2, K, 8]`` weight that holds `n` outputs; ValueError otherwise."""
    _check(packed, f"{what}: packed weight", dims=4, contiguous=True)
    panels, two, k_in, half = packed.shape
    if two != 2 or half != PANEL // 2:
        raise ValueError(f"{what}: packed weight has shape {list(packed.shape)}, not [N/16, 2, K, 8] (use pack)")
    if not isinstance(n, int) or isinstance(n, bool) or not (panels - 1) * PANEL < n <= panels * PANEL:
        raise ValueError(f"{what}: n = {n} outputs do not fit a packed weight of {panels} panels of {PANEL}")
    return panels, k_in


def _check_layer_input(layer: int, layers: int, qkv, shape: tuple[int, int]) -> None:
    """An attention call's layer index and qkv rows, checked before the kernel reads them."""
    if not 0 <= layer < layers:
        raise IndexError(f"layer {layer} of {layers}")
    if (not isinstance(qkv, torch.Tensor) or qkv.shape != shape or not qkv.is_contiguous()
            or qkv.dtype != torch.float32 or qkv.device.type != "cpu"):
        raise ValueError(f"qkv must be a contiguous float32 CPU {list(shape)} tensor")


def _check(t, what: str, dims: int, contiguous: bool = False) -> None:
    """Raise ValueError unless `t` is a float32 CPU tensor of `dims` dimensions (and contiguous if asked)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(f"{what} must be float32, not {t.dtype} (goose's CPU kernels are float32 only)")
    if t.device.type != "cpu":
        raise ValueError(f"{what} must be on the CPU, not {t.device}")
    if t.dim() != dims:
        raise ValueError(f"{what} must have {dims} dimensions, not shape {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")


class KernelLibrary:
    """One of goose's compiled kernel libraries (this module's, `goose.backends.quant`'s, `goose.backends.int8`'s):
    its source, the CPU variants it is compiled for (name -> (compiler flags, CPU flags it needs), tried in
    `order`), its ABI check, and one loaded instance per variant (`wrap(lib, path, variant)`), built on first use.
    ``GOOSE_CPU_KERNEL=0`` switches every library off; each environment variable of `caps` set to a variant's
    name drops the variants above it. `ready`: a library function that says whether the variant can run in
    this process (0: refused, such as AMX tiles Linux did not grant)."""

    def __init__(self, source: Path, prefix: str, abi: int, wrap, variants: dict, order: tuple, flags: list[str],
                 caps: tuple[str, ...] = (ENV_VARIANT,), ready: str | None = None) -> None:
        self.source, self.prefix, self.abi, self.wrap = source, prefix, abi, wrap
        self.variants, self.order, self.flags, self.caps, self.ready = variants, order, flags, caps, ready
        self.state: dict[str, tuple] = {}  # variant -> (loaded kernels or None, why not)

    def runnable_variants(self) -> list[str]:
        """The variants this CPU can run, best first (the environment's caps applied)."""
        if platform.machine().lower() not in ("x86_64", "amd64") or platform.system() != "Linux":
            return []
        flags = _cpu_flags()
        runnable = [v for v in self.order if self.variants[v][1] <= flags]
        for env in self.caps:
            cap = os.environ.get(env, "").strip().lower()
            if cap in runnable:
                runnable = runnable[runnable.index(cap):]
        return runnable

    def kernels(self, variant: str | None = None):
        """The loaded kernels of `variant` (None: the best runnable variant that loads), or None (see
        `unavailable_reason`)."""
        return self.get(variant)[0]

    def unavailable_reason(self, variant: str | None = None) -> str | None:
        """Why `kernels(variant)` is None here (None when it is available); builds and loads it on first call."""
        return self.get(variant)[1]

    def get(self, variant: str | None = None) -> tuple:
        """``(kernels, None)`` or ``(None, why not)`` of `variant`, loaded once; None: the first runnable variant
        that loads (else the best one's reason)."""
        if variant is None:
            runnable = self.runnable_variants()
            if not runnable:
                return None, self._no_variant_reason()
            results = []
            for v in runnable:
                results.append(self.get(v))
                if results[-1][0] is not None:
                    return results[-1]
            return results[0]
        if variant not in self.state:
            self.state[variant] = self.load(variant)
        return self.state[variant]

    def load(self, variant: str | None = None) -> tuple:
        """Build and load `variant` (None: the best runnable), uncached: ``(kernels, None)`` or ``(None, why)``."""
        if switched_off():
            return None, f"switched off by {ENV_SWITCH}"
        variant = variant or next(iter(self.runnable_variants()), None)
        if variant is None:
            return None, self._no_variant_reason()
        if variant not in self.variants:
            return None, f"unknown variant '{variant}'; variants: {', '.join(self.order)}"
        if variant not in self.runnable_variants():
            needs = ", ".join(sorted(self.variants[variant][1]))
            return None, f"this CPU cannot run the {variant} variant (needs {needs})"
        if not _gnu_openmp_loaded():
            return None, "torch does not run on GNU OpenMP (libgomp) here"
        cxx = _compiler()
        if cxx is None:
            return None, "no C++ compiler found ($CXX, c++, g++)"
        try:
            path, failed = built(cxx, self.flags + self.variants[variant][0], self.source, variant)
            if failed:
                return None, failed
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"building or loading {self.source.name} ({variant}) failed: {exc}"
        if lib[f"{self.prefix}_abi"]() != self.abi:
            return None, f"{path} is not this version of the kernel"
        if self.ready is not None and not lib[self.ready]():
            return None, f"the {variant} variant cannot run here: Linux refused the AMX tile state (arch_prctl)"
        claim = lib[f"{self.prefix}_claim"]
        claim.restype, claim.argtypes = None, [ctypes.c_int]
        _CLAIMS[str(path)] = claim
        return self.wrap(lib, path, variant), None

    def _no_variant_reason(self) -> str:
        if platform.machine().lower() not in ("x86_64", "amd64") or platform.system() != "Linux":
            return f"needs x86-64 Linux, not {platform.system()} {platform.machine()}"
        least = self.variants[self.order[-1]][1]
        return (f"needs an x86-64 Linux CPU with {', '.join(sorted(f.upper() for f in least))} (this one lacks "
                f"{', '.join(sorted(least - _cpu_flags()))})")


def _build(cxx: str, flags: list[str], source: Path, path: Path) -> str | None:
    """Compile `source` to `path`: under a lock (one build per machine at a time), into a temporary file
    in the same folder that is renamed into place, so a killed build leaves no half-written library, then its
    digest beside it (`cachefs.seal_file`). Returns why the build failed (None when it worked)."""
    with cachefs.lock(path):
        if path.is_file():
            why = cachefs.check_file(path)
            if why is None:  # built by another process meanwhile
                return None
            note(f"{path} is damaged ({why}): compiling {source.name} again")
        else:
            note(f"compiling {source.name} for this CPU ({path.stem}; once per machine)")
        cachefs.clean_stale(path.parent)
        tmp = cachefs.temp_path(path)
        try:
            done = subprocess.run([cxx, *flags, str(source), "-o", str(tmp)], capture_output=True, text=True,
                                  timeout=600)
            if done.returncode != 0:
                return f"building {source.name} failed: {done.stderr.strip()[-500:]}"
            os.chmod(tmp, 0o755)  # (whatever the umask let the compiler give it: nobody else may write it)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        cachefs.seal_file(path)
    return None


LIBRARY = KernelLibrary(SOURCE, "goose_kernels", ABI, CpuKernels, VARIANTS, ORDER, BASE_FLAGS)


def runnable_variants() -> list[str]:
    """The kernel variants this CPU can run, best first (see ORDER); ``GOOSE_KERNEL_VARIANT=<name>`` drops
    the ones above <name>."""
    return LIBRARY.runnable_variants()


def kernel(variant: str | None = None) -> CpuKernels | None:
    """The loaded kernel of `variant` (None: the best this CPU runs, see `runnable_variants`), or None (see
    `unavailable_reason`)."""
    return LIBRARY.kernels(variant)


def unavailable_reason(variant: str | None = None) -> str | None:
    """Why `kernel(variant)` cannot be used here (None when it can); builds and loads it on first call."""
    return LIBRARY.unavailable_reason(variant)


_load = LIBRARY.load  # (uncached: tests build on purpose)


def attention_reason(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why `CpuKernels.attention_step` cannot run heads of this size and dtype (None when it can)."""
    if dtype != torch.float32:
        return f"it needs float32, not {dtype}"
    if head_dim % 8 or head_dim < 8:
        return f"head dim {head_dim} is not a multiple of 8"
    return None


def table_harvester(tab_ids: np.ndarray, tab_scores: np.ndarray, observed: np.ndarray, with_scores: bool):
    """`CpuKernels.harvester` where goose's kernel runs; None elsewhere (the table then harvests with
    `topk_rows` and NumPy)."""
    kern = kernel()
    return None if kern is None else kern.harvester(tab_ids, tab_scores, observed, with_scores)


def topk_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, ids)`` ``[n, k]`` of each row of ``logits [n, V]``: goose's kernel (one vectorized pass per
    row) for float32 CPU rows of unit stride, else ``torch.topk``."""
    kern = kernel() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if kern is not None and logits.stride(-1) == 1:
        return kern.topk(logits, k)
    return torch.topk(logits.float(), k, dim=-1)

