"""The public `Decoder` / `generate` API: one request at a time on the caller's thread, through an `Engine`.

A `Decoder` is a view of an `Engine` (`goose.engine.scheduler`) with ``max_batch=1`` and no background thread;
the step loop itself is `goose.engine.step`.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import DEFAULT_MEMORY_MB, DecodeConfig, EngineConfig, GooseConfig, check_memory_mb
from .engine.methods import Method, make_method
from .engine.output import Detokenizer
from .engine.requests import (  # noqa: F401  (re-exported: part of the public API)
    GenerationResult,
    context_limit,
    decode_config,
    default_forward,
    encode,
    encode_chat,
    eos_ids,
    id_set,
    pick_forward,
)
from .engine.sampling import Chooser
from .engine.scheduler import Engine, Request
from .engine.stats import Stats
from .errors import GooseError
from .selection.costmodel import CostCurve


class Decoder:
    """A model, a method and its configuration; reusable across requests (not thread-safe).

    A view of an `Engine` that decodes one request at a time on the caller's thread (``max_batch=1``, no
    background thread): the forward, the check for changed weights, the suffix memory, the prefix cache and
    the cost curve are the engine's (`engine`).

    `memory_mb`: MiB for the suffix memory of this decoder's own earlier prompts and outputs, which `goose`
    drafts from (`goose.drafting.memory`; 0: off); cleared when the model's weights change.
    `prefix_cache_mb`: room for the keys and values of earlier prompts that a later prompt starting with the
    same tokens reuses (`goose.engine.prefix`; only on goose's kernels, where reuse gives the same bits); 0
    (default): off, so every request prefills its whole prompt (as benchmarks timing prefill need).
    `arith`: the arithmetic of the forward, "exact" (float32 products of the weights' values) or "int8"
    (8-bit activations times GGUF blocks in integers; models loaded with GGUF blocks only); None (default):
    the model's own (``load_model(..., arith=...)``, else "exact"), or the given `forward`'s. Every method is
    lossless against plain greedy decoding in the same arithmetic."""

    def __init__(self, model, tokenizer=None, method: str | Method = "goose", config: GooseConfig | None = None,
                 forward=None, cost: CostCurve | None = None, memory_mb: float = DEFAULT_MEMORY_MB, *,
                 arith: str | None = None, prefix_cache_mb: float = 0) -> None:
        vocab = model.get_output_embeddings().weight.shape[0]
        if not isinstance(method, Method):
            method = make_method(method, vocab, config, cost)
        settings = EngineConfig(max_batch=1, memory_mb=check_memory_mb(memory_mb), prefix_cache_mb=prefix_cache_mb,
                                freeze_gc=False)
        self.engine = Engine(model, tokenizer, method, config=config, forward=forward, thread=False,
                             engine_config=settings, arith=arith)
        self.model, self.tokenizer, self.method = model, tokenizer, method

    @property
    def forward(self):
        return self.engine.forward

    @property
    def arith(self) -> str:
        return self.engine.arith

    @property
    def eos(self) -> set[int]:
        return self.engine.eos

    @property
    def memory(self):
        """The suffix memory of this decoder's earlier requests (`SuffixMemory`; None before the first one, or
        when off)."""
        return self.engine.memories.get("")

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        return encode(self.tokenizer, prompt, chat)

    def _submit(self, prompt: str | list[int], chat: bool, cfg: DecodeConfig, **keywords) -> Request:
        options = dataclasses.asdict(cfg)
        max_new = options.pop("max_new_tokens")
        return self.engine.submit(prompt, max_new, chat, **keywords, **options)

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, chat: bool = False, *,
                 streamer=None, **options) -> GenerationResult:
        """Generate for one prompt (text or token ids). `options` are DecodeConfig fields (do_sample,
        temperature, top_k, top_p, seed, prefill_chunk). `streamer`: a Hugging Face streamer (TextStreamer,
        TextIteratorStreamer, ...) that receives the prompt ids, then each accepted block, then end()."""
        cfg = decode_config(dict(options, max_new_tokens=max_new_tokens))
        ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
        on_tokens = None
        if streamer is not None:
            streamer.put(torch.tensor(ids))
            on_tokens = lambda block: streamer.put(torch.tensor(list(block)))  # noqa: E731
        try:
            req = self._submit(ids, False, cfg, on_tokens=on_tokens)
            for _ in self.engine.drive(req):
                pass
        finally:
            if streamer is not None:
                streamer.end()
        return req.result(0)

    def stream(self, prompt: str | list[int], max_new_tokens: int = 128, chat: bool = False, *, stop=None,
               **options) -> "TextStream":
        """Iterate over text pieces as they are accepted; afterwards `.result` holds the GenerationResult.
        The pieces concatenate to exactly the text `generate` returns; each token is decoded a bounded number
        of times however long the output is (`goose.engine.output.Detokenizer`). `stop`: a string or strings
        that end the request once its text holds one (or a ``stop(tokens) -> bool``), as `Engine.submit`'s.
        Bad input raises here, before anything is decoded."""
        if self.tokenizer is None:
            raise GooseError("streaming text needs a tokenizer")
        cfg = decode_config(dict(options, max_new_tokens=max_new_tokens))
        return TextStream(self, self._submit(prompt, chat, cfg, stop=stop))

    def generate_ids(self, prompt: list[int], cfg: DecodeConfig = DecodeConfig(), chooser: Chooser | None = None,
                     stop=None, on_tokens=None, eos: set[int] | None = None) -> tuple[list[int], Stats]:
        """Token ids in, generated token ids and stats out.

        chooser: how each token is picked (default: from `cfg`, greedy or sampling). stop(tokens) -> bool is
        asked after every generated token (tokens = all generated so far) and ends generation there, like the
        stop tokens. on_tokens(block) receives each committed `TokenBlock` as it is accepted. eos: the stop
        token ids (default: the model's).
        """
        req = self._submit(list(prompt), False, cfg, chooser=chooser, stop=stop, on_tokens=on_tokens, eos=eos)
        for _ in self.engine.drive(req):
            pass
        return req.token_ids, req.stats


class TextStream:
    """Iterator of text pieces for one request (see Decoder.stream). A piece is held back while the text
    ends inside a multi-byte character; each piece is the new suffix of the decoded text."""

    def __init__(self, decoder: Decoder, req: Request) -> None:
        self.decoder, self.request = decoder, req
        self.result: GenerationResult | None = None

    def __iter__(self):
        yield from Detokenizer.of(self.decoder.tokenizer).pieces(self.decoder.engine.drive(self.request))
        self.result = self.request.result(0)


def generate(model, tokenizer, prompt_or_ids: str | list[int], method: str = "goose", max_new_tokens: int = 128,
             chat: bool = False, config: GooseConfig | None = None, streamer=None, *, arith: str | None = None,
             **options) -> GenerationResult:
    """One-shot convenience: build a Decoder and generate (options: do_sample, temperature, top_k, top_p,
    seed; `arith` as `Decoder`'s). Reuse a `Decoder` for many requests: it keeps the method's learned state
    and cost curve."""
    return Decoder(model, tokenizer, method, config, arith=arith).generate(prompt_or_ids, max_new_tokens, chat,
                                                              streamer=streamer, **options)
