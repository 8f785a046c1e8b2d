"""The one call into the model: append query tokens to the KV cache and return their logits.

`HFForward` works for any Hugging Face causal LM whose attention honours a custom 4D additive mask
(eager or sdpa) and takes explicit `position_ids` (rotary, learned absolute or none). Query tokens are
either a causal run (prefill chunks, AR steps, chains) or a draft tree (ancestor mask and depth-based
position ids).

Attention layers are full or sliding-window (`attention_layers`). The cache keeps every entry in every
layer (a bare `DynamicCache`: Hugging Face's sliding cache layers drop old entries, which would break
`keep_path`), so a sliding layer must get a mask that hides what lies beyond its window from each query
node's position. Models with only full layers get one tree mask (no mask for causal runs); models with
an active sliding window get explicit masks for every call: one 4D mask when all layers are of one
kind, else the per-layer-type dict ``{"full_attention": m, "sliding_attention": m_window}`` that
Hugging Face models with mixed layers accept in place of `attention_mask`. Other layer kinds (linear,
chunked attention...) and mixed models without that dict form are refused.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from .errors import GooseError
from .kv_cache import cache_length, keep_path
from .tree_tensors import additive_mask

SUPPORTED_ATTENTION = ("eager", "sdpa")
FULL, SLIDING = "full_attention", "sliding_attention"


def check_attention(model) -> None:
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise GooseError(
            f"attention implementation '{impl}' ignores custom tree masks; load the model with "
            f"attn_implementation='sdpa' or 'eager'"
        )


def active_sliding_window(config) -> int | None:
    """The sliding-window length if some layer attends through one shorter than the context, else None."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and not any("sliding" in str(t) for t in types)):
        return None
    limit = getattr(config, "max_position_embeddings", None)
    return window if limit is None or window < limit else None


def _takes_mask_per_layer_type(model) -> bool:
    """Whether the model's forward accepts `attention_mask` as a dict keyed by layer type."""
    base = getattr(model, "base_model", model)
    try:
        src = inspect.getsource(inspect.unwrap(type(base).forward))
    except (OSError, TypeError):
        return False
    return "attention_mask, dict)" in src


def attention_layers(model) -> tuple[tuple[str, ...], int | None]:
    """(kind of each layer, FULL or SLIDING; the sliding window or None when no layer slides).

    Without ``config.layer_types`` a set `sliding_window` applies to every layer (Mistral, Phi-3).
    Raises GooseError for layers goose cannot mask exactly."""
    cfg = model.config
    if hasattr(cfg, "get_text_config"):  # multimodal models keep the decoder's layout in a sub-config
        cfg = cfg.get_text_config(decoder=True)
    mtype = getattr(cfg, "model_type", "?")
    if getattr(cfg, "attention_chunk_size", None):
        raise GooseError(f"model type '{mtype}' uses chunked attention: goose verifies trees only through full "
                         f"and sliding-window attention")
    if "local" in [str(t) for t in getattr(cfg, "attention_layers", None) or ()]:
        raise GooseError(f"model type '{mtype}' has local-attention layers that mask by cache index, not by "
                         f"position: a tree's window would be wrong")
    types = getattr(cfg, "layer_types", None)
    window = active_sliding_window(cfg)
    if types is None:
        kinds = (SLIDING if window else FULL,) * cfg.num_hidden_layers
    else:
        other = sorted({str(t) for t in types} - {FULL, SLIDING})
        if other:
            raise GooseError(f"model type '{mtype}' has {', '.join(other)} layers: goose verifies trees only "
                             f"through full and sliding-window attention")
        kinds = tuple(types) if window else (FULL,) * len(types)
    if FULL in kinds and SLIDING in kinds and not _takes_mask_per_layer_type(model):
        raise GooseError(f"model type '{mtype}' mixes full and sliding-window ({window} tokens) layers but "
                         f"takes a single attention mask, which would reach both kinds: not supported")
    return kinds, window


class _Head:
    """The output projection on goose's CPU kernel: logits = softcap(h W^T + b), W packed once."""

    def __init__(self, kernel, lm_head, softcap: float | None) -> None:
        self.kernel, self.n = kernel, lm_head.out_features
        self.packed = kernel.pack(lm_head.weight)
        self.bias = kernel.pack_bias(lm_head.bias, self.n)
        self.softcap = softcap

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # [n, hid] -> [n, vocab]
        logits = self.kernel.linear(h, self.packed, self.n, self.bias)
        if self.softcap:  # as Gemma's heads do
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class HFForward:
    """Generic forward over a Hugging Face model and its DynamicCache."""

    def __init__(self, model, *, kernel: bool | None = None) -> None:
        """`kernel`: None = run the output projection on goose's CPU kernel (`cpukernel`) where it is
        available and reproduces the model's own logits (float32 on CPU, a plain linear head, checked once
        on a short input); False = the model's own head; True = require the kernel."""
        check_attention(model)
        self.kinds, self.window = attention_layers(model)
        self.model = model
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = None
        self._prefix = 0
        self.head = None if kernel is False else self._kernel_head(required=bool(kernel))
        self.backend = "hf+goose-head" if self.head is not None else "hf"

    def _kernel_head(self, required: bool) -> _Head | None:
        """The kernel head when it reproduces the model's logits, else None (or GooseError if required)."""
        from . import cpukernel

        model, why = self.model, None
        head, base = model.get_output_embeddings(), getattr(model, "base_model", None)
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        if self.device.type != "cpu" or self.dtype != torch.float32:
            why = "it needs float32 weights on CPU"
        elif type(head) is not torch.nn.Linear or base is None or base is model:
            why = "the model has no plain linear output projection over a base model"
        else:
            why = cpukernel.unavailable_reason()
        if why is None:
            fast = _Head(cpukernel.kernel(), head, getattr(cfg, "final_logit_softcapping", None))
            ids = torch.tensor([[1, 2, 3]], device=self.device) % head.out_features
            with torch.inference_mode():
                ref = model(ids, use_cache=False).logits[0]
                ours = fast(base(input_ids=ids, use_cache=False).last_hidden_state[0])
            tol = 1e-4 * max(1.0, ref.abs().max().item())
            if ours.shape == ref.shape and torch.allclose(ours, ref, rtol=1e-4, atol=tol):
                return fast
            why = "the model's logits are not its base model's output times its output projection"
        if required:
            raise GooseError(f"goose's CPU kernel cannot run this model's output projection: {why}")
        return None

    def reset(self) -> None:
        self.cache = DynamicCache()  # every layer keeps every entry (see the module docstring)
        self._prefix = 0

    @property
    def length(self) -> int:
        return cache_length(self.cache)

    def __call__(self, tokens: list[int], depths: torch.Tensor | None = None,
                 allowed: torch.Tensor | None = None, keep_last: int | None = None) -> torch.Tensor:
        """Logits ``[n, vocab]`` for `tokens` appended after the cache; only the last `keep_last` rows
        (>= 1) when given, so a prefill skips the vocabulary projection where nothing reads it.

        With `allowed` (``[n, n]`` ancestor mask) and `depths` (``[n]``) the tokens form a tree;
        without, they form a causal run.
        """
        if self.cache is None:
            self.reset()
        p = self.length
        n = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, n]
        if allowed is None and self.window is None:  # causal run, full layers only: the model's own mask
            pos = torch.arange(p, p + n, device=self.device)[None]  # [1, n]
            mask = None
        else:
            if allowed is None:  # causal run through sliding layers: an explicit windowed mask
                depths, allowed = torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril_()
            pos = (depths.to(self.device) + p)[None]  # [1, n]
            mask = self._masks(allowed, depths, p)
        if self.head is not None:
            out = self.model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=self.cache,
                                        use_cache=True)
            self._prefix = p
            h = out.last_hidden_state[0]  # [n, hid]
            return self.head(h[-keep_last:] if keep_last else h)  # [n or keep_last, vocab]
        keep = {"logits_to_keep": keep_last} if keep_last and self._keeps_logits else {}
        out = self.model(ids, attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True, **keep)
        self._prefix = p
        return out.logits[0, -keep_last:] if keep_last else out.logits[0]  # [n or keep_last, vocab]

    def _masks(self, allowed: torch.Tensor, depths: torch.Tensor, p: int):
        """The 4D mask ``[1, 1, n, p + n]`` for the model's layers, or a dict of them by layer kind."""
        masks = {}
        if FULL in self.kinds:
            masks[FULL] = additive_mask(allowed, p, self.dtype, self.device)
        if SLIDING in self.kinds:
            masks[SLIDING] = additive_mask(allowed, p, self.dtype, self.device, depths, self.window)
        return masks if len(masks) > 1 else next(iter(masks.values()))

    def keep(self, path: list[int]) -> None:
        """Keep the prefix and the nodes `path` of the last call (in that order); drop the rest."""
        keep_path(self.cache, self._prefix, path)
