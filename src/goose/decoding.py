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

import torch

from .config import DEFAULT_MEMORY_MB, DecodeConfig, GooseConfig, check_memory_mb
from .drafting.memory import SuffixMemory
from .engine.methods import Method, make_method
from .engine.requests import (  # noqa: F401  (re-exported: part of the public API)
    GenerationResult,
    context_limit,
    decode_config,
    default_forward,
    encode,
    encode_chat,
    eos_ids,
    id_set,
    model_arith,
    pick_forward,
    text_pieces,
)
from .engine.sampling import Chooser
from .engine.stats import Stats
from .engine.step import Slot, step
from .errors import GooseError
from .selection.costmodel import BatchCostCurve, CostCurve


class Decoder:
    """A model, a method and its configuration; reusable across requests (not thread-safe).

    `memory_mb`: MiB for the suffix memory of this decoder's own earlier prompts and outputs, which `goose`
    drafts from (`goose.drafting.memory`; 0: off); cleared when the model's weights change.
    `arith`: the arithmetic of the forward, "exact" (float32 products of the weights' values) or "int8"
    (8-bit activations times GGUF blocks in integers; models loaded with GGUF blocks only); None (default):
    the model's own (``load_model(..., arith=...)``, else "exact"), or the given `forward`'s. Every method is
    lossless against plain greedy decoding in the same arithmetic."""

    def __init__(self, model, tokenizer=None, method: str | Method = "goose", config: GooseConfig | None = None,
                 forward=None, cost: CostCurve | None = None, memory_mb: float = DEFAULT_MEMORY_MB, *,
                 arith: str | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        vocab = model.get_output_embeddings().weight.shape[0]
        self.method = method if isinstance(method, Method) else make_method(method, vocab, config, cost)
        self._own_forward = forward is None
        self.forward, self.arith = pick_forward(model, forward, arith)
        self.method.prepare(model, self.forward, tokenizer)
        mb = check_memory_mb(memory_mb)
        self.memory = SuffixMemory(int(mb * 2**20), (config or GooseConfig()).memory) if mb > 0 else None
        self.method.memory = self.memory
        self.eos = eos_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        self._live = 0  # requests of this decoder being decoded (paused streams included)

    def _fresh_forward(self):
        """The forward, checked against the model's current weights: a forward this decoder chose is rebuilt
        after the weights change; one the caller passed in is refused (it holds copies of old weights)."""
        if self.forward.stale():
            if self.memory is not None:
                self.memory.clear()
            if not self._own_forward:
                raise GooseError("the model's weights changed since this forward packed them: build a new forward "
                                 "(or let the Decoder choose one) to decode with the current weights")
            self.forward = default_forward(self.model, self.arith)
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
        slot = Slot(list(prompt), cfg, method, fwd.new_cache(), eos, context_limit(self.model), chooser, stop,
                    stats=stats)
        cost = None if method.cost is None else BatchCostCurve.single(method.cost)
        self._live += 1
        try:
            slot.begin()
            while not slot.done:
                step(fwd, [slot], cost)
                if slot.error is not None:
                    raise slot.error
                if slot.new:
                    yield slot.new
            if self.memory is not None:
                self.memory.insert(slot.prompt + slot.out)
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
             chat: bool = False, config: GooseConfig | None = None, streamer=None, *, arith: str | None = None,
             **options) -> GenerationResult:
    """One-shot convenience: build a Decoder and generate (options: do_sample, temperature, top_k, top_p,
    seed; `arith` as `Decoder`'s). Reuse a `Decoder` for many requests: it keeps the method's learned state
    and cost curve."""
    return Decoder(model, tokenizer, method, config, arith=arith).generate(prompt_or_ids, max_new_tokens, chat,
                                                              streamer=streamer, **options)
