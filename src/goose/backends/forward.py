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
from contextlib import contextmanager, nullcontext

import torch
from transformers import DynamicCache

from ..errors import GooseError
from ..protocols import Forward, KVCache, check_taps, feature_taps, with_taps
from .kv_cache import cache_length, keep_path
from .packed import PackedWeight
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


class _KernelLinears:
    """Every float32 ``nn.Linear`` of a model on goose's CPU kernel (weights packed once), switched in only
    for the duration of goose's own forward calls (`active`); the model is untouched otherwise. (So
    another thread running the same model during one of goose's calls would run on the kernel too:
    same results up to float32 rounding.)"""

    def __init__(self, kernel, model) -> None:
        self.items = []  # (module, forward on the kernel)
        for m in model.modules():
            if type(m) is torch.nn.Linear:
                self.items.append((m, self._forward(kernel, m)))

    @staticmethod
    def _forward(kernel, m):
        packed, bias = kernel.pack(m.weight), kernel.pack_bias(m.bias, m.out_features)
        n, k = m.out_features, m.in_features

        def forward(x: torch.Tensor) -> torch.Tensor:
            return kernel.linear(x.reshape(-1, k), packed, n, bias).view(*x.shape[:-1], n)

        return forward

    @contextmanager
    def active(self):
        saved = [m.__dict__.get("forward") for m, _ in self.items]  # a hook's own override, if any
        for m, fast in self.items:
            m.forward = fast
        try:
            yield
        finally:
            for (m, _), old in zip(self.items, saved):
                if old is None:
                    del m.forward
                else:
                    m.forward = old


class HFForward(Forward):
    """Generic forward over a Hugging Face model and its DynamicCache."""

    def __init__(self, model, *, kernel: bool | None = None) -> None:
        """`kernel`: None = run the model's ``nn.Linear`` layers on goose's CPU kernel (`cpukernel`) during
        goose's calls, where it is available and reproduces the model's logits (float32 on CPU; checked
        once on a short input; one packed copy of those weights); False = the model as it is; True =
        require the kernel."""
        check_attention(model)
        self.kinds, self.window = attention_layers(model)
        self.model = model
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.fingerprint = weights_fingerprint(model)
        self.cache = self.new_cache()  # the cache of the single-sequence API (reset / __call__ / keep)
        self.linears = None if kernel is False else self._kernel_linears(required=bool(kernel))
        self.backend = "hf+goose-kernel" if self.linears is not None else "hf"

    def _kernel_linears(self, required: bool) -> _KernelLinears | None:
        """The model's linear layers on goose's kernel when that reproduces its logits, else None (or
        GooseError when `required`)."""
        linears, why = self._try_kernel()
        if linears is None and required:
            raise GooseError(f"goose's CPU kernel cannot run this model: {why}")
        return linears

    def _try_kernel(self) -> tuple[_KernelLinears | None, str | None]:
        from . import cpukernel

        if self.device.type != "cpu" or self.dtype != torch.float32:
            return None, "it needs float32 weights on CPU"
        why = cpukernel.unavailable_reason()
        if why is not None:
            return None, why
        model = self.model
        linears = _KernelLinears(cpukernel.kernel(), model)
        if not linears.items:
            return None, "the model has no nn.Linear layers"
        ids = torch.tensor([[1, 2, 3]], device=self.device) % model.get_output_embeddings().weight.shape[0]
        with torch.inference_mode():
            ref = model(ids, use_cache=False).logits[0]
            with linears.active():
                ours = model(ids, use_cache=False).logits[0]
        tol = 1e-4 * max(1.0, ref.abs().max().item())
        if torch.allclose(ours, ref, rtol=1e-4, atol=tol):
            return linears, None
        return None, "the model's logits changed with its linear layers on the kernel"

    def new_cache(self) -> "HFCache":
        """A KV cache of its own for one sequence (one per request: nothing is shared between caches)."""
        return HFCache()

    def stale(self) -> bool:
        """True when the model's weights changed since this forward was built (its packed copies are old)."""
        return self.linears is not None and weights_fingerprint(self.model) != self.fingerprint

    def __call__(self, tokens: list[int], depths: torch.Tensor | None = None,
                 allowed: torch.Tensor | None = None, keep_last: int | None = None) -> torch.Tensor:
        """Logits ``[n, vocab]`` for `tokens` appended after the cache; only the last `keep_last` rows
        (>= 1) when given, so a prefill skips the vocabulary projection where nothing reads it.

        With `allowed` (``[n, n]`` ancestor mask) and `depths` (``[n]``) the tokens form a tree;
        without, they form a causal run.
        """
        return self._one(self.cache, tokens, depths, allowed, keep_last)

    def run(self, segments) -> list[torch.Tensor]:
        """Several sequences' forwards (`goose.protocols.Segment`s), one after another: a Hugging Face model takes one
        cache per call, and padding a batch of trees would change nothing of what is computed per row."""
        if len({id(s.cache) for s in segments}) != len(segments):
            raise GooseError("a forward cannot append to one cache twice")
        return [self._features(s) if s.features else self._one(s.cache, s.tokens, s.depths, s.allowed, s.keep_last)
                for s in segments]

    def _features(self, s) -> torch.Tensor:
        """`_one`, also setting ``s.hidden``: the output of the model's final norm (what its output head reads),
        caught by a hook."""
        norm = getattr(getattr(self.model, "model", None), "norm", None)
        if not isinstance(norm, torch.nn.Module):
            raise GooseError(f"{type(self.model).__name__} has no model.norm: its final hidden states (a draft "
                             "head's input) cannot be read")
        taps = feature_taps(s.features)
        layers = getattr(self.model.model, "layers", ())
        check_taps(taps, len(layers))
        caught, tapped = [], {}

        def tap(i):
            return lambda mod, args, out: tapped.__setitem__(i, out[0] if isinstance(out, tuple) else out)

        hooks = [norm.register_forward_hook(lambda mod, args, out: caught.append(out))]
        hooks += [layers[t].register_forward_hook(tap(t)) for t in taps]
        try:
            logits = self._one(s.cache, s.tokens, s.depths, s.allowed, s.keep_last)
        finally:
            for h in hooks:
                h.remove()
        s.hidden = with_taps(caught[-1][0], [tapped[t][0] for t in taps])
        return logits

    def _one(self, cache: "HFCache", tokens, depths, allowed, keep_last) -> torch.Tensor:
        if cache.dc is None:
            cache.reset()
        p = cache.length
        n = len(tokens)
        if n == 0:
            raise GooseError("no tokens to forward")
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, n]
        if allowed is None and self.window is None:  # causal run, full layers only: the model's own mask
            pos = torch.arange(p, p + n, device=self.device)[None]  # [1, n]
            mask = None
        else:
            if allowed is None:  # causal run through sliding layers: an explicit windowed mask
                depths, allowed = torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril_()
            pos = (depths.to(self.device) + p)[None]  # [1, n]
            mask = self._masks(allowed, depths, p)
        keep = {"logits_to_keep": keep_last} if keep_last and self._keeps_logits else {}
        with torch.inference_mode(), self.linears.active() if self.linears is not None else nullcontext():
            out = self.model(ids, attention_mask=mask, position_ids=pos, cache=cache.dc, use_cache=True, **keep)
        cache.prefix = p
        return out.logits[0, -keep_last:] if keep_last else out.logits[0]  # [n or keep_last, vocab]

    def _masks(self, allowed: torch.Tensor, depths: torch.Tensor, p: int):
        """The 4D mask ``[1, 1, n, p + n]`` for the model's layers, or a dict of them by layer kind."""
        masks = {}
        if FULL in self.kinds:
            masks[FULL] = additive_mask(allowed, p, self.dtype, self.device)
        if SLIDING in self.kinds:
            masks[SLIDING] = additive_mask(allowed, p, self.dtype, self.device, depths, self.window)
        return masks if len(masks) > 1 else next(iter(masks.values()))


class HFCache(KVCache):
    """One sequence's Hugging Face cache (a bare `DynamicCache`, see the module docstring) and the length it
    had before the last forward."""

    def __init__(self) -> None:
        self.dc = None
        self.prefix = 0

    def reset(self) -> None:
        self.dc = DynamicCache()  # every layer keeps every entry
        self.prefix = 0

    @property
    def length(self) -> int:
        return cache_length(self.dc)

    def keep(self, path: list[int]) -> None:
        """Keep the prefix and the nodes `path` of the last call (in that order); drop the rest."""
        keep_path(self.dc, self.prefix, path)


def weights_fingerprint(model) -> tuple:
    """Storage and in-place version of every parameter and buffer of `model`. It changes with any in-place
    update (an optimizer step, ``load_state_dict``, a merged adapter: each bumps the tensor's version counter)
    and with any replaced tensor or module (a `PackedLinear`'s packed data counts as its weight), so a forward
    that copied or packed weights can tell they are stale. The module tree is walked by hand through each
    module's own dicts (~6x cheaper than ``parameters()`` + ``buffers()``; 0.13 ms for SmolLM2-135M: an
    engine asks every few steps)."""
    out: list[int] = []
    add = out.append
    stack = [model]
    pop, push = stack.pop, stack.extend
    while stack:
        module = pop()
        if module is None:  # (a child slot set to None)
            continue
        d = module.__dict__
        packed = d.get("weight")  # a PackedLinear / PackedEmbedding: its packed data
        if isinstance(packed, PackedWeight):
            _add_tensor(add, packed.data)
        for t in d["_parameters"].values():
            if t is not None:
                _add_tensor(add, t)
        for t in d["_buffers"].values():
            if t is not None:
                _add_tensor(add, t)
        push(d["_modules"].values())
    return tuple(out)


def _add_tensor(add, t: torch.Tensor) -> None:
    add(t.data_ptr())
    try:
        add(t._version)
    except RuntimeError:  # an inference tensor keeps no version counter (it cannot be updated in place)
        add(-1)
