"""KV cache compaction for Hugging Face caches: the only code that touches cache internals.

After verifying a tree of n nodes on top of P cached tokens, keep the prefix, the root and the accepted
path nodes in path order, and drop every other tree node.
"""

from __future__ import annotations

import torch


def keep_path(cache, prefix_len: int, path: list[int]) -> None:
    """Compact every layer to ``prefix_len + len(path)`` entries: prefix, then tree nodes `path`."""
    m = len(path)
    if path == list(range(m)):  # accepted nodes are already in place: just truncate
        _truncate(cache, prefix_len + m)
        return
    src = torch.tensor(path, dtype=torch.long) + prefix_len
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        idx = src.to(layer.keys.device)
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [batch, heads, seq, head_dim]
            t[:, :, prefix_len : prefix_len + m] = t.index_select(-2, idx)
            setattr(layer, name, t[:, :, : prefix_len + m])


def _truncate(cache, length: int) -> None:
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def cache_length(cache) -> int:
    return 0 if cache is None else cache.get_seq_length()
