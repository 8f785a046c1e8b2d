"""GGUF files: their metadata and tensor table (`read_gguf`), a tensor's bytes (`tensor_bytes`), and what a GGUF
model's layout means for goose (`check_architecture`, the per-layer tensor names, llama.cpp's Q/K row order)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ..errors import GooseError

# GGUF tensor name (per layer, after "blk.{i}.") -> module path under model.model.layers[i]
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
# architectures whose tensors map this way (llama's q/k rows are permuted by llama.cpp's converter)
ARCHITECTURES = ("llama", "qwen2", "qwen3")


def check_architecture(meta: dict) -> str:
    """The file's architecture (``general.architecture``) when goose keeps blocks of it; GooseError otherwise."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GooseError(f"GGUF weights are implemented for {', '.join(ARCHITECTURES)}, not '{arch}'")
    return arch


def _permutation(n: int, heads: int) -> np.ndarray:
    """HF row i of a llama q/k projection is GGUF row perm[i] (the inverse of llama.cpp's rope permutation)."""
    dim = n // heads // 2
    return np.arange(n).reshape(heads, dim, 2).swapaxes(1, 2).reshape(n)


class GGUFTensor:
    """One tensor of a GGUF file: GGML type name, shape (GGUF order: ne0 = the row length first), where its
    bytes lie, and how many there are."""

    __slots__ = ("name", "type", "shape", "offset", "nbytes")

    def __init__(self, name: str, type_name: str, shape: list[int], offset: int, nbytes: int) -> None:
        self.name, self.type, self.shape, self.offset, self.nbytes = name, type_name, shape, offset, nbytes


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf(path: Path) -> tuple[dict, dict[str, GGUFTensor]]:
    """The scalar and string metadata and the tensor table of a GGUF file (v2/v3), checked against the file's
    size; tensor bytes are read later, one tensor at a time (`tensor_bytes`). A lean parser: gguf's
    GGUFReader builds a Python object per vocabulary entry (~170 MB for a 49k vocabulary)."""
    import mmap

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def bad(why: str) -> GooseError:
        return GooseError(f"cannot read GGUF file {path}: {why}")

    try:
        f = open(path, "rb")
    except OSError as exc:
        raise bad(str(exc)) from exc
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise bad("truncated header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos = 0

            def take(fmt: str):
                nonlocal pos
                n = struct.calcsize(fmt)
                if pos + n > size:
                    raise bad("truncated metadata")
                v = struct.unpack_from(fmt, mm, pos)[0]
                pos += n
                return v

            def string() -> str:
                nonlocal pos
                n = take("<Q")
                if pos + n > size:
                    raise bad("truncated string")
                v = bytes(mm[pos:pos + n]).decode("utf-8", "replace")
                pos += n
                return v

            def value(kind: int):
                nonlocal pos
                if kind in _SCALARS:
                    return take(_SCALARS[kind])
                if kind == 8:
                    return string()
                if kind == 9:
                    item, count = take("<I"), take("<Q")
                    if item in _SCALARS:  # skipped without reading
                        pos += count * struct.calcsize(_SCALARS[item])
                        if pos > size:
                            raise bad("truncated array")
                    else:
                        for _ in range(count):
                            value(item)
                    return None
                raise bad(f"unknown metadata type {kind}")

            if bytes(mm[:4]) != b"GGUF":
                raise bad("not a GGUF file (no GGUF magic)")
            pos = 4
            version = take("<I")
            if version not in (2, 3):
                raise bad(f"GGUF version {version} is not supported")
            n_tensors, n_kv = take("<Q"), take("<Q")
            meta = {}
            for _ in range(n_kv):
                key = string()
                meta[key] = value(take("<I"))
            infos = []
            for _ in range(n_tensors):
                name = string()
                dims = [take("<Q") for _ in range(take("<I"))]
                infos.append((name, dims, take("<I"), take("<Q")))
    align = meta.get("general.alignment") or 32
    start = -(-pos // align) * align
    tensors = {}
    for name, dims, code, offset in infos:
        try:
            qtype = GGMLQuantizationType(code)
            block, bbytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as exc:
            raise bad(f"tensor {name} has an unknown type {code}") from exc
        count = int(np.prod(dims)) if dims else 1
        if not dims or dims[0] % block:
            raise bad(f"tensor {name}: rows of {dims[:1]} are not whole {qtype.name} blocks")
        nbytes = count // block * bbytes
        if start + offset + nbytes > size:
            raise bad(f"tensor {name} runs past the end of the file (truncated?)")
        tensors[name] = GGUFTensor(name, qtype.name, dims, start + offset, nbytes)
    return meta, tensors


def tensor_bytes(path: Path, t: GGUFTensor, rows: int) -> np.ndarray:
    """A tensor's bytes as ``[rows, bytes per row]`` uint8 (read from the file, no mapping kept)."""
    with open(path, "rb") as f:
        f.seek(t.offset)
        data = np.fromfile(f, dtype=np.uint8, count=t.nbytes)
    if data.size != t.nbytes:
        raise GooseError(f"cannot read GGUF file {path}: tensor {t.name} is truncated")
    return data.reshape(rows, -1)
