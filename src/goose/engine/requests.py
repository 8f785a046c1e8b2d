"""What the engine and the front ends share about a request: its result, stop tokens, context limit, prompt
encoding, options and streamed text, and the default forward for a model."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields

import torch

from ..backends.forward import HFForward
from ..backends.lean import ARITHS, LeanForward
from ..backends.lean import unsupported_reason as lean_unsupported_reason
from ..config import DecodeConfig
from ..errors import GooseError
from ..loading.model import model_arith
from .stats import Stats


@dataclass
class GenerationResult:
    text: str | None
    token_ids: list[int]  # generated tokens only (a stop token, if reached, is the last one)
    stats: Stats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


def eos_ids(model, tokenizer=None) -> set[int]:
    """Every stop token id of the model's generation config (falling back to config / tokenizer)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    return id_set(ids)


def id_set(ids) -> set[int]:
    """Token ids given as None, one id, a list / tuple / set, or a tensor, as a set."""
    if ids is None:
        return set()
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    return {int(i) for i in (ids if isinstance(ids, (list, tuple, set, frozenset)) else [ids])}


def context_limit(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {arith: its LeanForward}


def check_arith(arith: str) -> str:
    if arith not in ARITHS:
        raise GooseError(f"unknown arith '{arith}'; choose one of: {', '.join(ARITHS)}")
    return arith


def default_forward(model, arith: str | None = None):
    """The fast Llama-family forward where it applies (on a CUDA model: `GPUForward`, see `_gpu_forward`), else
    the generic Hugging Face one, in arithmetic `arith` ("exact" or "int8"; None: the model's own,
    `model_arith`). "int8" runs only on the Llama-family
    forward over GGUF blocks: anything else is refused (float32 weights are never quantized here).

    A LeanForward's packed weight copies are made once per (model, arith) and shared by every Decoder and
    Engine of the model in that arithmetic;
    each request decodes on a KV cache of its own (`forward.new_cache()`), so requests never see each
    other's state. When the model's weights changed since they were packed (`forward.stale()`), a new
    forward is built: nothing decodes with old weights."""
    arith = check_arith(model_arith(model) if arith is None else arith)
    if next(model.parameters()).device.type == "cuda":
        return _gpu_forward(model, arith)
    reason = lean_unsupported_reason(model)
    if reason is not None:
        if arith != "exact":
            raise GooseError(f'arith="{arith}" runs on goose\'s Llama-family forward, which cannot run this model '
                             f'({reason}); use arith="exact"')
        return HFForward(model)
    forwards = _SHARED.setdefault(model, {})
    fwd = forwards.get(arith)
    if fwd is None or fwd.stale():
        fwd = forwards[arith] = LeanForward(model, arith=arith)
    return fwd


def _gpu_forward(model, arith: str):
    """A CUDA model's default forward: goose's `GPUForward` in bfloat16 with CUDA graphs (docs/gpu.md: its
    modes and what each guarantees; pass ``forward=GPUForward(model, mode="fixed")`` for the mode whose rows
    do not depend on the forward's size), one per model, rebuilt when the weights change; Hugging Face's
    forward for an architecture it does not run."""
    from ..backends.cuda import GPUForward, unsupported_reason

    if arith != "exact":
        raise GooseError(f'arith="{arith}" is goose\'s CPU arithmetic; on a GPU the forward\'s mode chooses it '
                         f'(docs/gpu.md)')
    if unsupported_reason(model) is not None:
        return HFForward(model)  # (another architecture: Hugging Face's own forward, as on the CPU)
    forwards = _SHARED.setdefault(model, {})
    fwd = forwards.get("gpu")
    if fwd is None or fwd.stale():
        fwd = forwards["gpu"] = GPUForward(model)
    return fwd


def pick_forward(model, forward, arith: str | None):
    """(forward, arith) for a Decoder or Engine given `forward` and `arith` (either may be None): a given
    forward must compute in the given arithmetic; without one, `default_forward(model, arith)`."""
    if forward is None:
        fwd = default_forward(model, arith)
        return fwd, fwd.arith
    have = forward.arith
    if arith is not None and check_arith(arith) != have:
        raise GooseError(f'the forward given computes in arith="{have}", not "{arith}": build it with '
                         f'arith="{arith}" or leave out one of the two')
    return forward, have


def encode(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of a text prompt; with `chat`, of a one-message user conversation in the tokenizer's chat
    template, ready for the assistant's answer."""
    if tokenizer is None:
        raise GooseError("a tokenizer is needed to encode text prompts")
    if not prompt.strip():
        raise GooseError("the prompt is empty")
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(prompt)["input_ids"]


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation (``[{"role": ..., "content": ...}, ...]``) in the tokenizer's chat template,
    ready for the assistant's answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise GooseError("--chat needs a tokenizer with a chat template, and this one has none")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def decode_config(options: dict) -> DecodeConfig:
    """Per-request options (DecodeConfig fields) checked and parsed."""
    names = [f.name for f in fields(DecodeConfig)]
    unknown = set(options) - set(names)
    if unknown:
        raise GooseError(f"unknown option(s) {', '.join(sorted(unknown))}; the options are the DecodeConfig "
                         f"fields: {', '.join(names)}")
    return DecodeConfig(**options)
