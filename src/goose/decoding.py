"""The step loop and the public `Decoder` / `generate` API.

Every method runs through the same recipe each step:
  1. draft + build   the method returns a DraftTree rooted at the anchor
  2. tensorize        ancestor mask and depths (cached per topology; none for chains)
  3. forward          one target pass over the tree on top of the KV cache
  4. verify           greedy walk: the longest path the target agrees with, plus a bonus token
  5. compact KV       keep the prefix, the root and the accepted path
  6. harvest          the method learns from the logits of every verified node
  7. commit           accepted tokens + bonus (cut at the first stop token and at max_new_tokens)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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
from .verify import greedy_walk


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
    if ids is None:
        return set()
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


def default_forward(model):
    """The fast Llama-family forward where it applies, else the generic Hugging Face one."""
    return LeanForward(model) if lean_supports(model) else HFForward(model)


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

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, chat: bool = False) -> GenerationResult:
        ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
        out, stats = self.generate_ids(ids, DecodeConfig(max_new_tokens=max_new_tokens))
        text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationResult(text, out, stats)

    def _check(self, prompt: list[int], cfg: DecodeConfig) -> None:
        if not prompt:
            raise GooseError("the prompt is empty")
        limit = context_limit(self.model)
        if limit is not None and len(prompt) + cfg.max_new_tokens > limit:
            raise GooseError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds "
                             f"the model's context of {limit} tokens")

    @torch.inference_mode()
    def generate_ids(self, prompt: list[int], cfg: DecodeConfig = DecodeConfig()) -> tuple[list[int], Stats]:
        self._check(prompt, cfg)
        fwd, method, eos = self.forward, self.method, self.eos
        stats = Stats(prompt_tokens=len(prompt))
        t0 = time.perf_counter()
        fwd.reset()
        prev = -1
        for s in range(0, len(prompt), cfg.prefill_chunk):  # prefill, harvesting every position
            chunk = prompt[s : s + cfg.prefill_chunk]
            logits = fwd(chunk)  # [len(chunk), vocab]
            method.harvest(chunk, [prev] + chunk[:-1], logits)
            prev = chunk[-1]
        stats.forward_calls = 1
        out = [int(logits[-1].argmax())]
        method.begin(prompt + out)
        limit = context_limit(self.model)
        clock = _StageClock(stats.stage_ms)
        while len(out) < cfg.max_new_tokens and out[-1] not in eos:
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
            walk = greedy_walk(tree, logits.argmax(-1).tolist())  # 4. verify
            clock("verify")
            fwd.keep(walk.path)  # 5. compact KV
            clock("compact")
            prevs = [prev_anchor] + [tokens[p] for p in tree.all_parents[1:]]
            method.harvest(tokens, prevs, logits)  # 6. harvest
            method.observe(tree, walk)
            clock("harvest")
            new = [tree.tokens[i] for i in walk.path[1:]] + [walk.bonus]  # 7. commit
            new = new[: cfg.max_new_tokens - len(out)]
            for i, t in enumerate(new):
                if t in eos:
                    new = new[: i + 1]
                    break
            out.extend(new)
            method.commit(new)
            stats.record_step(tree, walk)
            clock("commit")
        stats.new_tokens = len(out)
        stats.wall_time_s = time.perf_counter() - t0
        return out, stats


def generate(model, tokenizer, prompt_or_ids: str | list[int], method: str = "goose", max_new_tokens: int = 128,
             chat: bool = False, config: GooseConfig | None = None) -> GenerationResult:
    """One-shot convenience: build a Decoder and generate. Reuse a `Decoder` for many requests."""
    return Decoder(model, tokenizer, method, config).generate(prompt_or_ids, max_new_tokens, chat)
