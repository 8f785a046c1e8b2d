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
Limits: `max_bytes` (the engine's ``prefix_cache_mb``); the least recently used blocks with no stored
continuation go first. At least one prompt token is always left to prefill (its logits give the first
token).
"""

from __future__ import annotations

import itertools

import torch

BLOCK = 8  # tokens per stored block


class _Node:
    __slots__ = ("id", "key", "kv", "nbytes", "children", "used")

    def __init__(self, nid: int, key: tuple, kv: torch.Tensor, used: int) -> None:
        self.id, self.key, self.kv, self.children, self.used = nid, key, kv, 0, used
        self.nbytes = kv.numel() * kv.element_size()


class PrefixCache:
    """The stored blocks (see the module doc); `attach` at a request's start, `store` when entries are final."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._nodes: dict[tuple, _Node] = {}  # (parent node's id, or the tenant (a str) for a first block; tokens)
        self._by_id: dict[int, _Node] = {}
        self._clock = itertools.count(1)
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

    def clear(self) -> None:
        self._nodes.clear()
        self._by_id.clear()
        self.bytes = 0

    def _walk(self, tokens: list[int], blocks: int, tenant: str) -> list[_Node]:
        found, parent = [], str(tenant)
        for b in range(blocks):
            node = self._nodes.get((parent, tuple(tokens[b * BLOCK : (b + 1) * BLOCK])))
            if node is None:
                break
            found.append(node)
            parent = node.id
        return found

    def attach(self, prompt: list[int], cache, more_than: int = 0, tenant: str = "") -> int:
        """Copy the longest prefix of `prompt` stored by `tenant` (whole blocks, leaving at least one token to
        prefill) into `cache`, which holds nothing else, if it is longer than `more_than` tokens (what `cache`
        already holds from here); returns its length in tokens (0: nothing longer stored, `cache` untouched)."""
        nodes = self._walk(prompt, (len(prompt) - 1) // BLOCK, tenant)
        if len(nodes) * BLOCK <= more_than:
            return 0
        now = next(self._clock)
        for node in nodes:
            node.used = now
        n = len(nodes) * BLOCK
        cache.write_prefix(torch.cat([node.kv for node in nodes], dim=3))
        self.hits += n - more_than
        return n

    def store(self, tokens: list[int], cache, tenant: str = "") -> None:
        """Store the blocks of `tokens` whose entries `cache` holds (its first ``cache.length`` positions are
        those tokens') as `tenant`'s, skipping those already stored; then evict down to `max_bytes`."""
        blocks = min(len(tokens), cache.length) // BLOCK
        if blocks == 0 or self.max_bytes <= 0:
            return
        now = next(self._clock)
        parent = str(tenant)
        for b in range(blocks):
            key = (parent, tuple(tokens[b * BLOCK : (b + 1) * BLOCK]))
            node = self._nodes.get(key)
            if node is None:
                view = cache.entries(b * BLOCK, (b + 1) * BLOCK)
                if view.numel() * view.element_size() > self.max_bytes:
                    break
                node = _Node(next(self._ids), key, view.clone(), now)
                self._nodes[key] = self._by_id[node.id] = node
                self.bytes += node.nbytes
                if not isinstance(parent, str):
                    self._by_id[parent].children += 1
            node.used = now
            parent = node.id
        self._evict(protect=now)

    def _evict(self, protect: int) -> None:
        """Drop least recently used leaf blocks until the stored bytes fit (blocks used at `protect`, the
        current store, go last)."""
        while self.bytes > self.max_bytes and self._nodes:
            leaf = min((n for n in self._nodes.values() if n.children == 0),
                       key=lambda n: (n.used == protect, n.used))
            del self._nodes[leaf.key], self._by_id[leaf.id]
            self.bytes -= leaf.nbytes
            self.evicted += 1
            if not isinstance(leaf.key[0], str):
                self._by_id[leaf.key[0]].children -= 1
