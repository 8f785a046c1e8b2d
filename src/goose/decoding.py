"""The step loop and the public `Decoder` / `generate` API.

Every method runs through the same recipe each step:
  1. draft + build   the method returns a DraftTree rooted at the anchor
  2. tensorize        ancestor mask and depths (cached per topology; none for chains)
  3. forward          one target pass over the tree on top of the KV cache
  4. verify           walk: the longest path whose tokens the target picks (argmax or sample), plus its next token
  5. compact KV       keep the prefix, the root and the accepted path
  6. harvest          the method learns from the logits of every verified node
  7. commit           accepted tokens + bonus (cut at the first stop token and at max_new_tokens)
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, fields

import torch

from .config import DecodeConfig, GooseConfig
from .selection.costmodel import BatchCostCurve, CostCurve
from .engine.step import Slot, step
from .errors import GooseError
from .backends.forward import HFForward
from .backends.lean import LeanForward
from .backends.lean import supports as lean_supports
from .engine.methods import Method, make_method
from .engine.stats import Stats
from .engine.sampling import Chooser


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


class Decoder:
    """A model, a method and its configuration; reusable across requests (not thread-safe)."""

    def __init__(self, model, tokenizer=None, method: str | Method = "goose", config: GooseConfig | None = None,
                 forward=None, cost: CostCurve | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        vocab = model.get_output_embeddings().weight.shape[0]
        self.method = method if isinstance(method, Method) else make_method(method, vocab, config, cost)
        self._own_forward = forward is None
        self.forward = forward if forward is not None else default_forward(model)
        self.method.prepare(model, self.forward, tokenizer)
        self.eos = eos_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        self._live = 0  # requests of this decoder being decoded (paused streams included)

    def _fresh_forward(self):
        """The forward, checked against the model's current weights: a forward this decoder chose is rebuilt
        after the weights change; one the caller passed in is refused (it holds copies of old weights)."""
        stale = getattr(self.forward, "stale", None)
        if stale is not None and stale():
            if not self._own_forward:
                raise GooseError("the model's weights changed since this forward packed them: build a new forward "
                                 "(or let the Decoder choose one) to decode with the current weights")
            self.forward = default_forward(self.model)
        return self.forward

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        return encode(self.tokenizer, prompt, chat)

    def _request(self, prompt: str | list[int], chat: bool, options: dict) -> tuple[list[int], DecodeConfig]:
        ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
        return ids, decode_config(options)

    def _text(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, chat: bool = False, *,
                 streamer=None, **options) -> GenerationResult:
        """Generate for one prompt (text or token ids). `options` are DecodeConfig fields (do_sample,
        temperature, top_k, top_p, seed, prefill_chunk). `streamer`: a Hugging Face streamer (TextStreamer,
        TextIteratorStreamer, ...) that receives the prompt ids, then each accepted block, then end()."""
        ids, cfg = self._request(prompt, chat, dict(options, max_new_tokens=max_new_tokens))
        on_tokens = None
        if streamer is not None:
            streamer.put(torch.tensor(ids))
            on_tokens = lambda block: streamer.put(torch.tensor(block))  # noqa: E731
        try:
            out, stats = self.generate_ids(ids, cfg, on_tokens=on_tokens)
        finally:
            if streamer is not None:
                streamer.end()
        return GenerationResult(self._text(out), out, stats)

    def stream(self, prompt: str | list[int], max_new_tokens: int = 128, chat: bool = False,
               **options) -> "TextStream":
        """Iterate over text pieces as they are accepted; afterwards `.result` holds the GenerationResult.
        The pieces concatenate to exactly the text `generate` returns."""
        if self.tokenizer is None:
            raise GooseError("streaming text needs a tokenizer")
        ids, cfg = self._request(prompt, chat, dict(options, max_new_tokens=max_new_tokens))
        return TextStream(self, ids, cfg)

    def generate_ids(self, prompt: list[int], cfg: DecodeConfig = DecodeConfig(), chooser: Chooser | None = None,
                     stop=None, on_tokens=None, eos: set[int] | None = None) -> tuple[list[int], Stats]:
        """Token ids in, generated token ids and stats out.

        chooser: how each token is picked (default: from `cfg`, greedy or sampling). stop(tokens) -> bool is
        asked after every generated token (tokens = all generated so far) and ends generation there, like the
        stop tokens. on_tokens(block) receives each committed block as it is accepted. eos: the stop token ids
        (default: the model's).
        """
        out: list[int] = []
        stats = Stats(prompt_tokens=len(prompt))
        for block in self._decode(prompt, cfg, chooser or Chooser.for_config(cfg, self.device), stop, stats,
                                  self.eos if eos is None else eos):
            out.extend(block)
            if on_tokens is not None:
                on_tokens(block)
        return out, stats

    def _decode(self, prompt: list[int], cfg: DecodeConfig, chooser: Chooser, stop, stats: Stats, eos: set[int]):
        """The step loop (`engine.step`) on a batch of one; yields each committed block of tokens and fills
        `stats`. Every request decodes on a KV cache of its own; a request that starts while another one of
        this decoder is paused (an unfinished stream) gets its own copy of the method's per-request state."""
        fwd = self._fresh_forward()
        method = self.method if not self._live else self.method.fork()
        slot = Slot(list(prompt), cfg, method, fwd.new_cache(), eos, context_limit(self.model), chooser, stop, stats=stats)
        cost = getattr(method, "cost", None)
        cost = None if cost is None else BatchCostCurve.single(cost)
        self._live += 1
        try:
            slot.begin()
            while not slot.done:
                step(fwd, [slot], cost)
                if slot.new:
                    yield slot.new
        finally:
            self._live -= 1
        stats.wall_time_s = time.perf_counter() - slot.t0


class TextStream:
    """Iterator of text pieces for one request (see Decoder.stream). A piece is held back while the text
    ends inside a multi-byte character; each piece is the new suffix of the decoded text."""

    def __init__(self, decoder: Decoder, prompt: list[int], cfg: DecodeConfig) -> None:
        self.decoder, self.prompt, self.cfg = decoder, prompt, cfg
        self.result: GenerationResult | None = None

    def __iter__(self):
        dec = self.decoder
        stats = Stats(prompt_tokens=len(self.prompt))
        chooser = Chooser.for_config(self.cfg, dec.device)
        out, text = yield from text_pieces(dec._decode(self.prompt, self.cfg, chooser, None, stats, dec.eos), dec._text)
        self.result = GenerationResult(text, out, stats)


def generate(model, tokenizer, prompt_or_ids: str | list[int], method: str = "goose", max_new_tokens: int = 128,
             chat: bool = False, config: GooseConfig | None = None, streamer=None, **options) -> GenerationResult:
    """One-shot convenience: build a Decoder and generate (options: do_sample, temperature, top_k, top_p,
    seed). Reuse a `Decoder` for many requests: it keeps the method's learned state and cost curve."""
    return Decoder(model, tokenizer, method, config).generate(prompt_or_ids, max_new_tokens, chat,
                                                              streamer=streamer, **options)
