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
from .costmodel import CostCurve
from .errors import GooseError
from .forward import HFForward
from .lean import LeanForward
from .lean import supports as lean_supports
from .methods import Method, make_method
from .stats import Stats
from .tree_tensors import ancestor_mask, is_chain, tree_depths
from .sampling import Chooser


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


class _StageClock:
    """Adds the milliseconds since the previous call to `stages[name]` (per-stage step profile)."""

    def __init__(self, stages: dict[str, float]) -> None:
        self.stages = stages
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = self.stages.get(name, 0.0) + (now - self.last) * 1e3
        self.last = now


_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def default_forward(model):
    """The fast Llama-family forward where it applies, else the generic Hugging Face one.

    A LeanForward (prepacked weight copies and a static KV cache) is made once per model and shared by all
    its Decoders: requests on one model run one at a time, and a request interrupted by another one on the
    same model stops with a clear error instead of reading the other's cache."""
    if not lean_supports(model):
        return HFForward(model)
    fwd = _SHARED.get(model)
    if fwd is None:
        fwd = _SHARED[model] = LeanForward(model)
    return fwd


class Decoder:
    """A model, a method and its configuration; reusable across requests (not thread-safe)."""

    def __init__(self, model, tokenizer=None, method: str | Method = "goose", config: GooseConfig | None = None,
                 forward=None, cost: CostCurve | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        vocab = model.get_output_embeddings().weight.shape[0]
        self.method = method if isinstance(method, Method) else make_method(method, vocab, config, cost)
        self.forward = forward if forward is not None else default_forward(model)
        self.method.prepare(model, self.forward, tokenizer)
        self.eos = eos_ids(model, tokenizer)
        self.device = next(model.parameters()).device

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise GooseError("a tokenizer is needed to encode text prompts")
        if not prompt.strip():
            raise GooseError("the prompt is empty")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise GooseError("--chat needs a tokenizer with a chat template, and this one has none")
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return self.tokenizer(prompt)["input_ids"]

    def _request(self, prompt: str | list[int], chat: bool, options: dict) -> tuple[list[int], DecodeConfig]:
        unknown = set(options) - {f.name for f in fields(DecodeConfig)}
        if unknown:
            raise GooseError(f"unknown option(s) {', '.join(sorted(unknown))}; the options are the DecodeConfig "
                             f"fields: {', '.join(f.name for f in fields(DecodeConfig))}")
        ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
        return ids, DecodeConfig(**options)

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

    def _check(self, prompt: list[int], cfg: DecodeConfig) -> None:
        if not prompt:
            raise GooseError("the prompt is empty")
        limit = context_limit(self.model)
        if limit is not None and len(prompt) + cfg.max_new_tokens > limit:
            raise GooseError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds "
                             f"the model's context of {limit} tokens")

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

    @torch.inference_mode()
    def _decode(self, prompt: list[int], cfg: DecodeConfig, chooser: Chooser, stop, stats: Stats, eos: set[int]):
        """The step loop; yields each committed block of tokens and fills `stats`."""
        self._check(prompt, cfg)
        fwd, method = self.forward, self.method
        t0 = time.perf_counter()
        fwd.reset()
        fwd.owner = owner = object()  # this request's claim on the (possibly shared) forward and its cache
        method.start()
        prev = -1
        tail = len(prompt) if method.prefill_harvest is None else method.prefill_harvest
        for s in range(0, len(prompt), cfg.prefill_chunk):  # prefill, harvesting the last `tail` positions
            chunk = prompt[s : s + cfg.prefill_chunk]
            prevs = [prev] + chunk[:-1]
            k = min(len(chunk), max(0, s + len(chunk) - (len(prompt) - tail)))  # harvested positions here
            logits = fwd(chunk, keep_last=max(k, 1))  # [max(k, 1), vocab]
            if k:
                method.harvest(chunk[-k:], prevs[-k:], logits[-k:])
            prev = chunk[-1]
        stats.forward_calls = 1
        out: list[int] = []

        def commit(new: list[int]) -> bool:
            """Append `new`, cut at max_new_tokens, a stop token or `stop`; True when generation is over."""
            new = new[: cfg.max_new_tokens - len(out)]
            done = len(out) + len(new) >= cfg.max_new_tokens
            for i, t in enumerate(new):
                if t in eos or (stop is not None and stop(out + new[: i + 1])):
                    new, done = new[: i + 1], True
                    break
            out.extend(new)
            stats.new_tokens = len(out)
            stats.wall_time_s = time.perf_counter() - t0
            return done

        first = [chooser.first(logits[-1], prompt)]
        done = commit(first)
        yield first
        method.begin(prompt + out)
        limit = context_limit(self.model)
        clock = _StageClock(stats.stage_ms)
        while not done:
            if fwd.owner is not owner:
                raise GooseError("another request on the same model ran while this one was paused; "
                                 "finish (or drop) one stream before starting the next")
            anchor = out[-1]
            prev_anchor = out[-2] if len(out) > 1 else prompt[-1]
            tree = method.draft(anchor, prev_anchor)  # 1. draft + build
            if limit is not None:
                tree = tree.within_depth(limit - 1 - fwd.length)
            clock("draft")
            tokens = tree.all_tokens  # tree nodes, then any unverified extras (lookahead window)
            tree_args = () if len(tokens) == 1 or is_chain(tree) else (tree_depths(tree), ancestor_mask(tree))
            clock("tensorize")  # 2. tensorize (chains need no mask)
            logits = fwd(tokens, *tree_args)  # 3. forward: [n, vocab]
            clock("forward")
            walk = chooser.walk(tree, logits, prompt + out)  # 4. verify
            clock("verify")
            fwd.keep(walk.path)  # 5. compact KV
            clock("compact")
            prevs = [prev_anchor] + [tokens[p] for p in tree.all_parents[1:]]
            method.harvest(tokens, prevs, logits)  # 6. harvest
            method.observe(tree, walk)
            clock("harvest")
            before = len(out)
            done = commit([tree.tokens[i] for i in walk.path[1:]] + [walk.bonus])  # 7. commit
            new = out[before:]
            method.commit(new)
            stats.record_step(tree, walk)
            clock("commit")
            yield new
        stats.wall_time_s = time.perf_counter() - t0


class TextStream:
    """Iterator of text pieces for one request (see Decoder.stream). A piece is held back while the text
    ends inside a multi-byte character; each piece is the new suffix of the decoded text."""

    def __init__(self, decoder: Decoder, prompt: list[int], cfg: DecodeConfig) -> None:
        self.decoder, self.prompt, self.cfg = decoder, prompt, cfg
        self.result: GenerationResult | None = None

    def __iter__(self):
        dec = self.decoder
        out: list[int] = []
        stats = Stats(prompt_tokens=len(self.prompt))
        shown = ""
        chooser = Chooser.for_config(self.cfg, dec.device)
        for block in dec._decode(self.prompt, self.cfg, chooser, None, stats, dec.eos):
            out.extend(block)
            text = dec._text(out)
            if not text.endswith("\ufffd") and text.startswith(shown) and len(text) > len(shown):
                yield text[len(shown):]
                shown = text
        text = dec._text(out)
        if text != shown and text.startswith(shown):
            yield text[len(shown):]
        self.result = GenerationResult(text, out, stats)


def generate(model, tokenizer, prompt_or_ids: str | list[int], method: str = "goose", max_new_tokens: int = 128,
             chat: bool = False, config: GooseConfig | None = None, streamer=None, **options) -> GenerationResult:
    """One-shot convenience: build a Decoder and generate (options: do_sample, temperature, top_k, top_p,
    seed). Reuse a `Decoder` for many requests: it keeps the method's learned state and cost curve."""
    return Decoder(model, tokenizer, method, config).generate(prompt_or_ids, max_new_tokens, chat,
                                                              streamer=streamer, **options)
