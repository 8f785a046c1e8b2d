"""GGUF files: read their tensor table (`read_gguf`, `tensor_bytes`) and load a model on their quantized blocks.

`use_gguf_weights` packs each supported tensor once into goose's panel layout (`goose.backends.quant`'s
kernels) and swaps the model's `nn.Linear` / `nn.Embedding` modules for `PackedLinear` / `PackedEmbedding`;
`load_gguf_model` builds the model on the meta device and streams the rest of its weights (`stream_load`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from .. import cachefs
from ..backends.packed import PackedEmbedding, PackedLinear, fuse_layers
from ..backends.quant import (
    FORMATS,
    PANEL,
    QuantKernels,
    QuantWeight,
    kernels_or_none,
    runnable_variants,
    unavailable_reason,
)
from ..errors import GooseError
from ..paths import cache_root
from ..progress import note
from .digest import file_sha256
from .gguf_file import (  # noqa: F401  (re-exported: the reader is part of this module's API)
    _LAYER_NAMES,
    ARCHITECTURES,
    GGUFTensor,
    _permutation,
    check_architecture,
    read_gguf,
    tensor_bytes,
)
from .stream import stream_load

# ---- GGUF -> model --------------------------------------------------------------------------------------

def _notice(msg: str) -> None:
    print(f"goose: {msg}", file=sys.stderr)


def use_gguf_weights(model, gguf: Path, kernels: QuantKernels | None = None, check: bool = True) -> dict:
    """Replace `model`'s projections, embedding and output head by the GGUF file's quantized blocks (where
    the file holds them in a supported format); returns ``{"packed": [...names], "float32": [...], "bytes": n,
    "skipped": [...formats without a kernel]}``.

    The model must be the one transformers loads from this file (config, names, shapes). With `check`, the
    first rows of every tensor are compared with the model's float32 weights before those are released: any
    difference (a mapping this function got wrong) raises instead of giving other weights. Types without a
    kernel (F16, Q5_K, ...) keep their float32 weights, with a one-line notice."""
    kern = kernels or kernels_or_none()
    if kern is None:
        raise GooseError(f"goose's quantized kernels cannot run here: {unavailable_reason()}")
    meta, tensors = read_gguf(Path(gguf))
    arch = check_architecture(meta)
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
    done["skipped"] = sorted(skipped)
    return done


WEIGHTS = ("gguf", "float32")


def _resolve(src: Path | None, weights: str | None, dtype: torch.dtype,
             device: torch.device) -> tuple[Path | None, str | None]:
    """(the GGUF file, None) when `weights` may resolve to GGUF blocks; (None, why not) otherwise (why: None when
    nothing needs saying). `src`: the model's single GGUF file (`model.gguf_source`), or None. Whether the
    kernels load here is asked later (`_kernels_here`), so that their first compiling overlaps the file's
    first reading."""
    if weights not in (None, *WEIGHTS):
        raise GooseError(f"unknown weights '{weights}'; choose one of: {', '.join(WEIGHTS)}")
    if weights == "float32":
        return None, None
    if src is None:
        why = "the model is not a single GGUF file (a .gguf path or smollm2-135m)"
    elif dtype != torch.float32 or device.type != "cpu":
        why = "GGUF blocks run in float32 on the CPU only"
    elif not runnable_variants():
        why = f"goose's quantized kernels cannot run here ({unavailable_reason()})"
    else:
        return src, None
    if weights == "gguf":
        raise GooseError(f"--weights gguf: {why}")
    return None, (why if src is not None else None)


def _kernels_here() -> str | None:
    if kernels_or_none() is not None:
        return None
    return f"goose's quantized kernels cannot run here ({unavailable_reason()})"


def load_gguf_model(source: Path | None, weights: str | None, dtype: torch.dtype, device: torch.device,
                    attn_implementation: str):
    """`load_model`'s ``weights``: "gguf" (the GGUF blocks, `use_gguf_weights`), "float32" (the dequantized
    weights), or None: "gguf" where it applies (a single-file GGUF source of a supported architecture, float32
    on CPU, the kernels available here), else float32 with a one-line notice for a GGUF source.

    Returns ``(model, folder)``: the model with its blocks in place and the small folder holding its config,
    tokenizer and float32 tensors (`goose.loading.gguf_folder`); or None when the weights are to be float32
    (the caller loads them from the dequantized copy). The model is built on the meta device, so float32
    projections are never materialised. An explicit "gguf" that cannot be honoured raises."""
    from .gguf_folder import UnreadableGGUF

    src, why = _resolve(source, weights, dtype, device)
    if src is not None:
        try:
            return _meta_load(src, attn_implementation)
        except (UnreadableGGUF, cachefs.UnsafeCache):
            raise  # (float32 weights would not be read from it either; an unsafe cache is refused, not avoided)
        except GooseError as exc:
            if weights == "gguf":
                raise
            why = str(exc)
    if why:
        _notice(f"using float32 weights: {why}")
    return None


def _meta_load(gguf: Path, attn_implementation: str):
    from .gguf_folder import blocks_dir

    digest = file_sha256(gguf)  # (once per file version: remembered in the cache)
    folder = blocks_dir(gguf, digest)
    why = _kernels_here()  # (waits for a first compiling, started by load_model)
    if why is not None:
        raise GooseError(why)
    try:
        net = stream_load(folder, attn_implementation,
                          prepare=lambda net: cached_gguf_weights(net, gguf, digest=digest))
    except cachefs.UnsafeCache:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # damaged from outside goose
        raise GooseError(f"cannot load the model in {folder}: {exc}") from exc
    net.config._name_or_path = str(gguf)  # (the source, not the cache folder whose name changes with goose)
    return net, folder


# ---- the packed panels, kept on disk --------------------------------------------------------------------
# `cached_gguf_weights` keeps what `use_gguf_weights` packs (and fuses) in one file per GGUF content and
# packing code, ``models/panels/<stem>-<sha256[:16]>-<code hash>.bin``, so a warm load reads the panels back
# with one read instead of packing again. The file: PANEL_MAGIC, the header's length (u64), a JSON header
# (which modules, formats, shapes and byte ranges), zero padding to PANEL_ALIGN, then each buffer at a
# multiple of PANEL_ALIGN. Written atomically under a lock (`cachefs`), with its digest beside it
# (``<name>.bin.digest``); checked on read against the digest (`cachefs.check_file`, on the bytes just read),
# the header, the model and the kernels' sizes, and rebuilt when anything does not match.

PANEL_MAGIC = b"GOOSEPNL"
PANEL_FORMAT = 1  # bumped when the file layout changes
PANEL_ALIGN = 64
PANEL_DIR = "panels"


def _code_hash(kern: QuantKernels) -> str:
    """What the packed bytes depend on besides the GGUF: the file layout, this module's mapping and the
    kernel source that packs (and its instruction-set variant)."""
    from ..backends import quant

    h = hashlib.sha1(f"{PANEL_FORMAT}|{kern.variant}|".encode())
    for src in (Path(__file__), quant.SOURCE):
        h.update(src.read_bytes())
    return h.hexdigest()[:12]


def panel_cache_path(gguf: Path, kern: QuantKernels, digest: str | None = None) -> Path:
    """Where the packed panels of `gguf` are kept (named by its content's sha256 `digest`, else hashed once per
    file version, `goose.loading.model.file_sha256`)."""

    digest = digest or file_sha256(gguf)
    return cache_root() / "models" / PANEL_DIR / f"{gguf.stem}-{digest[:16]}-{_code_hash(kern)}.bin"


def cached_gguf_weights(model, gguf: Path, kernels: QuantKernels | None = None, digest: str | None = None) -> dict:
    """`use_gguf_weights` (without the float32 check: `model` is on the meta device), read from the panel
    cache when it holds a valid entry for this file, else packed and written there for the next load."""
    kern = kernels or kernels_or_none()
    if kern is None:
        raise GooseError(f"goose's quantized kernels cannot run here: {unavailable_reason()}")
    gguf = Path(gguf)
    path = panel_cache_path(gguf, kern, digest)
    done = _read_panels(model, path, kern, gguf.name)
    if done is not None:
        return done
    with cachefs.lock(path):
        done = _read_panels(model, path, kern, gguf.name)  # written by another process while this one waited
        if done is not None:
            return done
        if path.exists():
            note(f"the packed panels in {path} are damaged; packing the blocks of {gguf.name} again")
        else:
            note(f"first use of {gguf.name} here: packing its blocks into goose's panels (once per file and kernel)")
        done = use_gguf_weights(model, gguf, kern, check=False)
        if not _packed_modules(model):
            return done  # (nothing in a format with a kernel: nothing to keep)
        try:
            _write_panels(model, path, done)
        except OSError as exc:  # a full or read-only cache: this load works, the next one packs again
            _notice(f"cannot keep the packed weights in {path.parent} ({exc.strerror or exc})")
    return done


def _packed_modules(model) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, (PackedLinear, PackedEmbedding)) and isinstance(m.weight, QuantWeight)]


def _write_panels(model, path: Path, done: dict) -> None:
    """Write the packed weights of `model` to `path` atomically (the caller holds its lock); older entries
    of the same GGUF file name are removed."""
    buffers: list[torch.Tensor] = []
    where: dict[int, int] = {}  # data_ptr of a buffer -> its index
    weights = []
    for name, mod in _packed_modules(model):
        w = mod.weight
        base = w.data if w.data._base is None else w.data._base
        if base.data_ptr() not in where:
            where[base.data_ptr()] = len(buffers)
            buffers.append(base)
        weights.append({"module": name, "kind": "embedding" if isinstance(mod, PackedEmbedding) else "linear",
                        "fmt": w.fmt, "n": w.n, "k": w.k, "buffer": where[base.data_ptr()],
                        "offset": w.data.data_ptr() - base.data_ptr(), "nbytes": w.nbytes})
    spans, at = [], 0
    for b in buffers:
        size = b.numel() * b.element_size()
        spans.append({"offset": at, "nbytes": size})
        at += -(-size // PANEL_ALIGN) * PANEL_ALIGN
    header = json.dumps({"format": PANEL_FORMAT, "name": path.name, "buffers": spans, "weights": weights,
                         "done": done}).encode()
    start = -(-(len(PANEL_MAGIC) + 8 + len(header)) // PANEL_ALIGN) * PANEL_ALIGN
    cachefs.make_dirs(path.parent)
    cachefs.clean_stale(path.parent)
    tmp = cachefs.temp_path(path)
    try:
        with cachefs.open_new(tmp) as f:
            f.write(PANEL_MAGIC + len(header).to_bytes(8, "little") + header)
            f.write(bytes(start - f.tell()))
            for b, span in zip(buffers, spans):
                f.seek(start + span["offset"])
                f.write(memoryview(b.contiguous().view(torch.uint8).numpy()))
            f.truncate(start + at)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        cachefs.remove(tmp)
    cachefs.seal_file(path)
    same_file = path.name.rsplit("-", 1)[0]  # entries of this GGUF content packed by other versions of goose
    for old in path.parent.glob(f"{glob.escape(same_file)}-*.bin"):
        if old != path and len(old.name) == len(path.name):
            cachefs.remove_entry(old)


def _read_panels(model, path: Path, kern: QuantKernels, gguf_name: str) -> dict | None:
    """Put the panels kept at `path` into `model` (as `use_gguf_weights` with its fusing would) and return
    its summary; None when there is no entry, its bytes do not match its digest, or it does not match this
    file, this model or these kernels (then nothing in `model` has changed). Raises `cachefs.UnsafeCache` for
    an entry another user owns or may write."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            blob = torch.empty(size, dtype=torch.uint8)
            if f.readinto(memoryview(blob.numpy())) != size:
                return None
    except OSError:
        return None
    if cachefs.check_file(path, blob.numpy()) is not None:
        return None
    plan = _panel_plan(model, path, blob, kern)
    if plan is None:
        return None
    head, done, pieces = plan
    raw = blob.numpy()
    bufs = [torch.from_numpy(raw[head + b["offset"]: head + b["offset"] + b["nbytes"]])  # (own base: fusable)
            for b in pieces["buffers"]]
    made: dict[tuple, QuantWeight] = {}
    for e in pieces["weights"]:
        ref = (e["buffer"], e["offset"], e["nbytes"])
        if ref not in made:
            buf = bufs[e["buffer"]]
            whole = e["offset"] == 0 and e["nbytes"] == buf.numel()
            data = buf if whole else buf[e["offset"]: e["offset"] + e["nbytes"]]
            made[ref] = QuantWeight(kern, e["fmt"], e["n"], e["k"], data)
        parent, _, attr = e["module"].rpartition(".")
        old = model.get_submodule(e["module"])
        new = (PackedEmbedding(made[ref], old.padding_idx) if e["kind"] == "embedding"
               else PackedLinear(made[ref], old.bias))
        setattr(model.get_submodule(parent), attr, new)
    if done.get("skipped"):
        _notice(f"{gguf_name}: {', '.join(done['skipped'])} tensors have no quantized kernel; they run "
                "dequantized to float32")
    return done


def _panel_plan(model, path: Path, blob: torch.Tensor, kern: QuantKernels):
    """(data start, summary, header) when the entry in `blob` is whole and fits `model`; else None."""
    n0 = len(PANEL_MAGIC) + 8
    raw = bytes(blob[:n0].numpy())
    if len(raw) < n0 or raw[:len(PANEL_MAGIC)] != PANEL_MAGIC:
        return None
    length = int.from_bytes(raw[len(PANEL_MAGIC):], "little")
    if n0 + length > blob.numel():
        return None
    try:
        header = json.loads(bytes(blob[n0:n0 + length].numpy()))
        if header["format"] != PANEL_FORMAT or header["name"] != path.name:
            return None
        start = -(-(n0 + length) // PANEL_ALIGN) * PANEL_ALIGN
        spans, weights, done = header["buffers"], header["weights"], header["done"]
        end = 0
        for b in spans:
            if b["offset"] != end or b["nbytes"] <= 0:
                return None
            end += -(-b["nbytes"] // PANEL_ALIGN) * PANEL_ALIGN
        if start + end != blob.numel() or not weights:
            return None
        for e in weights:
            mod = model.get_submodule(e["module"])
            want = nn.Embedding if e["kind"] == "embedding" else nn.Linear
            if (type(mod) is not want or e["fmt"] not in FORMATS or tuple(mod.weight.shape) != (e["n"], e["k"])
                    or e["nbytes"] != kern.packed_bytes(e["fmt"], e["n"], e["k"])
                    or not 0 <= e["offset"] <= spans[e["buffer"]]["nbytes"] - e["nbytes"]):
                return None
        if not isinstance(done, dict) or not isinstance(done.get("packed"), list):
            return None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    return start, done, header
