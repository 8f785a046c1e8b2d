"""Keys and values of token prefixes the engine has already computed, reused by later requests that start
with them (a shared system prompt, the earlier turns of a conversation): such a request prefills only the
rest of its prompt.

Blocks of BLOCK tokens form a trie: a block is found by its parent block and its own tokens, so a prompt's
longest stored prefix is found in one pass over its blocks. A block holds its tokens' cache entries of every
layer (``[layers, 2, K, BLOCK, D]``, a copy: no request's cache is shared). Prompts are stored once their
prefill ends, and a finished request's prompt and output (its cache's entries) when it finishes. A request
admitted beside one whose prompt shares its first blocks waits for that prefill to end and then copies them.

Why reuse cannot change a token: on goose's kernels (`LeanForward.plan`) every row of a forward is computed
independently of the other rows and of how many there are, and a tree node's entries are those of its path
run as a chain. So the keys and values of a token sequence are the same bits however it was split into
prefill chunks, drafts and steps, and however many other requests shared those forwards; a request that
copies them computes what it would have computed itself. Only forwards with that property get a cache
(`PrefixCache.supports`); the engine clears it when the model's weights change.

Tenants: every block belongs to one tenant (a string; "" is the anonymous tenant). A tenant's first blocks
hang from a root of its own, so a request finds (and `cached_tokens` counts) only blocks its own tenant
stored: another tenant's prompts and answers never shorten its prefill nor show in its usage. All tenants
share one byte budget and one least-recently-used order.

The cache is the engine's own: only its step loop reads and writes it, and it hands out copies.

Memory: the blocks live in one preallocated pool (``torch.empty`` of ``capacity`` blocks, made at the first
store: the operating system backs a page only once a block is written there), so what the cache holds never
exceeds its budget however blocks come and go, and no freed block leaves a hole in the allocator's heap.
``capacity`` is ``max_bytes // (block bytes + NODE_BYTES)``: each block also costs its node's bookkeeping.
Recency is an ordered dict in which a block is always more recent than its descendants (a path is marked
from its last block back to its first), so the least recently used block is always a leaf and an eviction
costs O(1) whatever the number of blocks or tenants.

Limits: `max_bytes` (the engine's ``prefix_cache_mb``); the least recently used blocks with no stored
continuation go first; `max_tenants` (the engine's ``max_tenants``): tenants with stored blocks, the least
recently used tenant's blocks all go when a new one would pass it. At least one prompt token is always left
to prefill (its logits give the first token).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from ..config import DEFAULT_MAX_TENANTS

BLOCK = 8  # tokens per stored block
NODE_BYTES = 1024  # a stored block's bookkeeping besides its entries: node, key, token tuple, dict entries


class _Node:
    __slots__ = ("id", "key", "tenant", "index", "children")

    def __init__(self, nid: int, key: tuple, tenant: str, index: int) -> None:
        self.id, self.key, self.tenant, self.index, self.children = nid, key, tenant, index, 0


class PrefixCache:
    """The stored blocks (see the module doc); `attach` at a request's start, `store` when entries are final."""

    def __init__(self, max_bytes: int, max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self.max_bytes, self.max_tenants = max_bytes, max_tenants
        self._pool: torch.Tensor | None = None  # [capacity, layers, 2, K, BLOCK, D], made by the first store
        self._free: list[int] = []  # pool indices not holding a block
        self._nodes: dict[tuple, _Node] = {}  # (parent node's id, or the tenant (a str) for a first block; tokens)
        self._by_id: dict[int, _Node] = {}
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # node id -> node, least recently used first
        self._tenants: OrderedDict[str, set[int]] = OrderedDict()  # tenant -> its node ids, least recent first
        self._ids = itertools.count(1)
        self.hits = 0  # prompt tokens taken from here, in all
        self.evicted = 0  # blocks dropped for room

    @staticmethod
    def supports(forward) -> bool:
        """True when `forward` computes every cache entry independently of how the sequence was split into
        calls (goose's kernels for every layer: `LeanForward.plan`)."""
        return forward.plan is not None

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's entries (0 before the first store)."""
        pool = self._pool  # (read once: another thread may clear it meanwhile)
        return 0 if pool is None else pool[0].numel() * pool.element_size()

    @property
    def bytes(self) -> int:
        """Accounted bytes of the stored blocks (entries and bookkeeping: what `max_bytes` bounds)."""
        return len(self._nodes) * (self.block_bytes + NODE_BYTES)

    @property
    def tenants(self) -> int:
        return len(self._tenants)

    def clear(self) -> None:
        """Forget every block and release the pool."""
        self._nodes.clear()
        self._by_id.clear()
        self._lru.clear()
        self._tenants.clear()
        self._free = []
        self._pool = None

    def _walk(self, tokens: list[int], blocks: int, tenant: str) -> list[_Node]:
        found, parent = [], str(tenant)
        for b in range(blocks):
            node = self._nodes.get((parent, tuple(tokens[b * BLOCK : (b + 1) * BLOCK])))
            if node is None:
                break
            found.append(node)
            parent = node.id
        return found

    def _touch(self, path: list[_Node]) -> None:
        """Mark `path` (a first block and its descendants, in order) most recently used, its last block first,
        so every block stays more recent than its descendants."""
        for node in reversed(path):
            self._lru.move_to_end(node.id)
        if path:
            self._tenants.move_to_end(path[0].tenant)

    def attach(self, prompt: list[int], cache, more_than: int = 0, tenant: str = "") -> int:
        """Copy the longest prefix of `prompt` stored by `tenant` (whole blocks, leaving at least one token to
        prefill) into `cache`, which holds nothing else, if it is longer than `more_than` tokens (what `cache`
        already holds from here); returns its length in tokens (0: nothing longer stored, `cache` untouched)."""
        nodes = self._walk(prompt, (len(prompt) - 1) // BLOCK, tenant)
        if len(nodes) * BLOCK <= more_than:
            return 0
        self._touch(nodes)
        n = len(nodes) * BLOCK
        cache.write_prefix(torch.cat([self._pool[node.index] for node in nodes], dim=3))
        self.hits += n - more_than
        return n

    def store(self, tokens: list[int], cache, tenant: str = "") -> None:
        """Store the blocks of `tokens` whose entries `cache` holds (its first ``cache.length`` positions are
        those tokens') as `tenant`'s, skipping those already stored; older blocks (never this path's) make room."""
        blocks = min(len(tokens), cache.length) // BLOCK
        if blocks == 0 or self.max_bytes <= 0:
            return
        tenant = str(tenant)
        parent: int | str = tenant
        path: list[_Node] = []
        for b in range(blocks):
            key = (parent, tuple(tokens[b * BLOCK : (b + 1) * BLOCK]))
            node = self._nodes.get(key)
            if node is None:
                view = cache.entries(b * BLOCK, (b + 1) * BLOCK)
                index = self._slot_for(view, tenant, path)
                if index is None:
                    break
                self._pool[index].copy_(view)
                node = _Node(next(self._ids), key, tenant, index)
                self._nodes[key] = self._by_id[node.id] = node
                self._tenants.setdefault(tenant, set()).add(node.id)
                if not isinstance(parent, str):
                    self._by_id[parent].children += 1
            self._lru[node.id] = node
            self._lru.move_to_end(node.id)  # newer than every block off this path while the path grows
            path.append(node)
            parent = node.id
        self._touch(path)

    def _slot_for(self, view: torch.Tensor, tenant: str, path: list[_Node]) -> int | None:
        """A free pool index for a new block of `tenant` (made by evicting: other tenants past `max_tenants`,
        then least recently used leaves off `path`); None when the block cannot be kept."""
        if self._pool is None or self._pool.shape[1:] != view.shape or self._pool.dtype != view.dtype:
            capacity = self.max_bytes // (view.numel() * view.element_size() + NODE_BYTES)
            if capacity < 1:
                return None
            self.clear()
            self._pool = torch.empty((capacity, *view.shape), dtype=view.dtype, device=view.device)
            self._free = list(range(capacity - 1, -1, -1))
        if tenant not in self._tenants:
            while len(self._tenants) >= self.max_tenants:
                self._drop_tenant(next(iter(self._tenants)))
        if not self._free:
            oldest = next(iter(self._lru.values()), None)
            if oldest is None or oldest.id in {n.id for n in path}:
                return None
            self._remove(oldest)
            self.evicted += 1
        return self._free.pop()

    def _drop_tenant(self, tenant: str) -> None:
        for nid in list(self._tenants.get(tenant, ())):
            self._remove(self._by_id[nid])
            self.evicted += 1

    def _remove(self, node: _Node) -> None:
        """Drop one block (a leaf, or one whose descendants go with it: its whole tenant)."""
        del self._nodes[node.key], self._by_id[node.id], self._lru[node.id]
        self._free.append(node.index)
        owned = self._tenants[node.tenant]
        owned.discard(node.id)
        if not owned:
            del self._tenants[node.tenant]
        parent = node.key[0]
        if not isinstance(parent, str) and parent in self._by_id:
            self._by_id[parent].children -= 1
