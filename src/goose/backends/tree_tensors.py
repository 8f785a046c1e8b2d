"""Tree attention mask and position ids (pure; cached by tree topology).

For the tree 0 -> 1 -> 2, 0 -> 3 (node 0 = root) verified after a cache of P tokens::

    allowed (tree part)   positions
        0 1 2 3
    0 [ 1 . . . ]          P + 0
    1 [ 1 1 . . ]          P + 1
    2 [ 1 1 1 . ]          P + 2
    3 [ 1 . . 1 ]          P + 1

Every node also sees all P prefix columns. Extra nodes (`DraftTree.add_extra`) are more rows of the same
construction: each sees its ancestors and sits at P + its depth. A Lookahead step (window W = 2, two
levels) under the root 0 with one verification candidate 1; extras 2 - 3 are level 0 (a chain off the
root), 4 and 5 are level 1 (under columns 0 and 1 of level 0)::

    0 - 1                 allowed                 positions
    0 - 2 - 3                 0 1 2 3 4 5
        |   |             0 [ 1 . . . . . ]       P + 0
        4   5             1 [ 1 1 . . . . ]       P + 1   candidate
                          2 [ 1 . 1 . . . ]       P + 1   level 0, column 0
                          3 [ 1 . 1 1 . . ]       P + 2   level 0, column 1
                          4 [ 1 . 1 . 1 . ]       P + 2   level 1, column 0
                          5 [ 1 . 1 1 . 1 ]       P + 3   level 1, column 1

Everything is cached by the parent tuple (a tree's `topology()`: plain data, so no tree type is needed here),
extras included. The model gets an
additive float mask: 0 where allowed, ``finfo(dtype).min`` elsewhere (a boolean mask is silently wrong
under eager attention).

A sliding-window layer of window W sees, from a query at position q, only keys at positions > q - W
(the query itself and the W - 1 before it, as in Hugging Face's sliding mask). Prefix entry j sits at
position j and tree node k at P + depth[k], so its mask also drops the columns that far back: with W = 2,
node 2 above (position P + 2) no longer sees the prefix nor node 0 (position P), only nodes 1 and 2.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch


@lru_cache(maxsize=512)
def _tree_tensors(parents: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    n = len(parents)
    allowed = torch.zeros(n, n, dtype=torch.bool)  # [n, n]
    depth = [0] * n
    for i, p in enumerate(parents):
        if p >= 0:
            allowed[i] = allowed[p]
            depth[i] = depth[p] + 1
        allowed[i, i] = True
    is_chain = all(p == i - 1 for i, p in enumerate(parents))
    return allowed, torch.tensor(depth, dtype=torch.long), is_chain


def parent_tensors(parents: list[int] | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(allowed ``[n, n]``, depths ``[n]``) for a tree given by parent indices (root first, parent -1).

    The tensors are cached and shared: do not modify them."""
    allowed, depths, _ = _tree_tensors(tuple(parents))
    return allowed, depths


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: allowed[i, j] iff node j is node i or one of its ancestors (``parents``: a tree's
    parent indices, root first with -1, e.g. `DraftTree.topology()`)."""
    return _tree_tensors(tuple(parents))[0]


def tree_depths(parents: Sequence[int]) -> torch.Tensor:
    """[n] long: depth of each node (root 0); position id of node i is P + depth[i]."""
    return _tree_tensors(tuple(parents))[1]


def is_chain(parents: Sequence[int]) -> bool:
    """True when the tree is a single path (a plain causal mask suffices)."""
    return _tree_tensors(tuple(parents))[2]


def additive_mask(allowed: torch.Tensor, prefix_len: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu", depths: torch.Tensor | None = None,
                  window: int | None = None) -> torch.Tensor:
    """[1, 1, n, P + n] float mask: 0 on prefix columns and allowed tree columns, dtype-min elsewhere.

    With `window` (and `depths`), also dtype-min on every column at least `window` positions behind the
    query node's position (a sliding-window layer's mask)."""
    n = allowed.shape[0]
    mask = torch.zeros(n, prefix_len + n, dtype=dtype, device=device)  # [n, P + n]
    mask[:, prefix_len:].masked_fill_(~allowed.to(device), torch.finfo(dtype).min)
    if window is not None:
        depths = depths.to(device)
        q_pos = prefix_len + depths  # [n]
        k_pos = torch.cat([torch.arange(prefix_len, device=device), q_pos])  # [P + n]
        too_far = k_pos[None, :] <= q_pos[:, None] - window  # [n, P + n]
        mask.masked_fill_(too_far, torch.finfo(dtype).min)
    return mask[None, None]
