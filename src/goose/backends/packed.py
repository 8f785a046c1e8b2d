"""Weights kept once, in the layout goose's kernels read: float32 panels and GGUF blocks.

A goose forward multiplies with weights packed into 16-column panels (`cpukernel.CpuKernels.pack`), or with
a GGUF file's quantized blocks (`goose.backends.quant`). So that no weight is held twice, the model's own
modules are swapped for ones over the packed data, and the original weights are released:

* `PackedWeight` stands where a float32 ``[n, k]`` weight tensor stood (``shape``, ``dtype`` float32,
  ``device`` cpu, ``detach()``, row indexing and `F.embedding` give float32 rows); anything else that would
  need the whole float32 matrix raises a TypeError instead of silently building it (``dequantize()`` does,
  on request). `PanelWeight` holds float32 panels; `goose.backends.quant.QuantWeight` holds GGUF blocks.
* `PackedLinear` / `PackedEmbedding` are the `nn.Module`s over them: the Hugging Face forward of such a
  model (``model.generate``, `HFForward`) runs on goose's kernels too, and `LeanForward` adopts the packed
  data as it is (no copy).
* `PanelPacker` does this for a float32 model's projections and output head, tensor by tensor, as
  `load_model` reads them (`goose.loading.stream`) for every model `LeanForward` runs: the float32 weights are
  then held once, as panels, instead of the HF copy plus the forward's packed copy. `pack_float32(model)`
  does it in place for a model already loaded. A tied embedding reads its rows from the output head's panels.
* `cat` fuses weights row-wise (QKV, gate/up) with one copy of the data: the parts become views of it, and
  parts that already are consecutive views of one buffer are fused without copying anything.

The forwards' stale-weight check (`forward.weights_fingerprint`) covers the packed data: replacing a
module or writing into its panels makes a forward built earlier pack again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import GooseError
from .cpukernel import PANEL, CpuKernels


class PackedWeight:
    """A packed ``[n, k]`` weight (see the module doc). Subclasses give `_gather` (what `rows` reads) and `linear`."""

    dtype = torch.float32
    device = torch.device("cpu")
    requires_grad = False
    ndim = 2

    def __init__(self, kernels, fmt: str, n: int, k: int, data: torch.Tensor) -> None:
        self.kernels, self.fmt, self.n, self.k, self.data = kernels, fmt, n, k, data

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight: float32 ``[*ids.shape, k]``."""
        return self._gather(self._check_ids(ids)).view(*ids.shape, self.k)

    def rows_of(self, ids: list[int]) -> torch.Tensor:
        """`rows` of a list of ids, ``[len(ids), k]``, checked in Python: a forward's embedding lookup, where the
        tensor reductions of `_check_ids` cost more than the lookup itself."""
        if ids and (min(ids) < 0 or max(ids) >= self.n):
            raise IndexError(f"row ids must be in [0, {self.n})")
        return self._gather(torch.tensor(ids, dtype=torch.int64))

    def _gather(self, flat: torch.Tensor) -> torch.Tensor:
        """Rows `flat` (int64, contiguous, checked) of the weight: float32 ``[len(flat), k]``."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, **fused) -> torch.Tensor:
        """``x [M, k]`` times the weight, as `CpuKernels.linear` (bias padded with `CpuKernels.pack_bias`;
        `fused`: its ``norm`` / ``gated`` / ``out``)."""
        raise NotImplementedError

    @property
    def operand(self):
        """What this weight's kernels take as their ``packed`` argument."""
        return self

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 2

    def detach(self) -> "PackedWeight":
        return self

    def contiguous(self) -> "PackedWeight":
        return self

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def dequantize(self) -> torch.Tensor:
        """The whole float32 ``[n, k]`` matrix (tests, and models the kernels cannot run)."""
        return self.rows(torch.arange(self.n))

    def __getitem__(self, index) -> torch.Tensor:
        return self.rows(torch.arange(self.n)[index])

    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.n):
            raise IndexError(f"row ids must be in [0, {self.n})")
        return flat

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.fmt}, [{self.n}, {self.k}], {self.nbytes} bytes, "
                f"{self.kernels.variant})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and len(args) >= 2 and isinstance(args[1], PackedWeight) and not kwargs.get("max_norm"):
            return args[1].rows(args[0])
        raise TypeError(f"{func.__name__} is not defined on a packed weight ({cls.__name__})")


class PanelWeight(PackedWeight):
    """A float32 weight in goose's panel layout ``[ceil(n / 16), 2, k, 8]`` (`CpuKernels.pack`)."""

    def __init__(self, kernels: CpuKernels, n: int, k: int, data: torch.Tensor) -> None:
        if (data.dtype != torch.float32 or data.dim() != 4 or tuple(data.shape[1:]) != (2, k, PANEL // 2)
                or data.shape[0] != -(-n // PANEL)):
            raise GooseError(f"a [{n}, {k}] panel weight needs float32 data of shape "
                             f"[{-(-n // PANEL)}, 2, {k}, {PANEL // 2}], not {list(data.shape)} {data.dtype}")
        super().__init__(kernels, "F32", n, k, data)

    @classmethod
    def pack(cls, kernels: CpuKernels, weight: torch.Tensor) -> "PanelWeight":
        return cls(kernels, weight.shape[0], weight.shape[1], kernels.pack(weight))

    @property
    def operand(self) -> torch.Tensor:
        return self.data

    def _gather(self, flat: torch.Tensor) -> torch.Tensor:
        # row r is lane r % 8 of half (r % 16) // 8 of panel r // 16
        return self.data[flat // PANEL, (flat % PANEL) // (PANEL // 2), :, flat % (PANEL // 2)].contiguous()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, **fused) -> torch.Tensor:
        return self.kernels.linear(x, self.data, self.n, bias, **fused)


def cat(weights: list[PackedWeight]) -> PackedWeight:
    """The row-wise concatenation of packed weights (a fused QKV or gate/up projection), with one copy of the
    data: the inputs become views of the result. All but the last need a multiple of 16 rows."""
    first = weights[0]
    if any(type(w) is not type(first) or w.fmt != first.fmt or w.k != first.k or w.kernels is not first.kernels
           for w in weights):
        raise GooseError("only weights of one kind, format, width and kernel can be fused")
    if any(w.n % PANEL for w in weights[:-1]):
        raise GooseError(f"fusing packed weights needs multiples of {PANEL} rows")
    n = sum(w.n for w in weights)
    base = first.data._base
    if base is not None and all(w.data._base is base for w in weights):  # already fused: views in order
        ends = [w.data.data_ptr() + w.nbytes for w in weights]
        starts = [w.data.data_ptr() for w in weights]
        if (starts[0] == base.data_ptr() and ends[-1] == base.data_ptr() + base.numel() * base.element_size()
                and starts[1:] == ends[:-1]):
            return _like(first, n, base)
    data = torch.cat([w.data for w in weights])
    at = 0
    for w in weights:
        w.data = data[at: at + w.data.shape[0]]
        at += w.data.shape[0]
    return _like(first, n, data)


def _like(first: PackedWeight, n: int, data: torch.Tensor) -> PackedWeight:
    out = object.__new__(type(first))
    PackedWeight.__init__(out, first.kernels, first.fmt, n, first.k, data)
    return out


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W a `PackedWeight` (the HF forward of a packed model runs through it)."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.k, weight.n
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.weight.linear(x.reshape(-1, shape[-1]).to(torch.float32))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight!r}, bias={self.bias is not None}"


class PackedEmbedding(nn.Module):
    """An embedding table kept packed: a lookup unpacks only the rows asked for."""

    def __init__(self, weight: PackedWeight, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.n, weight.k
        self.padding_idx = padding_idx
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids)

    def extra_repr(self) -> str:
        return repr(self.weight)


# (the fused groups of a decoder layer: attention inputs, MLP inputs)
FUSED = ((("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj")),
         (("mlp", "gate_proj"), ("mlp", "up_proj")))


def fuse_layers(model) -> None:
    """Fuse each layer's packed q/k/v and gate/up weights into one buffer each (`cat`), so that a forward
    adopts them without copying; groups that cannot be fused (row counts) are left as they are."""
    for layer in model.model.layers:
        for group in FUSED:
            mods = [getattr(getattr(layer, a), b) for a, b in group]
            if all(isinstance(m, PackedLinear) for m in mods):
                try:
                    cat([m.weight for m in mods])
                except GooseError:
                    pass  # row counts, kinds or formats that cannot share panels: each stays on its own


class PanelPacker:
    """Packs float32 weights into `PanelWeight` panels as they arrive, swapping their modules: an ``nn.Linear``'s
    weight makes it a `PackedLinear`; the weight of an embedding tied to the output head makes both a
    `PackedEmbedding` and a `PackedLinear` over the same panels. The parts of a fused group (`FUSED`: q/k/v,
    gate/up) are packed straight into their slices of one buffer, so fusing later copies nothing. Called as
    ``packer(net, name, tensor)`` (the ``place`` of `goose.loading.stream.stream_load`): True when it took the
    tensor. `bytes`: the panels allocated."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels, self.bytes = kernels, 0
        self._slices: dict[int, torch.Tensor] = {}  # id(module) -> its slice of a fused buffer, until packed

    def __call__(self, net: nn.Module, name: str, value: torch.Tensor) -> bool:
        path, _, attr = name.rpartition(".")
        mod = net.get_submodule(path)
        if attr != "weight" or type(mod) not in (nn.Linear, nn.Embedding):
            return False
        head, emb = net.get_output_embeddings(), net.get_input_embeddings()
        tied = type(head) is nn.Linear and type(emb) is nn.Embedding and head.weight is emb.weight
        if type(mod) is nn.Embedding and not (tied and mod is emb):
            return False  # an untied embedding is used as it is (one copy)
        with torch.no_grad():
            w = PanelWeight(self.kernels, mod.weight.shape[0], mod.weight.shape[1],
                            self.kernels.pack_into(value.to(torch.float32), self._slice(net, path, mod)))
        if tied and mod in (head, emb):
            _replace(net, _path_of(net, emb), PackedEmbedding(w, emb.padding_idx))
            _replace(net, _path_of(net, head), PackedLinear(w, head.bias))
        else:
            _replace(net, path, PackedLinear(w, mod.bias))
        return True

    def _slice(self, net: nn.Module, path: str, mod: nn.Module) -> torch.Tensor:
        """Where `mod`'s panels go: its slice of its group's fused buffer (allocated with the group's first
        part), or a buffer of its own."""
        if id(mod) in self._slices:
            return self._slices.pop(id(mod))
        n, k = mod.weight.shape
        parent_path, _, attr = path.rpartition(".")
        grand, _, parent_attr = parent_path.rpartition(".")
        group = next((g for g in FUSED if (parent_attr, attr) in g), None)
        parts = [] if group is None else [net.get_submodule(".".join(filter(None, (grand, a, b)))) for a, b in group]
        if (len(parts) > 1 and all(type(m) is nn.Linear and m.weight.shape[1] == k for m in parts)
                and not any(m.weight.shape[0] % PANEL for m in parts[:-1])):
            panels = [-(-m.weight.shape[0] // PANEL) for m in parts]
            data = self._alloc(sum(panels), k)
            at = 0
            for m, p in zip(parts, panels):
                self._slices[id(m)] = data[at: at + p]
                at += p
            return self._slices.pop(id(mod))
        return self._alloc(-(-n // PANEL), k)

    def _alloc(self, panels: int, k: int) -> torch.Tensor:
        data = torch.empty(panels, 2, k, PANEL // 2, dtype=torch.float32)
        self.bytes += data.numel() * data.element_size()
        return data


def _path_of(net: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in net.named_modules() if m is module)


def _replace(net: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(net.get_submodule(parent), attr, module)


def pack_float32(model, kernels: CpuKernels) -> int:
    """Swap the float32 ``nn.Linear`` modules of `model` (its projections and output head) for `PackedLinear`
    modules over `PanelWeight` panels, each original weight released before the next is packed; a tied
    embedding reads its rows from the output head's panels, and q/k/v and gate/up land fused (`PanelPacker`).
    Returns the bytes now held as panels. (`load_model` reads the weights straight into panels instead,
    `goose.loading.stream`, so that the file's float32 copy is never held beside them.)"""
    packer = PanelPacker(kernels)
    for name, mod in list(model.named_modules()):
        if type(mod) is nn.Linear and mod.weight.dtype == torch.float32 and mod.weight.device.type == "cpu":
            packer(model, f"{name}.weight", mod.weight)
    return packer.bytes
