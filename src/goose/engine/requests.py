"""What the engine and the front ends share about a request: its result, stop tokens, context limit, prompt
encoding, options and streamed text, and the default forward for a model."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields

import torch

from ..backends.forward import HFForward
from ..backends.lean import LeanForward
from ..backends.lean import supports as lean_supports
from ..config import DecodeConfig
from ..errors import GooseError
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
    """Token ids given as None, one id, a list / tuple, or a tensor, as a set."""
    if ids is None:
        return set()
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    return {int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])}


def context_limit(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def default_forward(model):
    """The fast Llama-family forward where it applies, else the generic Hugging Face one.

    A LeanForward's packed weight copies are made once per model and shared by every Decoder and Engine of
    the model;
    each request decodes on a KV cache of its own (`forward.new_cache()`), so requests never see each
    other's state. When the model's weights changed since they were packed (`forward.stale()`), a new
    forward is built: nothing decodes with old weights."""
    if not lean_supports(model):
        return HFForward(model)
    fwd = _SHARED.get(model)
    if fwd is None or fwd.stale():
        fwd = _SHARED[model] = LeanForward(model)
    return fwd


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


def text_pieces(blocks, decode):
    """Text pieces for token blocks as they come: each piece is the new suffix of ``decode(all tokens so far)``;
    a piece is held back while the text ends inside a multi-byte character. The pieces concatenate to the
    decoded text of all tokens. Returns (as the generator's value) the tokens and that text."""
    out: list[int] = []
    shown = ""
    for block in blocks:
        out.extend(block)
        text = decode(out)
        if not text.endswith("\ufffd") and text.startswith(shown) and len(text) > len(shown):
            yield text[len(shown):]
            shown = text
    text = decode(out)
    if text != shown and text.startswith(shown):
        yield text[len(shown):]
    return out, text
