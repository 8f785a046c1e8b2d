"""Kernels whose result for a row does not depend on how many rows a call holds: the exact ("fixed") mode of
`goose.backends.cuda.GPUForward`.

GEMM and attention libraries pick their tiling and reduction order from the problem's shape, so a token's logits in
a forward of 60 tree nodes can differ in the last bits from the same token decoded alone; a greedy walk then may
pick another token at a near-tie. Here every reduction runs in an order fixed by the row's own data:

* `linear`: ``y = x W^T (+ b)`` in tiles of fixed size (BLOCK_M rows, BLOCK_N columns, BLOCK_K deep) whatever M,
  accumulated in float32 over the K tiles in order. A row's products never meet another row's. On CUDA a tile is
  one `tl.dot` (tensor-core MMA; that its result for a row does not depend on the row's place in the tile is
  asserted by tests/test_cuda.py on the GPU). Under Triton's interpreter `tl.dot` is numpy's matmul, whose result
  for a row does depend on its place in the tile (measured: rows 6-15 of a 16-row float32 tile round differently
  from rows 0-5), so there the tile is products summed over its depth in order.
* `rms_norm`: one program per row, the sum of squares accumulated in BLOCK lanes over the row in order, then
  summed once.
* `silu_mul`: ``silu(gate) * up`` elementwise, the same code for every element.
* `attention`: one program per (row, head) over the row's own key sequence: the P cached entries, then its
  ancestors in the tree in order of depth and itself (an ``anc [B, B]`` table: row i's ancestor at depth d is
  tree row ``anc[i, d]``). That sequence is the one a plain decoding step of the same token reads from its cache
  (P + depth + 1 entries at the same positions), and it is reduced in blocks of BLOCK_T keys from its start
  with an online softmax, so a tree node's attention equals the plain step's bit for bit.

Two implementations with these properties: Triton kernels (`triton` importable: the GPU path; on CPU they run
under Triton's interpreter, ``TRITON_INTERPRET=1``, which the tests use at tiny shapes), and a plain PyTorch one
(`TorchFixed`) that loops over rows with calls of one fixed shape per row (slow: for tests and CPUs without
Triton). The two give different bits; each is row-count independent on its own.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..errors import GooseError

try:  # Triton is optional: the GPU machine's PyTorch ships it; the CPU test environment need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


def triton_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None when they can."""
    if triton is None:
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"Triton runs on CUDA devices (or on CPU under TRITON_INTERPRET=1), not on '{device.type}'"


# ---- Triton kernels ---------------------------------------------------------------------------------------------
_BUILT: dict = {}


def _kernels():
    """The Triton kernels, made on first use (so TRITON_INTERPRET is read then, not when goose is imported): the
    interpreted ones and the compiled ones are kept apart."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret not in _BUILT:
        _BUILT[interpret] = _define()
    return _BUILT[interpret]


def _define() -> SimpleNamespace:

    # Arguments that vary from call to call (the row count, where a row-slice starts, a bucket's table strides)
    # are not specialized on: a specialization compiles other code, which could reduce in another order.
    @triton.jit(do_not_specialize=["x", "M"])
    def _linear_kernel(x, w, b, y, M, N, K, sxm, swn, sym,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)  # [BM]
        rn = pn * BN + tl.arange(0, BN)  # [BN]
        rk = tl.arange(0, BK)  # [BK]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x + rm[:, None] * sxm + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :], other=0.0)
            bt = tl.load(w + rn[None, :] * swn + kk[:, None], mask=(rn < N)[None, :] & (kk < K)[:, None], other=0.0)
            if not DOT:  # products, then a sum over the tile's depth in order (the interpreter's path)
                acc += tl.sum(a.to(tl.float32)[:, :, None] * bt.to(tl.float32)[None, :, :], 1)
            elif IEEE:
                acc = tl.dot(a, bt, acc, input_precision="ieee")  # [BM, BN], no TF32
            else:
                acc = tl.dot(a, bt, acc)
        if HAS_BIAS:
            acc = acc + tl.load(b + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y + rm[:, None] * sym + rn[None, :], acc.to(y.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])

    @triton.jit(do_not_specialize=["x", "y"])
    def _rms_kernel(x, w, y, N, eps, sx, sy, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        lanes = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, N, BLOCK):
            v = tl.load(x + row * sx + k0 + lanes, mask=k0 + lanes < N, other=0.0).to(tl.float32)
            acc += v * v
        r = tl.rsqrt(tl.sum(acc, 0) / N + eps)
        for k0 in range(0, N, BLOCK):
            m = k0 + lanes < N
            v = tl.load(x + row * sx + k0 + lanes, mask=m, other=0.0).to(tl.float32)
            h = (v * r).to(y.dtype.element_ty).to(tl.float32)  # HF: normalize in float32, cast, then scale
            g = tl.load(w + k0 + lanes, mask=m, other=0.0).to(tl.float32)
            tl.store(y + row * sy + k0 + lanes, (g * h).to(y.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["gu", "y"])
    def _silu_mul_kernel(gu, y, inter, sg, sy, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        g = tl.load(gu + row * sg + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu + row * sg + inter + cols, mask=m, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(y.dtype.element_ty).to(tl.float32)  # silu in the model's dtype, as HF
        tl.store(y + row * sy + cols, (s * u).to(y.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["q", "o", "meta", "depth", "anc", "sab"])
    def _attention_kernel(q, kf, vf, o, meta, depth, anc, scale, G, D, sqb, sqh, skr, skh, sob, soh, sab,
                          BT: tl.constexpr, BD: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // G
        base = tl.load(meta)  # first flat cache row of the sequence's slot
        p = tl.load(meta + 1)  # cached entries before this call
        n_keys = p + tl.load(depth + row) + 1  # the row's own key sequence: prefix, ancestors, itself
        dl = tl.arange(0, BD)
        dm = dl < D
        qv = tl.load(q + row * sqb + h * sqh + dl, mask=dm, other=0.0).to(tl.float32)  # [BD]
        m_i = tl.full([1], float("-inf"), tl.float32)
        l_i = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([BD], dtype=tl.float32)
        lanes = tl.arange(0, BT)
        for t0 in range(0, n_keys, BT):
            t = t0 + lanes  # [BT] positions in the row's key sequence
            valid = t < n_keys
            tree = t >= p
            a = tl.load(anc + row * sab + (t - p), mask=valid & tree, other=0)
            at = tl.where(tree, p + a, t)  # cache index of key t
            off = (base + at)[:, None] * skr + kvh * skh + dl[None, :]
            km = valid[:, None] & dm[None, :]
            kk = tl.load(kf + off, mask=km, other=0.0).to(tl.float32)  # [BT, BD]
            s = tl.sum(kk * qv[None, :], 1) * scale  # [BT]
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp(m_i - m_new)
            pr = tl.where(valid, tl.exp(s - m_new), 0.0)
            vv = tl.load(vf + off, mask=km, other=0.0).to(tl.float32)  # [BT, BD]
            l_i = l_i * alpha + tl.sum(pr, 0)
            acc = acc * alpha + tl.sum(pr[:, None] * vv, 0)
            m_i = m_new
        tl.store(o + row * sob + h * soh + dl, (acc / l_i).to(o.dtype.element_ty), mask=dm)

    return SimpleNamespace(linear=_linear_kernel, rms=_rms_kernel, silu_mul=_silu_mul_kernel,
                           attention=_attention_kernel)


def _pow2(n: int, lo: int = 16) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


class TritonFixed:
    """The fixed-order kernels in Triton (see the module doc). Tile sizes are fixed per instance, never per call."""

    name = "triton"

    def __init__(self, block_m: int = 16, block_n: int = 64, block_k: int = 64, block_t: int = 64,
                 dot: bool | None = None) -> None:
        """`dot`: multiply a tile with `tl.dot` (None: on CUDA; False: products summed in order, as under the
        interpreter, slower on a GPU but independent of how the tensor cores order a tile's sums)."""
        if triton is None:
            raise GooseError("the Triton kernels need the 'triton' package")
        self.bm, self.bn, self.bk, self.bt = block_m, block_n, block_k, block_t
        self.dot = dot
        if dot is False:
            self.name = "triton-nodot"

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [M, K] @ w[N, K]^T + bias`` -> ``[M, N]`` (in `out_dtype`, default x's)."""
        x = x.contiguous()
        M, K = x.shape
        N = w.shape[0]
        y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
        grid = (triton.cdiv(M, self.bm), triton.cdiv(N, self.bn))
        _kernels().linear[grid](x, w, bias if bias is not None else w, y, M, N, K, x.stride(0), w.stride(0),
                                y.stride(0), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                                DOT=x.device.type == "cuda" if self.dot is None else self.dot,
                                BM=self.bm, BN=self.bn, BK=self.bk)
        return y

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        N = x.shape[-1]
        rows = x.numel() // N
        _kernels().rms[(rows,)](x, w, y, N, eps, N, N, BLOCK=min(_pow2(N), 1024))
        return y

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        gu = gu.contiguous()
        M, two_i = gu.shape
        inter = two_i // 2
        y = torch.empty(M, inter, dtype=gu.dtype, device=gu.device)
        block = 1024
        _kernels().silu_mul[(M, triton.cdiv(inter, block))](gu, y, inter, gu.stride(0), y.stride(0), BLOCK=block)
        return y

    def attention(self, q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, meta: torch.Tensor,
                  depth: torch.Tensor, anc: torch.Tensor, scale: float) -> torch.Tensor:
        """``q [B, H, D]`` against the flat cache ``kf, vf [rows, K, D]``; `meta` = (first row of the slot, P) on
        the device; `depth [B]`, `anc [B, B]` (see the module doc). Returns ``[B, H, D]``."""
        q = q.contiguous()
        B, H, D = q.shape
        G = H // kf.shape[1]
        o = torch.empty_like(q)
        _kernels().attention[(B, H)](q, kf, vf, o, meta, depth, anc, scale, G, D, q.stride(0), q.stride(1),
                                  kf.stride(0), kf.stride(1), o.stride(0), o.stride(1), anc.stride(0),
                                  BT=self.bt, BD=_pow2(D))
        return o


class TorchFixed:
    """The fixed-order kernels in plain PyTorch: every reduction is a call of one shape per row (a row's own
    matrix-vector product, dot product, softmax), so no row's result depends on the others or on their number.
    One call per row: slow, for tests and machines without Triton."""

    name = "torch"

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = [torch.mv(w, r.clone()) for r in x]  # (a copy per row: the same alignment for every row)
        y = torch.stack(rows) if rows else x.new_empty(0, w.shape[0])
        if bias is not None:
            y = y + bias
        return y.to(out_dtype or x.dtype)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        out = []
        for r in flat:
            v = r.float().clone()
            var = torch.dot(v, v) / v.numel()
            out.append(w * (v * torch.rsqrt(var + eps)).to(x.dtype))
        return torch.stack(out).view(shape)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        inter = gu.shape[1] // 2
        return torch.stack([F.silu(r[:inter].clone()) * r[inter:].clone() for r in gu])

    def attention(self, q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, meta: torch.Tensor,
                  depth: torch.Tensor, anc: torch.Tensor, scale: float) -> torch.Tensor:
        B, H, D = q.shape
        K = kf.shape[1]
        G = H // K
        base, p = (int(v) for v in meta.tolist())
        depths, ancs = depth.tolist(), anc.tolist()
        out = []
        for i in range(B):
            at = list(range(p)) + [p + a for a in ancs[i][: depths[i] + 1]]  # the row's key sequence
            idx = torch.tensor(at, dtype=torch.long, device=q.device) + base
            k = kf.index_select(0, idx).transpose(0, 1)  # [K, L, D]
            v = vf.index_select(0, idx).transpose(0, 1)  # [K, L, D]
            qi = q[i].reshape(K, G, D).clone()  # [K, G, D]
            s = torch.bmm(qi, k.transpose(1, 2)) * scale  # [K, G, L]
            a = torch.bmm(torch.softmax(s.float(), -1).to(q.dtype), v)  # [K, G, D]
            out.append(a.reshape(H, D))
        return torch.stack(out)


def fixed_kernels(device: torch.device, use_triton: bool | None = None):
    """The fixed-order kernels for `device`: Triton's (None: on CUDA when Triton is installed; True: also on CPU
    under Triton's interpreter, which is slow), else PyTorch's row loop (`TorchFixed`). ``use_triton=True``
    raises GooseError where Triton cannot run."""
    why = triton_reason(device)
    if use_triton or (use_triton is None and why is None and device.type == "cuda"):
        if why is not None:
            raise GooseError(f"the fixed mode's Triton kernels cannot run: {why}")
        return TritonFixed()
    return TorchFixed()
