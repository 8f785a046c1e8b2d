"""One generation engine per benchmarked method, all answering `generate(ids, max_new_tokens)`.

goose methods run through one reused `goose.Decoder`; `hf-ar` and `hf-pld` are Hugging Face's own
`model.generate(do_sample=False)` (plain and with `prompt_lookup_num_tokens=10`), what users run today:
they run on their own copy of the model (`load_baseline`), float32 weights in transformers' own modules
and kernels, never on goose's packed or quantized layers. For those, a forward pre-hook (installed only
during the call) counts target forwards and reads the cache length before each one, which gives tokens per
forward and per-step accepted lengths as well.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from ..config import DEFAULT_MEMORY_MB, DecodeConfig, LookaheadConfig, RestConfig
from ..decoding import Decoder
from ..drafting import datastore
from ..engine.methods import METHODS
from ..errors import GooseError
from .methods import ALL_METHODS, HF_METHODS, split


def load_baseline(model: str, dtype: str = "float32", device: str | None = "cpu"):
    """The Hugging Face baselines' own copy of `model`: dequantized float32 weights (for a GGUF source) in
    transformers' modules and kernels (`nn.Linear`), as a user loads it with `from_pretrained`."""
    from ..loading.model import load_model

    return load_model(model, dtype, device, weights="float32", pack=False)


class GooseEngine:
    """A goose method: stats come straight from the step loop.

    memory_mb 0 (the plain method names): no suffix memory, since a turn's repeats and the warm-up would
    draft from the turn's own earlier answer. The memory variants (`goose@warm`, ...) get one, which the
    runner empties and fills (`reset`) before each run of a session."""

    def __init__(self, model, tokenizer, method: str, config=None, sampling: dict | None = None,
                 memory_mb: float = 0) -> None:
        self.decoder = Decoder(model, tokenizer, method, config, memory_mb=memory_mb)
        self.sampling = sampling or {}

    @property
    def memory(self):
        return self.decoder.memory

    def reset(self, sequences: list[list[int]]) -> None:
        """Empty the memory, then store `sequences` (earlier requests' prompt + answer), oldest first."""
        memories = self.decoder.engine.memories  # the decoder's requests are the anonymous tenant's ("")
        memories.clear()
        for seq in sequences:
            memories.insert("", seq)

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
        out, stats = self.decoder.generate_ids(ids, DecodeConfig(max_new_tokens=max_new_tokens, **self.sampling))
        return out, stats.to_dict()


class HFEngine:
    """Hugging Face `generate`, batch 1; stats limited to what can be observed from outside."""

    def __init__(self, model, method: str, sampling: dict | None = None) -> None:
        self.model = model
        self.kwargs = dict(HF_METHODS[method])
        self.seed = None
        if sampling:  # the same processed distribution as goose's sampler; torch's RNG seeded per call
            self.seed = sampling.get("seed")
            self.kwargs.update(do_sample=True, temperature=sampling["temperature"], top_k=sampling.get("top_k") or 0,
                               top_p=sampling.get("top_p") or 1.0)
        else:
            self.kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        self.device = next(model.parameters()).device

    def _pre_hook(self, starts: list[int]):
        def hook(module, args, kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            starts.append(int(cache.get_seq_length()) if cache is not None else 0)
        return hook

    @torch.inference_mode()
    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, prompt]
        gc = self.model.generation_config
        pad = gc.pad_token_id if gc.pad_token_id is not None else _first(gc.eos_token_id)
        starts: list[int] = []
        handle = self.model.register_forward_pre_hook(self._pre_hook(starts), with_kwargs=True)
        if self.seed is not None:
            torch.manual_seed(self.seed)
        try:
            t0 = time.perf_counter()
            y = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                    pad_token_id=pad, **self.kwargs)
            wall = time.perf_counter() - t0
        finally:
            handle.remove()
        out = y[0, len(ids):].tolist()
        return out, hf_stats(out, starts, len(ids), wall)


def hf_stats(out: list[int], starts: list[int], prompt_len: int, wall: float) -> dict:
    """Stats of a HF generate call from the cache length seen before each forward.

    Forward 0 (prefill) yields one token; forward i >= 1 starts where forward i-1's accepted tokens end, so
    it produced ``starts[i+1] - starts[i]`` tokens (the last one: whatever remains). Fields goose cannot
    observe from outside (drafted / accepted per source, tree sizes) are None.
    """
    produced = [1] + [b - a for a, b in zip(starts[1:], starts[2:])]
    if len(starts) > 1:
        produced.append(len(out) - sum(produced))
    ok = len(starts) >= 1 and starts[0] == 0 and all(p >= 1 for p in produced) and sum(produced) == len(out)
    accept = [p - 1 for p in produced[1:]] if ok else None
    return {
        "new_tokens": len(out), "forward_calls": len(starts), "wall_time_s": wall, "prompt_tokens": prompt_len,
        "accept_lengths": accept, "drafted": None, "accepted": None, "spine_continuations": None,
        "spine_continuation_tokens": None, "tree_sizes": None, "routes": None,
        "depth_drafted": None, "depth_accepted": None,
        "tau": len(out) / len(starts) if starts else None,
        "mat": 1.0 + sum(accept) / len(accept) if accept else (1.0 if accept == [] else None),
        "tokens_per_s": len(out) / wall if wall > 0 else 0.0, "acceptance_rate": None,
    }


def _first(ids):
    return ids[0] if isinstance(ids, (list, tuple)) else ids


def method_settings(methods: list[str]) -> dict:
    """The configurations of the baselines that have one, for run.json and the report; `rest` also names
    its datastore (refused here, before any model load, when the store is missing)."""
    out: dict = {}
    if "lookahead" in methods:
        out["lookahead"] = asdict(LookaheadConfig())
    if "rest" in methods:
        cfg = RestConfig()
        info = datastore.load(cfg.datastore).info()
        out["rest"] = {**asdict(cfg), "store": {k: info.get(k) for k in ("name", "path", "model", "sources", "docs",
                                                                         "tokens", "bytes", "max_docs")}}
    return out


def make_engine(model, tokenizer, method: str, config=None, sampling: dict | None = None, baseline=None,
                memory_mb: float = DEFAULT_MEMORY_MB):
    """sampling: DecodeConfig sampling fields (do_sample, temperature, top_k, top_p, seed); None: greedy.
    baseline: the model Hugging Face's methods run on (default `model`). memory_mb: the suffix memory of a
    memory variant (`goose@cold`, `goose@earlier`, `goose@warm`)."""
    if method in HF_METHODS:
        return HFEngine(model if baseline is None else baseline, method, sampling)
    if method in METHODS:
        return GooseEngine(model, tokenizer, method, config, sampling)
    base, mode = split(method)
    if mode is not None and base in METHODS:
        if not memory_mb > 0:
            raise GooseError(f"'{method}' drafts from the suffix memory: --memory-mb must be > 0")
        return GooseEngine(model, tokenizer, base, config, sampling, memory_mb=memory_mb)
    raise GooseError(f"unknown method '{method}'; choose from: {', '.join(ALL_METHODS)}")
