"""The small model folder of a GGUF file, for loads that keep its quantized blocks (``weights="gguf"``).

A model that runs on the GGUF's blocks needs, besides the packed panels (`goose.loading.gguf`), only its
config, its tokenizer and its few float32 tensors (the norms, biases and any matrix in a format goose has no
kernel for). `blocks_dir` writes exactly those, from one read of the file's header, into
``$XDG_CACHE_HOME/goose/models/blocks/<stem>-<sha256[:16]>-<code hash>/``: ``config.json``,
``generation_config.json``, the tokenizer's files and ``small.safetensors`` (a few hundred KB; no float32 copy
of the matrices is ever made). The folder is written to a temporary name and renamed into place under a lock
(`goose.cachefs`); ``goose-source.json`` records the GGUF's sha256, and ``goose-digest.json``, written last,
the digest of every file (`cachefs.seal_dir`): a folder whose files do not all match it is built again.

The config and tokenizer are the ones transformers makes from the same file (``from_pretrained(...,
gguf_file=...)``); tests/test_startup.py checks they are byte-identical, and the tensors are dequantized by
the `gguf` package as transformers' own GGUF loader does.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import torch

from .. import cachefs
from ..errors import GooseError
from ..paths import cache_root
from ..progress import note
from .gguf_file import _LAYER_NAMES as PROJECTIONS
from .gguf_file import check_architecture

FOLDER_FORMAT = 2  # bumped when what the folder holds changes
BLOCKS_DIR = "blocks"
SMALL_FILE = "small.safetensors"
RECORD = "goose-source.json"

# GGUF tensor name -> Hugging Face parameter name (per layer: "blk.{i}." -> "model.layers.{i}.")
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
_LAYER_NAMES = {**PROJECTIONS, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor of the Llama family, or None when it has none here."""
    stem, dot, kind = gguf_name.rpartition(".")
    if not dot or kind not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    return None


def _code_hash() -> str:
    """What the folder's bytes depend on besides the GGUF: this module, the GGUF reader and name map it uses
    (`goose.loading.gguf`) and the transformers version."""
    import transformers

    h = hashlib.sha1(f"{FOLDER_FORMAT}|{transformers.__version__}|".encode())
    for src in (Path(__file__), Path(__file__).with_name("gguf.py")):
        h.update(src.read_bytes())
    return h.hexdigest()[:12]


def folder_key(gguf: Path, digest: str) -> str:
    return f"{gguf.stem}-{digest[:16]}-{_code_hash()}"


def valid(folder: Path, key: str) -> bool:
    """True when `folder` is whole (every file matches its digest, `cachefs.check_dir`) and its record names
    `key`. Raises `cachefs.UnsafeCache` for a folder another user owns or may write."""
    if not folder.is_dir() or cachefs.check_dir(folder) is not None:
        return False
    try:
        record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
        return record.get("key") == key and record.get("format") == FOLDER_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def blocks_dir(gguf: Path, digest: str) -> Path:
    """The small folder of `gguf` (whose content has sha256 `digest`), built on first use (see the module
    doc); raises GooseError for a file whose architecture or tensors it cannot describe."""
    key = folder_key(gguf, digest)
    target = cache_root() / "models" / BLOCKS_DIR / key
    if valid(target, key):
        return target
    with cachefs.lock(target):
        if valid(target, key):  # built by another process while this one waited
            return target
        cachefs.clean_stale(target.parent)
        meta, names = _metadata(gguf)
        cfg_dict = gguf_config(meta, names)  # (raises for an architecture goose keeps no blocks of)
        scratch = cachefs.temp_path(target)
        scratch.mkdir(parents=True)
        try:
            if target.exists():
                note(f"{target} is damaged: reading the config, tokenizer and norms of {gguf.name} again")
            else:
                note(f"first use of {gguf.name}: reading its config, tokenizer and norms into {target} (once)")
            build(gguf, scratch, cfg_dict)
            record = {"key": key, "format": FOLDER_FORMAT, "gguf": str(gguf), "bytes": gguf.stat().st_size,
                      "sha256": digest}
            (scratch / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
            cachefs.seal_dir(scratch)
            cachefs.replace_dir(scratch, target)
        finally:
            cachefs.remove(scratch)
        for old in target.parent.glob(f"{gguf.stem}-{digest[:16]}-*"):  # this content under older code
            if old != target and not old.name.endswith(".lock") and cachefs.TMP_TAG not in old.name:
                cachefs.remove(old)
    return target


class UnreadableGGUF(GooseError):
    """The file is not a GGUF file goose can read (no loader would read it either)."""


def _metadata(gguf: Path) -> tuple[dict, tuple]:
    """The file's metadata (arrays of strings as their length) and tensor names, as transformers reads them."""
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        return read_gguf_metadata(str(gguf))
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise UnreadableGGUF(f"cannot read GGUF file {gguf}: {exc}") from exc


def build(gguf: Path, out: Path, cfg_dict: dict | None = None) -> None:
    """Write the config, generation config, tokenizer and small tensors of `gguf` into the folder `out`."""
    from safetensors.torch import save_file
    from transformers import CONFIG_MAPPING, GenerationConfig

    from .gguf_file import read_gguf

    if cfg_dict is None:
        cfg_dict = gguf_config(*_metadata(gguf))
    cfg = CONFIG_MAPPING[cfg_dict["model_type"]].from_dict(cfg_dict)
    cfg.architectures = [_CAUSAL_LM[cfg.model_type]]
    cfg.dtype = torch.float32
    cfg.save_pretrained(out)
    GenerationConfig.from_model_config(cfg).save_pretrained(out)
    _tokenizer(gguf, cfg.model_type).save_pretrained(out)
    _, tensors = read_gguf(gguf)
    save_file(small_tensors(gguf, tensors, cfg), str(out / SMALL_FILE))


_CAUSAL_LM = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def gguf_config(meta: dict, tensor_names) -> dict:
    """The config dict transformers' GGUF loader derives from this metadata (its mapping tables, for the
    architectures goose keeps blocks of); raises GooseError for others."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    arch = check_architecture(meta)
    if arch == "llama" and meta.get("general.name") == "mistral":  # (transformers reads this as Mistral)
        raise GooseError("a GGUF file named 'mistral' loads as Mistral, which goose does not keep blocks of")
    mapping = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    cfg: dict = {"tie_word_embeddings": "output.weight" not in set(tensor_names)}
    for key, value in meta.items():
        prefix, _, rest = key.partition(".")
        renamed = mapping.get(prefix, {}).get(rest)
        if renamed is None or renamed == -1:
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        cfg[renamed] = value
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in meta:
        tokens = meta["tokenizer.ggml.tokens"]
        cfg["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    return cfg


def _tokenizer(gguf: Path, model_type: str):
    """The tokenizer `AutoTokenizer.from_pretrained(..., gguf_file=...)` gives (for Llama files the
    tokenizers backend it picks, without its second full parse of the file)."""
    if model_type == "llama":
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(gguf.parent, gguf_file=gguf.name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def small_tensors(gguf: Path, tensors: dict, cfg) -> dict[str, torch.Tensor]:
    """Every tensor of the file that goose's quantized kernels do not keep as blocks (float tensors and
    formats without a kernel), dequantized to float32 under its Hugging Face name (llama's q/k rows in
    Hugging Face's order, as transformers' loader permutes them)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from ..backends.quant import FORMATS
    from .gguf_file import _permutation, tensor_bytes

    llama = cfg.model_type == "llama"
    out = {}
    for t in tensors.values():
        if t.type in FORMATS:
            continue
        name = hf_name(t.name)
        if name is None:
            raise GooseError(f"GGUF tensor {t.name} has no place in a {cfg.model_type} model here")
        shape = list(reversed(t.shape))
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        value = dequantize(tensor_bytes(gguf, t, rows), GGMLQuantizationType[t.type]).astype(np.float32)
        value = value.reshape(shape)
        heads = None
        if llama and ".attn_q." in t.name:
            heads = cfg.num_attention_heads
        elif llama and ".attn_k." in t.name:
            heads = cfg.num_key_value_heads
        if heads:
            value = value[_permutation(value.shape[0], heads)]
        out[name] = torch.from_numpy(np.ascontiguousarray(value))
    return out
