"""The one call into the model: append query tokens to the KV cache and return their logits.

`HFForward` works for any Hugging Face causal LM whose attention honours a custom 4D additive mask
(eager or sdpa). Query tokens are either a causal run (prefill chunks, AR steps, chains: no custom mask
needed) or a draft tree (ancestor mask and depth-based position ids).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .errors import GooseError
from .kv_cache import cache_length, keep_path
from .tree_tensors import additive_mask

SUPPORTED_ATTENTION = ("eager", "sdpa")


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


class HFForward:
    """Generic forward over a Hugging Face model and its DynamicCache."""

    def __init__(self, model) -> None:
        check_attention(model)
        window = active_sliding_window(model.config)
        if window is not None:  # one 4D tree mask would also reach the sliding layers: wrong past the window
            raise GooseError(f"sliding-window attention ({window} tokens, model type "
                             f"'{getattr(model.config, 'model_type', '?')}') is not supported yet")
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = None
        self._prefix = 0

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self._prefix = 0

    @property
    def length(self) -> int:
        return cache_length(self.cache)

    def __call__(self, tokens: list[int], depths: torch.Tensor | None = None,
                 allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[n, vocab]`` for `tokens` appended after the cache.

        With `allowed` (``[n, n]`` ancestor mask) and `depths` (``[n]``) the tokens form a tree;
        without, they form a causal run.
        """
        if self.cache is None:
            self.reset()
        p = self.length
        n = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, n]
        if allowed is None:
            pos = torch.arange(p, p + n, device=self.device)[None]  # [1, n]
            mask = None
        else:
            pos = (depths.to(self.device) + p)[None]  # [1, n]
            mask = additive_mask(allowed, p, self.dtype, self.device)  # [1, 1, n, p + n]
        out = self.model(ids, attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True)
        self._prefix = p
        return out.logits[0]  # [n, vocab]

    def keep(self, path: list[int]) -> None:
        """Keep the prefix and the nodes `path` of the last call (in that order); drop the rest."""
        keep_path(self.cache, self._prefix, path)
