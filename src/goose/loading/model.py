"""Loading models: a packaged one (SmolLM2-135M, the default; Gemma-3-270M), a local Hugging Face
directory, or a GGUF file.

Where a GGUF file's blocks are kept (`weights="gguf"`, the default where it applies), a first load writes only a
small folder (config, tokenizer, norms: `goose.loading.gguf_folder`) and the packed panels
(`goose.loading.gguf.cached_gguf_weights`) under the user cache directory (``$XDG_CACHE_HOME/goose/models``,
default ``~/.cache/goose/models``), so a warm load packs and converts nothing. Loads that need float32 weights
(``weights="float32"``, a Gemma GGUF, ...) dequantize the GGUF once into a safetensors copy there (`model_dir`).
A GGUF file's entries are named by the sha256 of its content (hashed once per path, size and mtime, and
recorded beside them in ``goose-source.json``), so two different files with one name never share one. Entries
are written atomically under a lock and carry the digest of their bytes, checked before each use (`cachefs`):
a damaged entry is built again, one another user owns or may write is refused.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import weakref
from pathlib import Path

import torch

from .. import cachefs
from ..errors import GooseError
from ..paths import cache_root, package_file  # noqa: F401  (re-exported)
from ..progress import note
from .digest import HASH_MEMO, _read_memo, file_sha256  # noqa: F401  (re-exported)
from .packaged import DEFAULT_MODEL, PACKAGED, Packaged  # noqa: F401  (re-exported)

SOURCE_RECORD = "goose-source.json"  # beside a dequantized model: which GGUF (path, size, sha256) it came from


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise GooseError(f"unknown dtype '{dtype}'; choose one of: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise GooseError(f"unknown device '{device}'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GooseError("device 'cuda' requested but no CUDA device is available")
    return dev


def packaged_gguf(name: str, workdir: Path) -> Path:
    """The GGUF of packaged model `name`: the shipped file, or one assembled into `workdir`."""
    spec = PACKAGED[name]
    what = f"model '{name}'"
    if spec.file is not None:
        return package_file(spec.package, spec.file, what, spec.install)
    if importlib.util.find_spec(spec.package) is None:
        raise GooseError(f"{what} needs the '{spec.package}' package: {spec.install}")
    pkg = importlib.import_module(spec.package)
    try:
        return Path(pkg.assemble(workdir / pkg.MODEL_NAME))
    except (OSError, ValueError, ImportError) as exc:  # missing chunk package, bad checksum
        raise GooseError(f"{what}: cannot assemble the GGUF ({exc}); reinstall with: {spec.install}") from exc


def _complete(target: Path) -> bool:
    """A cached model folder is used only when whole: every file matches its digest (`cachefs.check_dir`;
    folders are renamed into place once written, so this only fails for damage from outside goose or a
    folder of an older goose), its config parses and its weights are there. Raises `cachefs.UnsafeCache` for
    a folder another user owns or may write."""
    if not target.is_dir() or cachefs.check_dir(target) is not None:
        return False
    try:
        json.loads((target / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return any(target.glob("*.safetensors"))


def _dequantized_dir(gguf, key: str, source: dict | None = None) -> Path:
    """Directory holding the dequantized safetensors copy of `gguf` (a path, or a function of a scratch
    directory returning one), created on first use: written to a temporary folder beside it and renamed
    into place, under a lock, so concurrent first loads both succeed and a killed one leaves nothing used."""
    target = cache_root() / "models" / key
    if _complete(target):
        return target
    with cachefs.lock(target):
        if _complete(target):  # another process made it while this one waited
            return target
        cachefs.clean_stale(target.parent)
        scratch = cachefs.temp_path(target)
        scratch.mkdir()
        try:
            tmp = scratch / "model"
            if target.exists():
                note(f"{target} is damaged (or written by an older goose): dequantizing '{key}' again")
            else:
                note(f"first use of '{key}': dequantizing its GGUF weights to float32 into {target} (once)")
            _dequantize(gguf if isinstance(gguf, Path) else gguf(scratch), tmp)
            (tmp / SOURCE_RECORD).write_text(json.dumps({"key": key, **(source or {})}, indent=2) + "\n",
                                             encoding="utf-8")
            cachefs.seal_dir(tmp)
            cachefs.replace_dir(tmp, target)
        finally:
            cachefs.remove(scratch)
    return target


def _prebuild_kernels() -> list:
    """Start loading goose's float32 and quantized kernels in background threads (compiled on first use, a
    compiler process each, under the kernel cache's lock), so a first run's compiling overlaps its imports and
    reading the model (a caller asking for a kernel meanwhile waits on that lock). Returns the threads."""
    import threading

    from ..backends import cpukernel, quant

    if not cpukernel.runnable_variants() or cpukernel.switched_off():
        return []
    builds = [threading.Thread(target=_quietly, args=(get,), daemon=True)
              for get in (quant.kernels, cpukernel.kernel)]
    for b in builds:
        b.start()
    return builds


def _quietly(get) -> None:
    """Run `get` in a prebuild thread: a kernel refused there (`cachefs.UnsafeCache`) is refused again, as one
    error line, by the load's own call."""
    try:
        get()
    except GooseError:
        pass


def _dequantize(gguf: Path, target: Path) -> None:
    """Write the dequantized float32 model and its tokenizer into the new folder `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _one_gguf_parse(gguf):
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for unreadable files
        raise GooseError(f"cannot read GGUF file {gguf}: {one_line(exc)}") from exc
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    tok.save_pretrained(target)


@contextlib.contextmanager
def _one_gguf_parse(path: Path):
    """Within the block, `gguf.GGUFReader` of `path` is one reader, built once: transformers builds one for the
    config, one for the tokenizer and one for the weights, and building one parses every vocabulary entry in
    Python (measured on a Zen 3 core: 25 s each for Gemma-3's 262k entries). The readers only read the file."""
    import gguf as gguf_module

    real = gguf_module.GGUFReader
    made: dict = {}

    def reader(file, *args, **kwargs):
        if args or kwargs or Path(file).resolve() != path.resolve():
            return real(file, *args, **kwargs)
        if "reader" not in made:
            made["reader"] = real(file)
        return made["reader"]

    gguf_module.GGUFReader = reader
    try:
        yield
    finally:
        gguf_module.GGUFReader = real


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _check_config(path: Path) -> None:
    """A Hugging Face model folder's config.json must be a JSON object naming a model type."""
    cfg_file = path / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise GooseError(f"{cfg_file} is not UTF-8 text") from None
    except ValueError as exc:
        raise GooseError(f"{cfg_file} is not valid JSON ({one_line(exc)})") from None
    except OSError as exc:
        raise GooseError(f"cannot read {cfg_file}: {exc.strerror}") from None
    if not isinstance(cfg, dict):
        raise GooseError(f"{cfg_file} must hold a JSON object")
    if not isinstance(cfg.get("model_type"), str) or not cfg["model_type"]:
        raise GooseError(f"{cfg_file} names no 'model_type'; is {path} a Hugging Face model folder?")


def model_dir(model: str) -> Path:
    """Resolve a model name, HF directory or .gguf file to a directory of HF weights."""
    if model in PACKAGED:
        return _dequantized_dir(lambda scratch: packaged_gguf(model, scratch), model)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise GooseError(f"GGUF file not found: {path}")
        path = path.resolve()
        digest = file_sha256(path)  # the content names the cached copy, not the file name
        return _dequantized_dir(path, f"{path.stem}-{digest[:16]}",
                                {"gguf": str(path), "bytes": path.stat().st_size, "sha256": digest})
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise GooseError(f"{path} is not a Hugging Face model directory (no config.json)")
        _check_config(path)
        return path
    raise GooseError(
        f"unknown model '{model}': give one of {', '.join(PACKAGED)}, a Hugging Face model directory, "
        f"or a .gguf file"
    )


def gguf_source(model: str) -> Path | None:
    """The GGUF file behind a model name or path, where goose can keep its blocks: a packaged model shipped as
    one file (smollm2-135m), or a .gguf path; None otherwise (a Hugging Face folder; gemma3-270m, whose file
    is assembled from chunk packages and whose architecture LeanForward does not run)."""
    if model in PACKAGED:
        spec = PACKAGED[model]
        return None if spec.file is None else package_file(spec.package, spec.file, f"model '{model}'", spec.install)
    path = Path(model).expanduser()
    return path.resolve() if path.suffix == ".gguf" and path.is_file() else None


def resolve_arith(arith: str, model: str, weights: str | None = None, device: str | None = "cpu",
                  dtype: str = "float32") -> str:
    """`arith` as `load_model` will run it, known before the load: "auto" is "int8" for a GGUF source kept as
    blocks (`gguf_source`; not ``weights="float32"``) in float32 on the CPU where goose's integer kernels run,
    else "exact" (an architecture goose's forward does not run is found only by the load: `load_model`'s
    "auto" then falls back to exact); "exact" and "int8" as they are."""
    if arith != "auto":
        return arith
    from ..backends import int8

    if (weights == "float32" or resolve_device(device).type != "cpu" or resolve_dtype(dtype) != torch.float32
            or gguf_source(model) is None):
        return "exact"
    return "int8" if int8.unavailable_reason() is None else "exact"


def load_model(model: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", device: str | None = "cpu",
               attn_implementation: str = "sdpa", weights: str | None = None, pack: bool = True,
               arith: str = "exact"):
    """Returns ``(model, tokenizer)`` ready for goose, in eval mode.

    `arith`: the arithmetic goose's forwards compute in for this model, recorded for it (`model_arith`;
    "auto": "int8" where goose's integer kernels run this model's GGUF blocks on the CPU, else "exact" (the
    command line's default: int8 was the faster on every CPU measured, docs/performance.md);
    `Decoder`, `Engine` and `goose serve` use it unless told otherwise). "exact" (default): float32 products
    of the weights' values, bit-identical to Hugging Face's float32 model. "int8": each row's activations are
    quantized to 8 bits in blocks of 32 and multiplied with the GGUF blocks in integers (`goose.backends.int8`);
    it needs GGUF blocks (`weights` "gguf") on a model goose's Llama-family forward runs, and is refused
    otherwise: float32 weights are never quantized here. Each is lossless against plain greedy decoding by
    goose in the same arithmetic.

    `weights` (GGUF sources): "gguf" keeps the file's quantized blocks and multiplies with them directly
    (`goose.backends.quant`: the same float32 weight values, bit-identical logits under `LeanForward`, ~1/5 of the
    memory reads); "float32" the dequantized weights; None (default) "gguf" where it applies, else float32.

    `pack` (float32 weights on a CPU where goose's kernel runs, models `LeanForward` runs): hold the projections
    and the output head once, as goose's float32 panels, read straight into them (`goose.loading.stream`,
    `goose.backends.packed.PanelPacker`; the model's `nn.Linear` modules become `PackedLinear`, so
    ``model.generate`` multiplies on goose's kernel too). False
    keeps Hugging Face's modules and kernels; goose's forward then packs a second copy of those weights."""
    dt, dev = resolve_dtype(dtype), resolve_device(device)
    # (started first: a first run compiles the kernels while transformers is imported and the file is read)
    builds = _prebuild_kernels() if dt == torch.float32 and dev.type == "cpu" else []
    try:
        from ..backends.forward import SUPPORTED_ATTENTION
        from ..backends.lean import ARITHS

        if attn_implementation not in SUPPORTED_ATTENTION:
            raise GooseError(f"attention implementation '{attn_implementation}' ignores custom tree masks; "
                             f"use one of {', '.join(SUPPORTED_ATTENTION)}")
        if arith not in (*ARITHS, "auto"):
            raise GooseError(f"unknown arith '{arith}'; choose one of: {', '.join((*ARITHS, 'auto'))}")
        if arith == "int8" and weights == "float32":
            raise GooseError(_INT8_NEEDS_BLOCKS)
        net, tok = _load(model, dt, dev, attn_implementation, weights, pack)
    finally:  # (no compiler left running behind an error: the kernels are kept for the next run)
        for b in builds:
            b.join()
    net.to(dev).eval()
    if pack:
        _pack_rest(net)
    if arith == "auto":  # int8 where goose's integer kernels run this model's GGUF blocks, else exact
        arith = "int8" if dev.type == "cpu" and _int8_unready(net) is None else "exact"
    elif arith != "exact":
        why = _int8_unready(net)
        if why is not None:
            raise GooseError(why)
    record_arith(net, arith)
    return net, tok


_ARITH: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> the arith it was loaded for


def record_arith(model, arith: str) -> None:
    """Record `arith` as the arithmetic goose's forwards use for `model` unless told otherwise."""
    _ARITH[model] = arith


def model_arith(model) -> str:
    """The arithmetic `model` was loaded for (`load_model(..., arith=...)`); "exact" for any other model."""
    return _ARITH.get(model, "exact")


def _load(model: str, dt: torch.dtype, dev: torch.device, attn_implementation: str, weights: str | None,
          pack: bool):
    """(model, tokenizer): on the GGUF's blocks (from its small folder, `goose.loading.gguf_folder`) where
    they apply, else from the float32 folder (`model_dir`, made on first use)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .gguf import load_gguf_model

    on_blocks = load_gguf_model(gguf_source(model), weights, dt, dev, attn_implementation)
    if on_blocks is not None:
        net, folder = on_blocks
        try:
            return net, AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise GooseError(f"cannot load the tokenizer in {folder}: {one_line(exc)}") from exc
    path = model_dir(model)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        net = _load_packed(path, dt, dev, attn_implementation) if pack else None
        if net is None:
            net = AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation=attn_implementation)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # a damaged or foreign folder
        raise GooseError(f"cannot load the model in {path}: {one_line(exc)}") from exc
    return net, tok


_INT8_NEEDS_BLOCKS = ('arith="int8" multiplies GGUF blocks and this model would hold float32 weights: load a GGUF '
                      'file or the packaged model with weights="gguf" (--weights gguf), or use arith="exact" '
                      '(float32 weights are never quantized behind your back)')


def _int8_unready(net) -> str | None:
    """Why goose's forward cannot run `net` in arith "int8", or None when it can."""
    from ..backends import int8, lean
    from ..backends.quant import QuantWeight

    reason = lean.unsupported_reason(net)
    if reason is not None:
        return (f'arith="int8" runs on goose\'s Llama-family forward, which cannot run this model ({reason}); '
                f'use arith="exact"')
    linears = [m for layer in net.model.layers
               for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    if not all(isinstance(m.weight, QuantWeight) for m in linears + [net.lm_head]):
        return _INT8_NEEDS_BLOCKS
    why = int8.unavailable_reason()
    return None if why is None else f'arith="int8": goose\'s integer kernels cannot run here ({why})'


def _load_packed(path: Path, dtype: torch.dtype, device: torch.device, attn_implementation: str):
    """`load_model`'s ``pack`` for float32 weights: the model with its projections and output head read
    straight into goose's panels (`goose.loading.stream`), or None where that does not apply (other dtypes
    and devices, no kernel here, a model `LeanForward` does not run, files the streamed load cannot read)."""
    from transformers import AutoConfig

    from ..backends import cpukernel, lean
    from ..backends.packed import PanelPacker
    from .stream import stream_load

    kern = cpukernel.kernel() if dtype == torch.float32 and device.type == "cpu" else None
    cfg = AutoConfig.from_pretrained(path) if kern is not None else None
    if (cfg is None or getattr(cfg, "model_type", None) not in lean.SUPPORTED_TYPES
            or getattr(cfg, "quantization_config", None)):  # (quantized checkpoints: transformers' own loader)
        return None
    try:
        return stream_load(path, attn_implementation, place=PanelPacker(kern))  # (q/k/v, gate/up land fused)
    except GooseError:  # (transformers' own loader knows more checkpoint layouts)
        return None


def _pack_rest(net) -> None:
    """Float32 projections still held as `nn.Linear` (transformers' loader, tensors a GGUF file keeps in float32)
    packed into panels in place, for the models `LeanForward` runs on goose's kernel."""
    from ..backends import cpukernel, lean
    from ..backends.packed import pack_float32

    p = next(net.parameters())
    kern = cpukernel.kernel() if p.dtype == torch.float32 and p.device.type == "cpu" else None
    if kern is not None and lean.supports(net) and any(type(m) is torch.nn.Linear for m in net.modules()):
        pack_float32(net, kern)
