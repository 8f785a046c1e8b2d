"""GGUF weights kept as they are: goose's quantized-block kernels (``quant_kernels.cpp``).

A GGUF file stores most weight matrices as blocks of small integers with half-float scales (Q8_0, Q4_0,
Q4_1, Q4_K, Q6_K here). `use_gguf_weights` packs each such tensor once into goose's panel layout (one
copy: the float32 weight it replaces is released) and swaps the model's `nn.Linear` / `nn.Embedding`
modules for `PackedLinear` / `PackedEmbedding` (`goose.backends.packed`), which multiply with the blocks directly: a step reads the
quantized bytes (~98 MB for SmolLM2's Q4_1 file) instead of 538 MB of float32.

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
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import GooseError
from . import cpukernel
from .packed import PackedEmbedding, PackedLinear, PackedWeight, fuse_layers

SOURCE = Path(__file__).with_name("quant_kernels.cpp")
ABI = 1
PANEL = 16  # output columns per panel (kCols in the source)
ORDER = cpukernel.ORDER  # the variants (cpukernel.VARIANTS), best first
# GGUF type name -> (code in the source, weights per GGUF block, bytes per GGUF block)
FORMATS = {"Q8_0": (0, 32, 34), "Q4_0": (1, 32, 18), "Q4_1": (2, 32, 20), "Q4_K": (3, 256, 144),
           "Q6_K": (4, 256, 210)}
_NAMES = {code: name for name, (code, _, _) in FORMATS.items()}

_state: dict[str, tuple] = {}


# ---- building and loading -------------------------------------------------------------------------------

def runnable_variants() -> list[str]:
    """The variants this CPU can run, best first (see `cpukernel.runnable_variants`)."""
    return cpukernel.runnable_variants()


def _load(variant: str) -> tuple["QuantKernels | None", str | None]:
    if cpukernel.switched_off():
        return None, f"switched off by {cpukernel.ENV_SWITCH}"
    lib, path, why = cpukernel.build_library(SOURCE, variant)
    if lib is None:
        return None, why
    if lib.goose_quant_abi() != ABI:
        return None, f"{path} is not this version of the kernel"
    return QuantKernels(lib, path, variant), None


def _get(variant: str) -> tuple:
    if variant not in _state:
        _state[variant] = _load(variant)
    return _state[variant]


def kernels(variant: str | None = None) -> "QuantKernels | None":
    """The loaded kernels of `variant` (None: the best this CPU runs), or None (see `unavailable_reason`)."""
    return _get(variant or (runnable_variants() or ["avx2"])[0])[0]


def unavailable_reason(variant: str | None = None) -> str | None:
    """Why `kernels(variant)` is None here (None when it is available); builds and loads it on first call."""
    if variant is None and not runnable_variants():
        return "needs an x86-64 Linux CPU with AVX2, FMA and F16C"
    return _get(variant or runnable_variants()[0])[1]


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
        """Rows `ids` of the dequantized weight: float32 ``[*ids.shape, K]``."""
        flat = weight._check_ids(ids)
        out = torch.empty(flat.numel(), weight.k, dtype=torch.float32)
        if flat.numel():
            self._rows(FORMATS[weight.fmt][0], weight.data.data_ptr(), weight.n, weight.k, flat.data_ptr(),
                       flat.numel(), out.data_ptr())
        return out.view(*ids.shape, weight.k)

    def linear(self, x: torch.Tensor, packed: "QuantWeight", n: int, bias: torch.Tensor | None = None, *,
               norm: tuple[torch.Tensor, float] | None = None, gated: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``in(x) [M, K]`` times the packed ``[N, K]`` weight, plus bias: ``[M, N]`` (float32, CPU); the call
        shape of `CpuKernels.linear` (see there for `norm`, `gated`, `out`). `bias` is padded to a whole
        number of 16-column panels (`CpuKernels.pack_bias`)."""
        self._check_weight(packed, n)
        k_in = packed.k
        if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError("x must be a float32 CPU [M, K] tensor")
        x = x.contiguous()
        m, k = x.shape
        if k != (2 * k_in if gated else k_in):
            raise ValueError(f"input has {k} features, the weight {k_in}" + (" (x2 when gated)" if gated else ""))
        if norm is not None and (gated or tuple(norm[0].shape) != (k_in,) or norm[0].dtype != torch.float32):
            raise ValueError("norm needs an ungated input and a float32 [K] weight")
        padded = -(-n // PANEL) * PANEL
        if bias is not None and (bias.dtype != torch.float32 or bias.numel() < padded or not bias.is_contiguous()):
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
        self._fn(FORMATS[packed.fmt][0], x.data_ptr(), m, k_in, packed.data.data_ptr(), n,
                 None if bias is None else bias.data_ptr(), y.data_ptr(), None if nw is None else nw.data_ptr(), eps,
                 int(gated), int(out is not None))
        return y


# ---- the weight and the modules -------------------------------------------------------------------------

class QuantWeight(PackedWeight):
    """A packed quantized ``[n, k]`` weight (GGUF blocks in goose's panel layout; see `PackedWeight`)."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.rows(self, ids)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, **fused) -> torch.Tensor:
        return self.kernels.linear(x, self, self.n, bias, **fused)


# ---- GGUF -> model --------------------------------------------------------------------------------------

# GGUF tensor name (per layer, after "blk.{i}.") -> module path under model.model.layers[i]
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
# architectures whose tensors map this way (llama's q/k rows are permuted by llama.cpp's converter)
ARCHITECTURES = ("llama", "qwen2", "qwen3")


def _permutation(n: int, heads: int) -> np.ndarray:
    """HF row i of a llama q/k projection is GGUF row perm[i] (the inverse of llama.cpp's rope permutation)."""
    dim = n // heads // 2
    return np.arange(n).reshape(heads, dim, 2).swapaxes(1, 2).reshape(n)


class GGUFTensor:
    """One tensor of a GGUF file: GGML type name, shape (GGUF order: ne0 = the row length first), where its
    bytes lie, and how many there are."""

    __slots__ = ("name", "type", "shape", "offset", "nbytes")

    def __init__(self, name: str, type_name: str, shape: list[int], offset: int, nbytes: int) -> None:
        self.name, self.type, self.shape, self.offset, self.nbytes = name, type_name, shape, offset, nbytes


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf(path: Path) -> tuple[dict, dict[str, GGUFTensor]]:
    """The scalar and string metadata and the tensor table of a GGUF file (v2/v3), checked against the file's
    size; tensor bytes are read later, one tensor at a time (`tensor_bytes`). A lean parser: gguf's
    GGUFReader builds a Python object per vocabulary entry (~170 MB for a 49k vocabulary)."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def bad(why: str) -> GooseError:
        return GooseError(f"cannot read GGUF file {path}: {why}")

    try:
        f = open(path, "rb")
    except OSError as exc:
        raise bad(str(exc)) from exc
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise bad("truncated header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos = 0

            def take(fmt: str):
                nonlocal pos
                n = struct.calcsize(fmt)
                if pos + n > size:
                    raise bad("truncated metadata")
                v = struct.unpack_from(fmt, mm, pos)[0]
                pos += n
                return v

            def string() -> str:
                nonlocal pos
                n = take("<Q")
                if pos + n > size:
                    raise bad("truncated string")
                v = bytes(mm[pos:pos + n]).decode("utf-8", "replace")
                pos += n
                return v

            def value(kind: int):
                nonlocal pos
                if kind in _SCALARS:
                    return take(_SCALARS[kind])
                if kind == 8:
                    return string()
                if kind == 9:
                    item, count = take("<I"), take("<Q")
                    if item in _SCALARS:  # skipped without reading
                        pos += count * struct.calcsize(_SCALARS[item])
                        if pos > size:
                            raise bad("truncated array")
                    else:
                        for _ in range(count):
                            value(item)
                    return None
                raise bad(f"unknown metadata type {kind}")

            if bytes(mm[:4]) != b"GGUF":
                raise bad("not a GGUF file (no GGUF magic)")
            pos = 4
            version = take("<I")
            if version not in (2, 3):
                raise bad(f"GGUF version {version} is not supported")
            n_tensors, n_kv = take("<Q"), take("<Q")
            meta = {}
            for _ in range(n_kv):
                key = string()
                meta[key] = value(take("<I"))
            infos = []
            for _ in range(n_tensors):
                name = string()
                dims = [take("<Q") for _ in range(take("<I"))]
                infos.append((name, dims, take("<I"), take("<Q")))
    align = meta.get("general.alignment") or 32
    start = -(-pos // align) * align
    tensors = {}
    for name, dims, code, offset in infos:
        try:
            qtype = GGMLQuantizationType(code)
            block, bbytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as exc:
            raise bad(f"tensor {name} has an unknown type {code}") from exc
        count = int(np.prod(dims)) if dims else 1
        if not dims or dims[0] % block:
            raise bad(f"tensor {name}: rows of {dims[:1]} are not whole {qtype.name} blocks")
        nbytes = count // block * bbytes
        if start + offset + nbytes > size:
            raise bad(f"tensor {name} runs past the end of the file (truncated?)")
        tensors[name] = GGUFTensor(name, qtype.name, dims, start + offset, nbytes)
    return meta, tensors


def tensor_bytes(path: Path, t: GGUFTensor, rows: int) -> np.ndarray:
    """A tensor's bytes as ``[rows, bytes per row]`` uint8 (read from the file, no mapping kept)."""
    with open(path, "rb") as f:
        f.seek(t.offset)
        data = np.fromfile(f, dtype=np.uint8, count=t.nbytes)
    if data.size != t.nbytes:
        raise GooseError(f"cannot read GGUF file {path}: tensor {t.name} is truncated")
    return data.reshape(rows, -1)


def _notice(msg: str) -> None:
    print(f"goose: {msg}", file=sys.stderr)


def use_gguf_weights(model, gguf: Path, kernels: QuantKernels | None = None, check: bool = True) -> dict:
    """Replace `model`'s projections, embedding and output head by the GGUF file's quantized blocks (where
    the file holds them in a supported format); returns ``{"packed": [...names], "float32": [...], "bytes": n}``.

    The model must be the one transformers loads from this file (config, names, shapes). With `check`, the
    first rows of every tensor are compared with the model's float32 weights before those are released: any
    difference (a mapping this function got wrong) raises instead of giving other weights. Types without a
    kernel (F16, Q5_K, ...) keep their float32 weights, with a one-line notice."""
    kern = kernels or kernels_or_none()
    if kern is None:
        raise GooseError(f"goose's quantized kernels cannot run here: {unavailable_reason()}")
    meta, tensors = read_gguf(Path(gguf))
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GooseError(f"GGUF weights are implemented for {', '.join(ARCHITECTURES)}, not '{arch}'")
    cfg, base = model.config, model.model
    done: dict = {"packed": [], "float32": [], "bytes": 0}
    skipped: set[str] = set()

    def quantized(name: str, module: nn.Module, heads: int | None = None) -> QuantWeight | None:
        t = tensors.get(name)
        if t is None:
            return None
        fmt = t.type
        if fmt not in FORMATS:
            if fmt not in ("F32", "F16", "BF16"):
                skipped.add(fmt)
            done["float32"].append(name)
            return None
        n, k = module.weight.shape
        _, block, bbytes = FORMATS[fmt]
        if t.shape != [k, n] or k % block or t.nbytes != n * (k // block * bbytes):
            raise GooseError(f"GGUF tensor {name} ({fmt}) has shape {t.shape} and {t.nbytes} bytes; the model "
                             f"needs [{k}, {n}]")
        data = tensor_bytes(Path(gguf), t, n)
        order = _permutation(n, heads) if heads else range(n)
        w = kern.pack(fmt, [data[i] for i in order], k)
        if check and module.weight.device.type != "meta":
            rows = min(n, 2 * PANEL)
            ref = module.weight.detach()[:rows].float()
            if not torch.equal(w[:rows], ref):
                raise GooseError(f"GGUF tensor {name}: its blocks do not give the model's weights "
                                 f"(max diff {(w[:rows] - ref).abs().max().item():.3g})")
        done["packed"].append(name)
        done["bytes"] += w.nbytes
        return w

    permute = arch == "llama"
    for i, layer in enumerate(base.layers):
        for short, path in _LAYER_NAMES.items():
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            module = getattr(parent, attr)
            if type(module) is not nn.Linear:
                continue
            heads = None
            if permute and short == "attn_q":
                heads = cfg.num_attention_heads
            elif permute and short == "attn_k":
                heads = cfg.num_key_value_heads
            w = quantized(f"blk.{i}.{short}.weight", module, heads)
            if w is not None:
                setattr(parent, attr, PackedLinear(w, module.bias))
    emb = base.embed_tokens
    tied = model.lm_head.weight is emb.weight
    ew = quantized("token_embd.weight", emb) if type(emb) is nn.Embedding else None
    if ew is not None:
        base.embed_tokens = PackedEmbedding(ew, emb.padding_idx)
    if tied and ew is not None and "output.weight" not in tensors:
        model.lm_head = PackedLinear(ew, model.lm_head.bias)
    elif not tied and type(model.lm_head) is nn.Linear:
        ow = quantized("output.weight", model.lm_head)
        if ow is not None:
            model.lm_head = PackedLinear(ow, model.lm_head.bias)
    fuse_layers(model)  # q/k/v and gate/up in one buffer each, as the forward multiplies them
    if skipped:
        _notice(f"{gguf.name}: {', '.join(sorted(skipped))} tensors have no quantized kernel; they run "
                "dequantized to float32")
    return done


def kernels_or_none() -> QuantKernels | None:
    return kernels() if runnable_variants() else None


def format_name(code: int) -> str:
    return _NAMES[code]


WEIGHTS = ("gguf", "float32")


def _resolve(src: Path | None, weights: str | None, dtype: torch.dtype,
             device: torch.device) -> tuple[Path | None, str | None]:
    """(the GGUF file, None) when `weights` resolves to GGUF blocks; (None, why not) otherwise (why: None when
    nothing needs saying). `src`: the model's single GGUF file (`model.gguf_source`), or None."""
    if weights not in (None, *WEIGHTS):
        raise GooseError(f"unknown weights '{weights}'; choose one of: {', '.join(WEIGHTS)}")
    if weights == "float32":
        return None, None
    if src is None:
        why = "the model is not a single GGUF file (a .gguf path or smollm2-135m)"
    elif dtype != torch.float32 or device.type != "cpu":
        why = "GGUF blocks run in float32 on the CPU only"
    elif kernels_or_none() is None:
        why = f"goose's quantized kernels cannot run here ({unavailable_reason()})"
    else:
        return src, None
    if weights == "gguf":
        raise GooseError(f"--weights gguf: {why}")
    return None, (why if src is not None else None)


def weights_kind(model) -> str:
    """What a model multiplies with, for reports: ``gguf (Q4_1, Q8_0)`` when it holds GGUF blocks (their
    formats), else its parameters' dtype (``float32``)."""
    fmts = sorted({m.weight.fmt for m in model.modules() if isinstance(getattr(m, "weight", None), QuantWeight)})
    if fmts:
        return f"gguf ({', '.join(fmts)})"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def load_gguf_model(path: Path, source: Path | None, weights: str | None, dtype: torch.dtype, device: torch.device,
                    attn_implementation: str):
    """`load_model`'s ``weights``: "gguf" (the GGUF blocks, `use_gguf_weights`), "float32" (the dequantized
    weights), or None: "gguf" where it applies (a single-file GGUF source of a supported architecture, float32
    on CPU, the kernels available here), else float32 with a one-line notice for a GGUF source.

    Returns the model with its blocks in place, or None when the weights are to be float32 (the caller loads
    them). The model is built on the meta device and only its small float32 tensors (norms, biases, anything
    the file does not hold in a supported format) are read from the dequantized copy in `path`, so the
    float32 projections are never materialised. An explicit "gguf" that cannot be honoured raises."""
    src, why = _resolve(source, weights, dtype, device)
    if src is not None:
        try:
            return _meta_load(path, src, attn_implementation)
        except GooseError as exc:
            if weights == "gguf":
                raise
            why = str(exc)
    if why:
        _notice(f"using float32 weights: {why}")
    return None


def _meta_load(path: Path, gguf: Path, attn_implementation: str):
    from transformers import AutoConfig

    from ..loading.stream import stream_load

    cfg = AutoConfig.from_pretrained(path)
    if getattr(cfg, "model_type", None) not in ARCHITECTURES:
        raise GooseError(f"GGUF weights are implemented for {', '.join(ARCHITECTURES)}, not '{cfg.model_type}'")
    return stream_load(path, attn_implementation, prepare=lambda net: use_gguf_weights(net, gguf, check=False))
