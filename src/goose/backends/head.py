"""A draft head in the EAGLE layout: the target's features and the next token in, the next features and a
draft distribution out (Li et al., EAGLE / EAGLE-2).

A row at position j reads the target's final hidden state ``f_j`` (after its last norm: what the output head
reads, `Segment.features`) and the embedding of the token after it, ``x_{j+1}``::

    x   = fc([embed(x_{j+1}), f_j])                       [hidden]   (fc: [hidden, 2 * hidden])
    x   = x + o(attention(rms(x, ln1)))                   one Llama decoder layer, with its own KV cache
    out = x + down(silu(gate(rms(x, ln2))) * up(...))      ~ f_{j+1}: fed back as the next depth's feature
    logits = lm_head(rms(out, norm))                      [draft_vocab] -> target ids by `d2t`

so `out` predicts the target's next features and `logits` the token after ``x_{j+1}``. A fused head
(``feature_layers``, the feature fusion of EAGLE-3, Li et al., 2025) also reads the target's residual stream after
those decoder layers (RMS-normalized, `goose.protocols.tap_norm`): its depth-1 rows take ``f_j = fuse([tap_1, ...,
tap_n, final])`` (fuse: ``[hidden, (n + 1) * hidden]``), deeper rows the feature the head predicted, as before.
The draft vocabulary
is the `draft_vocab_size` most frequent target tokens (`d2t[i]`: the target id of draft id i, stored as
the offset ``target - i`` as EAGLE-3 checkpoints store it); the full vocabulary when the checkpoint has no
`lm_head` (EAGLE-1/2 checkpoints use the target's own output head; theirs has no `ln1`/`norm` either).

Files: a folder with ``config.json`` (a Llama config with ``num_hidden_layers`` 1, ``draft_vocab_size`` and
``goose.target``: what the head was trained for) and ``model.safetensors`` (``fc.weight``,
``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
``layers.0.{input,post_attention}_layernorm.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``), as
SpecForge and vLLM's speculators write EAGLE heads; a fused head adds ``fuse.weight`` and ``goose.feature_layers``
(goose's own layout: an EAGLE-3 checkpoint's ``midlayer`` reads its features differently and is refused).
`load_head` checks a head against the target model and names the file and the mismatch when it does not fit.

The head only shapes drafts: every token a method commits is the target's own, so nothing here can change an
output, whatever the head's weights or arithmetic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import GooseError

FORMAT = 1  # goose's version of the folder layout above
CONFIG, WEIGHTS = "config.json", "model.safetensors"
HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"  # the heads packaged with goose, a folder each


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    target: dict = field(default_factory=dict)  # what it was trained for: model_type, layers, embed digest, ...
    feature_layers: tuple[int, ...] = ()  # decoder layers whose residual stream the head also reads (fused)

    @classmethod
    def for_target(cls, model, draft_vocab_size: int, feature_layers: tuple[int, ...] = ()) -> "HeadConfig":
        c = model.config
        return cls(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                   getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads, c.intermediate_size,
                   model.get_output_embeddings().weight.shape[0], draft_vocab_size, float(c.rms_norm_eps),
                   float(getattr(c, "rope_theta", 10000.0)), target_identity(model), tuple(feature_layers))

    @property
    def features(self) -> bool | tuple[int, ...]:
        """What the head asks the target's forward for (`Segment.features`)."""
        return tuple(self.feature_layers) or True


def feature_layers_fit(taps, layers: int) -> bool:
    """Whether `taps` can be a fused head's `feature_layers` for a model of `layers` decoder layers: ascending
    indices of layers before its last (whose stream is the final state, read anyway)."""
    return list(taps) == sorted(set(taps)) and (not taps or 0 <= taps[0] <= taps[-1] < layers - 1)


def target_identity(model, bf16: bool = False) -> dict:
    """What a head must match: the target's shape and a digest of its output head's values (a head trained
    on another model of the same shape would be lossless but useless). `bf16`: the digest of the values rounded
    to bfloat16, the same for a float32 model and its bfloat16 copy (what a token-id snapshot compares)."""
    c = model.config
    w = model.get_output_embeddings().weight
    rows = w[:: max(1, w.shape[0] // 64)].detach()
    rows = (rows.to(torch.bfloat16) if bf16 else rows).float()
    return {"model_type": c.model_type, "hidden_size": c.hidden_size, "vocab_size": int(w.shape[0]),
            "num_hidden_layers": c.num_hidden_layers, "lm_head_digest": round(float(rows.abs().sum()), 2)}


def target_mismatch(trained: dict, model_identity: dict) -> list[str]:
    """What differs between the identity a head was trained for and a model's (`target_identity`): the shape
    exactly, the output head's digest within 0.1% (a bfloat16 copy of the same weights sums slightly apart)."""
    out = []
    for k, mine in model_identity.items():
        if k not in trained:
            continue
        theirs = trained[k]
        if k == "lm_head_digest" and isinstance(theirs, (int, float)):
            same = abs(theirs - mine) <= 1e-3 * max(abs(theirs), abs(mine), 1e-9)
        else:
            same = theirs == mine
        if not same:
            out.append(f"{k} {theirs} vs {mine}")
    return out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


class DraftHead(nn.Module):
    """The head's weights and forward (see the module docstring); `embed` is the target's embedding table."""

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor, norms: bool = True, own_lm_head: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        h, hd, H, K, inter = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, \
            cfg.intermediate_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        # a fused head: the tapped layers' streams and the final state -> one feature (depth 1 only: deeper rows
        # read the feature the head predicted)
        nf = len(cfg.feature_layers)
        self.fuse = nn.Linear((nf + 1) * h, h, bias=False) if nf else None
        self.q_proj, self.k_proj = nn.Linear(h, H * hd, bias=False), nn.Linear(h, K * hd, bias=False)
        self.v_proj, self.o_proj = nn.Linear(h, K * hd, bias=False), nn.Linear(H * hd, h, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.ln1 = nn.Parameter(torch.ones(h)) if norms else None
        self.ln2 = nn.Parameter(torch.ones(h))
        self.norm = nn.Parameter(torch.ones(h)) if norms else None
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False) if own_lm_head else None
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size), persistent=False)  # draft id -> target id
        self.embed = embed.detach()  # the target's [vocab, hidden] (not a parameter of the head)
        self.embed_out: torch.Tensor | None = None  # the target's output head, for heads without their own
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        self.register_buffer("inv_freq", inv, persistent=False)

    # ---- forward ---------------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = positions.to(torch.float32)[..., None] * self.inv_freq
        f = torch.cat([f, f], dim=-1)
        return f.cos(), f.sin()

    def layer(self, tokens: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor, past=None,
              mask: torch.Tensor | None = None, cache: "HeadCache | None" = None, at: int = 0):
        """Rows ``[B, n]`` of (token after, feature): returns ``(out [B, n, hidden], (k, v))`` with this call's
        keys and values ``[B, K, n, D]``. `past`: earlier keys and values ``[B, K, P, D]`` the rows also see;
        or `cache` (B = 1): the rows' keys and values are written at row `at` of it and the rows see its first
        `at` rows (P = at). `mask`: ``[n, P + n]`` bool (True: may attend), default causal over past + rows."""
        c = self.cfg
        B, n = tokens.shape
        if feats.shape[-1] != c.hidden_size:  # the target's fused features (a depth-1 row)
            feats = self.fuse(feats)
        x = self.fc(torch.cat([self.embed[tokens].to(feats.dtype), feats], dim=-1))
        a = F.rms_norm(x, (c.hidden_size,), self.ln1.to(x.dtype), c.rms_norm_eps) if self.ln1 is not None else x
        q = self.q_proj(a).view(B, n, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(a).view(B, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(a).view(B, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions)
        cos, sin = cos.to(q.dtype)[:, None], sin.to(q.dtype)[:, None]  # [B, 1, n, D]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if cache is not None:
            kk, vv = cache.write(at, k, v)
            past = True
        else:
            kk, vv = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        if mask is None and past is None:
            o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=True)
        else:
            if mask is None:
                P = kk.shape[2] - n
                mask = torch.ones(n, P + n, dtype=torch.bool, device=q.device).tril_(P)
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=True)
        x = x + self.o_proj(o.transpose(1, 2).reshape(B, n, -1))
        m = F.rms_norm(x, (c.hidden_size,), self.ln2.to(x.dtype), c.rms_norm_eps)
        x = x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
        return x, (k, v)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the head's outputs (`d2t` maps their columns to target ids)."""
        h = out if self.norm is None else \
            F.rms_norm(out, (self.cfg.hidden_size,), self.norm.to(out.dtype), self.cfg.rms_norm_eps)
        return self.lm_head(h) if self.lm_head is not None else h @ self.embed_out.T

    # ---- files -----------------------------------------------------------------------------------------
    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The weights under the EAGLE checkpoint names (see the module docstring), those this head has."""
        out = [("fc.weight", self.fc.weight)] + ([("fuse.weight", self.fuse.weight)] if self.fuse is not None else [])
        out += [(f"layers.0.self_attn.{n}.weight", getattr(self, n).weight) for n in ("q_proj", "k_proj", "v_proj",
                                                                                    "o_proj")]
        out += [(f"layers.0.mlp.{n}.weight", getattr(self, n).weight) for n in ("gate_proj", "up_proj", "down_proj")]
        out.append(("layers.0.post_attention_layernorm.weight", self.ln2))
        for name, t in (("layers.0.input_layernorm.weight", self.ln1), ("norm.weight", self.norm),
                        ("lm_head.weight", None if self.lm_head is None else self.lm_head.weight)):
            if t is not None:
                out.append((name, t))
        return out

    def state(self) -> dict[str, torch.Tensor]:
        """`named` with `d2t` (as offsets), detached: what a checkpoint holds."""
        out = dict(self.named())
        out["d2t"] = self.d2t - torch.arange(len(self.d2t))
        return {k: v.detach().contiguous() for k, v in out.items()}


def q8_0_rows(w: torch.Tensor):
    """``w [n, k]`` (k a multiple of 32) as GGUF Q8_0 rows: per 32 weights a float16 scale and 32 int8 values."""
    import numpy as np

    n, k = w.shape
    b = w.detach().float().reshape(n, k // 32, 32).numpy()
    d = (np.abs(b).max(axis=2) / 127.0).astype(np.float16)
    safe = np.where(d.astype(np.float32) > 0, d.astype(np.float32), 1.0)
    q = np.clip(np.rint(b / safe[..., None]), -127, 127).astype(np.int8)
    rows = np.concatenate([d.view(np.uint8).reshape(n, k // 32, 2), q.view(np.uint8)], axis=2).reshape(n, -1)
    return [np.ascontiguousarray(r) for r in rows]


def q4_0_rows(w: torch.Tensor):
    """``w [n, k]`` (k a multiple of 32) as GGUF Q4_0 rows: per 32 weights a float16 scale ``d`` (the weight of
    largest magnitude over -8) and 32 4-bit values ``q`` (weight = (q - 8) d; the first 16 in the low nibbles, the
    last 16 in the high ones), rounded as GGUF's reference quantizer rounds."""
    import numpy as np

    n, k = w.shape
    b = w.detach().float().reshape(n, k // 32, 32).numpy()
    at = np.abs(b).argmax(axis=2)
    big = np.take_along_axis(b, at[..., None], axis=2)[..., 0]
    d = (big / -8.0).astype(np.float32)
    inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1.0), 0.0).astype(np.float32)
    q = np.minimum(15, np.trunc(b * inv[..., None] + 8.5)).astype(np.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    rows = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(n, k // 32, 2), packed], axis=2).reshape(n, -1)
    return [np.ascontiguousarray(r) for r in rows]


class FastHead:
    """The head's forward for drafting on goose's CPU kernels: its input projection and decoder layer in one kernel
    call per step (`CpuKernels.head_layer`: each projection reads its weight once, with the RMSNorms, silu(gate) * up
    and the residual adds fused in, attention on the head's cache as the target's), the logits in one more. The
    weights are held as GGUF blocks of `fmt` (Q8_0: a quarter of float32's bytes, Q4_0: an eighth) times 8-bit
    activations (`goose.backends.int8`) where those kernels run, else as goose's float32 panels. Only drafts depend
    on the head, so its arithmetic is free."""

    def __init__(self, head: "DraftHead", fmt: str = "Q8_0") -> None:
        from . import cpukernel, int8, quant
        from .packed import PanelWeight

        c = head.cfg
        if cpukernel.unavailable_reason() is not None:
            raise GooseError(f"goose's CPU kernels cannot run here: {cpukernel.unavailable_reason()}")
        ck, ik, qk = cpukernel.kernel(), int8.kernels(), quant.kernels_or_none()
        whole = all(w.shape[1] % 32 == 0 for w in (head.fc.weight, head.o_proj.weight, head.down_proj.weight))
        blocks = ik is not None and qk is not None and whole

        def op(w: torch.Tensor, bias: torch.Tensor | None = None):
            """`w` packed for this arithmetic: its plan op and its `linear`."""
            w = w.detach().float().contiguous()
            b = None if bias is None else ck.pack_bias(bias.detach().float(), w.shape[0])
            if blocks:
                qw = qk.pack(fmt, (q8_0_rows if fmt == "Q8_0" else q4_0_rows)(w), w.shape[1])
                return ik.op(qw, qw.n, b), lambda x, **f: ik.linear(x, qw, qw.n, b, **f)
            pw = PanelWeight.pack(ck, w)
            return ck.op(pw.data, pw.n, b), lambda x, **f: pw.linear(x, b, **f)

        self.kind = f"{fmt.lower()}-int8" if blocks else "float32"
        eps = float(c.rms_norm_eps)
        norm = lambda w: None if w is None else w.detach().float().contiguous()  # noqa: E731
        fc, _ = op(head.fc.weight, head.fc.bias)
        qkv, _ = op(torch.cat([head.q_proj.weight, head.k_proj.weight, head.v_proj.weight]))
        gate_up, _ = op(torch.cat([head.gate_proj.weight, head.up_proj.weight]))
        layer = (norm(head.ln1), eps, norm(head.ln2), eps, qkv, op(head.o_proj.weight)[0], gate_up,
                 op(head.down_proj.weight)[0])
        self._step = ck.head_layer(fc, layer, c.num_attention_heads)
        self._first = None  # a fused head's depth-1 rows: fuse folded into fc's feature half, one projection
        if head.fuse is not None:
            w, h = head.fc.weight.detach().float(), c.hidden_size
            folded = torch.cat([w[:, :h], w[:, h:] @ head.fuse.weight.detach().float()], 1)
            self._first = ck.head_layer(op(folded, head.fc.bias)[0], layer, c.num_attention_heads)
        _, self.lm = op(head.lm_head.weight if head.lm_head is not None else head.embed_out)
        self.norm = None if head.norm is None else (norm(head.norm), eps)
        self._cos = self._sin = torch.empty(0, c.head_dim)
        self.head = head

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables ``[n, D]`` of `positions`, from tables grown by doubling."""
        top = int(positions.max()) + 1
        if top > len(self._cos):
            self._cos, self._sin = self.head.rope(torch.arange(max(256, top, 2 * len(self._cos))))
        return self._cos[positions], self._sin[positions]

    def layer(self, tokens: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor, cache: "HeadCache",
              at: int, allowed: torch.Tensor | None = None, back: int = 0) -> torch.Tensor:
        """`DraftHead.layer` for one sequence: rows ``[n]`` in, ``out [n, hidden]`` back; keys and values into
        `cache` at `at`. The rows see the cache's rows before ``at - back``, and rows ``at - back .. at + n - 1``
        as ``allowed [n, back + n]`` says (None: causally)."""
        c, head = self.head.cfg, self.head
        emb = head.embed
        emb = emb.rows_of(tokens.tolist()) if hasattr(emb, "rows_of") else emb[tokens].float()
        inp = torch.cat([emb, feats if feats.dtype == torch.float32 else feats.float()], dim=-1)
        cache.reserve(at, at + len(tokens), c.num_key_value_heads, c.head_dim, torch.float32)
        cos, sin = self._rope(positions)
        step = self._step if feats.shape[-1] == c.hidden_size else self._first
        if step is None:
            raise GooseError(f"the head reads features of {c.hidden_size}, not {feats.shape[-1]}")
        return step(inp, cos, sin, cache.k[0], cache.v[0], at, allowed, back)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm(out, norm=self.norm) if self.norm is not None else self.lm(out)


class HeadCache:
    """One sequence's head keys and values, ``[1, K, capacity, D]`` each, preallocated and grown by doubling."""

    def __init__(self) -> None:
        self.k = self.v = None

    def reserve(self, at: int, end: int, heads: int, dim: int, dtype: torch.dtype, device=None) -> None:
        """Room for rows up to `end` (rows before `at` kept)."""
        if self.k is None or self.k.shape[2] < end or self.k.dtype != dtype:
            cap = max(256, end, 2 * (0 if self.k is None else self.k.shape[2]))
            nk = torch.empty(1, heads, cap, dim, dtype=dtype, device=device)
            nv = torch.empty_like(nk)
            if self.k is not None:
                nk[:, :, :at] = self.k[:, :, :at]
                nv[:, :, :at] = self.v[:, :, :at]
            self.k, self.v = nk, nv

    def write(self, at: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[1, K, n, D]`` written at `at`; returns the keys and values of rows ``0 .. at + n``."""
        end = at + k.shape[2]
        self.reserve(at, end, k.shape[1], k.shape[3], k.dtype, k.device)
        self.k[:, :, at:end] = k
        self.v[:, :, at:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


def save_head(head: DraftHead, folder: Path, extra: dict | None = None, dtype=torch.float16) -> Path:
    """Write `head` into `folder` (config.json + model.safetensors, each replaced atomically)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = head.cfg
    fused = {"feature_layers": list(c.feature_layers)} if c.feature_layers else {}
    config = {"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
              "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
              "draft_vocab_size": c.draft_vocab_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
              "hidden_act": "silu", "goose": {"format": FORMAT, "target": c.target, **fused, **(extra or {})}}
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in head.state().items()}
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(folder / WEIGHTS)
    tmp = folder / (CONFIG + ".tmp")
    tmp.write_text(json.dumps(config, indent=1) + "\n")
    tmp.replace(folder / CONFIG)
    return folder


def load_head(folder: str | Path, model, dtype=torch.float32) -> DraftHead:
    """The head in `folder`, checked against the target `model`: a missing or damaged file, or a head that
    does not fit (hidden size, vocabulary, heads, the model it was trained for) is one GooseError naming the
    file and the mismatch."""
    folder = Path(folder).expanduser()
    cpath, wpath = folder / CONFIG, folder / WEIGHTS
    for p in (cpath, wpath):
        if not p.is_file():
            raise GooseError(f"draft head: {p} is missing (a head is a folder with {CONFIG} and {WEIGHTS})")
    try:
        raw = json.loads(cpath.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise GooseError(f"draft head: {cpath} is not a readable JSON config ({exc})") from None
    try:
        from safetensors import safe_open

        with safe_open(str(wpath), "pt") as f:
            w = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise GooseError(f"draft head: {wpath} is not a readable safetensors file ({type(exc).__name__}: "
                         f"{exc})") from None
    c = model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    hidden = c.hidden_size

    def bad(what: str) -> GooseError:
        return GooseError(f"draft head {folder} does not fit this model: {what}")

    if "fc.weight" not in w:
        raise bad(f"{wpath.name} has no fc.weight (not an EAGLE head)")
    fc = w["fc.weight"]
    if any(k.startswith("midlayer.") for k in w) or fc.shape[1] == 3 * hidden:
        raise bad("it is an EAGLE-3 head (it fuses three layers' features); goose hands a head the last layer's "
                  "features (EAGLE-1/2 heads)")
    if raw.get("hidden_size") != hidden or tuple(fc.shape) != (hidden, 2 * hidden):
        raise bad(f"hidden size {raw.get('hidden_size')} (fc {tuple(fc.shape)}), the model's is {hidden}")
    if raw.get("vocab_size", vocab) != vocab:
        raise bad(f"vocabulary of {raw.get('vocab_size')} tokens, the model's is {vocab}")
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise bad(f"{raw.get('num_hidden_layers')} decoder layers; an EAGLE head has one")
    target = (raw.get("goose") or {}).get("target")
    taps = (raw.get("goose") or {}).get("feature_layers") or []
    if (not isinstance(taps, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in taps)
            or not feature_layers_fit(taps, c.num_hidden_layers)):
        raise bad(f"feature_layers {taps!r}: ascending indices of the model's decoder layers before its last "
                  f"({c.num_hidden_layers - 1})")
    if target:
        diff = target_mismatch(target, target_identity(model))
        if diff:
            raise bad("trained for another model (" + ", ".join(diff) + ")")
    try:
        cfg = HeadConfig(hidden, int(raw["num_attention_heads"]), int(raw.get("num_key_value_heads",
                         raw["num_attention_heads"])), int(raw.get("head_dim") or hidden // raw["num_attention_heads"]),
                         int(raw["intermediate_size"]), vocab, int(raw.get("draft_vocab_size") or vocab),
                         float(raw.get("rms_norm_eps", 1e-5)), float(raw.get("rope_theta", 10000.0)), target or {},
                         tuple(taps))
    except (KeyError, TypeError, ValueError) as exc:
        raise GooseError(f"draft head: {cpath} lacks or garbles {exc}") from None
    own = "lm_head.weight" in w
    if not own and cfg.draft_vocab_size != vocab:
        raise bad(f"draft vocabulary of {cfg.draft_vocab_size} tokens without its own lm_head.weight")
    head = DraftHead(cfg, model.get_input_embeddings().weight, norms="norm.weight" in w, own_lm_head=own)
    if not own:  # the target's output head, in float32 (rows of GGUF blocks are read out whole)
        out_w = model.get_output_embeddings().weight
        head.embed_out = (out_w if isinstance(out_w, torch.Tensor) else out_w[torch.arange(vocab)]).detach().float()
    names = dict(head.named())
    for k, t in names.items():
        if k not in w:
            raise bad(f"{wpath.name} has no {k}")
        if tuple(w[k].shape) != tuple(t.shape):
            raise bad(f"{k} is {tuple(w[k].shape)}, expected {tuple(t.shape)}")
    extra = sorted(set(w) - set(names) - {"d2t", "t2d", "embed_tokens.weight", "fc.bias"})
    if extra:
        raise bad(f"{wpath.name} holds weights goose does not know: {', '.join(extra[:4])}")
    with torch.no_grad():
        for k, p in names.items():
            p.copy_(w[k].to(p.dtype))
        if "d2t" in w:
            d2t = w["d2t"].long().reshape(-1)
            if len(d2t) != cfg.draft_vocab_size:
                raise bad(f"d2t has {len(d2t)} entries for a draft vocabulary of {cfg.draft_vocab_size}")
            ids = d2t + torch.arange(len(d2t))
            if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                raise bad("d2t maps draft tokens outside the model's vocabulary")
            head.d2t = ids
        if "fc.bias" in w:
            head.fc.bias = nn.Parameter(w["fc.bias"].float())
    return head.to(dtype).eval()


def packaged_head(model) -> Path | None:
    """The packaged head trained for `model` (its config's ``goose.target`` equals the model's identity), if any."""
    if not HEADS_DIR.is_dir():
        return None
    mine = target_identity(model)
    for folder in sorted(p for p in HEADS_DIR.iterdir() if p.is_dir()):
        try:
            raw = json.loads((folder / CONFIG).read_text())
        except (OSError, ValueError):
            continue
        target = (raw.get("goose") or {}).get("target") if isinstance(raw, dict) else None
        if isinstance(target, dict) and set(target) == set(mine) and not target_mismatch(target, mine):
            return folder
    return None
