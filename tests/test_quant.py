"""goose's quantized-block kernels (`goose.backends.quant`): every variant this CPU runs dequantizes each GGUF format
to exactly gguf's float32 weights, multiplies like a float64 reference, gives every row the same bits
whatever the row count, and equals goose's float32 kernel bit for bit (so `LeanForward` on GGUF blocks
equals `LeanForward` on the dequantized float32 model); bad input is refused before C++ reads it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from goose.backends import cpukernel, packed, quant
from goose.backends.lean import LeanForward
from goose.errors import GooseError
from goose.loading import gguf as gguf_file
from goose.loading.model import gguf_source
from test_lean import call_script, play, play_segments, tiny_llama

VARIANTS = quant.runnable_variants()
needs_quant = pytest.mark.skipif(not VARIANTS or quant.kernels() is None,
                                 reason=f"quantized kernels: {quant.unavailable_reason()}")
HALVES = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}  # byte offsets of f16 fields


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """[n, bytes] GGUF rows of random blocks: random quants, finite half-float scales."""
    _, block, bbytes = quant.FORMATS[fmt]
    raw = rng.integers(0, 256, size=(n, k // block, bbytes), dtype=np.uint8)
    for off in HALVES[fmt]:
        h = rng.uniform(-scale, scale, size=(n, k // block)).astype(np.float16)
        raw[:, :, off:off + 2] = h.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def reference(fmt: str, raw: np.ndarray) -> torch.Tensor:
    """gguf's own numpy dequantization (what transformers loads)."""
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float32))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@needs_quant
def test_best_variant_first_and_avx2_everywhere_avx2_runs():
    assert VARIANTS[-1] == "avx2" and VARIANTS == [v for v in quant.ORDER if v in VARIANTS]
    for v in VARIANTS:
        k = quant.kernels(v)
        assert k is not None and k.variant == v and k.isa == (512 if v == "avx512" else 256)


@needs_quant
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_dequantizes_exactly_as_gguf(variant, fmt):
    rng = np.random.default_rng(hash(fmt) % 1000)
    k = 512
    raw = random_blocks(fmt, 37, k, rng)
    w = quant.kernels(variant).pack(fmt, list(raw), k)
    assert torch.equal(bits(w.dequantize()), bits(reference(fmt, raw)))  # down to the sign of zeros
    assert torch.equal(bits(w[[5, 0, 36]]), bits(reference(fmt, raw[[5, 0, 36]])))


@needs_quant
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_linear_matches_float64_and_float32_kernel_bit_for_bit(variant, fmt):
    rng = np.random.default_rng(7)
    kern, ck = quant.kernels(variant), cpukernel.kernel()
    for n, k in ((40, 256), (17, 512), (64, 768)):
        raw = random_blocks(fmt, n, k, rng)
        w = kern.pack(fmt, list(raw), k)
        wf = reference(fmt, raw)
        bias = torch.randn(n)
        x = torch.randn(11, k)
        y = kern.linear(x, w, n, cpukernel.CpuKernels.pack_bias(bias, n))
        ref = x.double() @ wf.double().T + bias.double()
        tol = 1e-5 * (x.double().abs() @ wf.double().abs().T).max().item() + 1e-6
        assert (y.double() - ref).abs().max().item() <= tol
        if ck is not None:  # the same FMA chain as goose_linear on the dequantized weights
            packed = ck.pack(wf)
            pb = ck.pack_bias(bias, n)
            assert torch.equal(bits(y), bits(ck.linear(x, packed, n, pb)))
            g = torch.rand(k) + 0.5
            want = ck.linear(x, packed, n, norm=(g, 1e-5))
            assert torch.equal(bits(kern.linear(x, w, n, norm=(g, 1e-5))), bits(want))
            xg = torch.randn(13, 2 * k)
            assert torch.equal(bits(kern.linear(xg, w, n, gated=True)), bits(ck.linear(xg, packed, n, gated=True)))
            res = torch.randn(11, n)
            a, b = kern.linear(x, w, n, pb, out=res.clone()), ck.linear(x, packed, n, pb, out=res.clone())
            assert torch.equal(bits(a), bits(b))


@needs_quant
@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_rows_do_not_depend_on_row_count_or_variant(fmt):
    """Every row's result is the same bits for 1..64 rows, any position, and every variant."""
    rng = np.random.default_rng(3)
    n, k = 70, 512
    raw = random_blocks(fmt, n, k, rng)
    x = torch.randn(64, k)
    outs = {}
    for v in VARIANTS:
        w = quant.kernels(v).pack(fmt, list(raw), k)
        full = w.kernels.linear(x, w, n)
        for m in list(range(1, 17)) + [23, 31, 40, 64]:
            for start in (0, 64 - m):
                assert torch.equal(bits(w.kernels.linear(x[start:start + m], w, n)), bits(full[start:start + m]))
        outs[v] = full
    for v in VARIANTS[1:]:
        assert torch.equal(bits(outs[v]), bits(outs[VARIANTS[0]]))


@needs_quant
def test_bad_input_is_refused_before_the_kernel():
    kern = quant.kernels()
    rng = np.random.default_rng(0)
    raw = random_blocks("Q4_1", 16, 64, rng)
    with pytest.raises(GooseError):
        kern.pack("Q5_K", list(raw), 64)  # no kernel for this type
    with pytest.raises(GooseError):
        kern.pack("Q4_1", list(raw), 96)  # rows shorter than K says (a lying size)
    with pytest.raises(GooseError):
        kern.pack("Q4_1", [r[:-1] for r in raw], 64)  # truncated rows
    with pytest.raises(GooseError):
        kern.pack("Q4_K", list(raw), 64)  # K not a whole number of 256-weight blocks
    w = kern.pack("Q4_1", list(raw), 64)
    with pytest.raises(ValueError):
        kern.linear(torch.randn(2, 63), w, 16)
    with pytest.raises(ValueError):
        kern.linear(torch.randn(2, 64), w, 15)
    with pytest.raises(ValueError):
        kern.linear(torch.randn(2, 64, dtype=torch.float64), w, 16)
    with pytest.raises(ValueError):
        kern.linear(torch.randn(2, 64), w, 16, torch.zeros(8))  # bias not padded to a panel
    with pytest.raises(ValueError):
        kern.linear(torch.randn(2, 64), w, 16, out=torch.zeros(3, 16))
    with pytest.raises(IndexError):
        w[torch.tensor([16])]
    with pytest.raises(TypeError):
        torch.matmul(torch.randn(2, 64), w)  # never dequantized silently
    assert kern.linear(torch.randn(0, 64), w, 16).shape == (0, 16)


def _quantize_tiny(model, fmt: str, seed: int = 0):
    """Give a float32 tiny Llama random `fmt` weights: its float32 twin gets gguf's dequantization of the same
    blocks, the other model `PackedLinear` / `PackedEmbedding` modules over them."""
    import copy

    rng = np.random.default_rng(seed)
    kern = quant.kernels()
    qmodel = copy.deepcopy(model)
    pairs = []
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and name != "lm_head":
            pairs.append(name)
    for name in pairs:
        mod = model.get_submodule(name)
        n, k = mod.weight.shape
        raw = random_blocks(fmt, n, k, rng, scale=0.02 if fmt != "Q8_0" else 0.004)
        with torch.no_grad():
            mod.weight.copy_(reference(fmt, raw))
        w = kern.pack(fmt, list(raw), k)
        parent, _, attr = name.rpartition(".")
        new = (packed.PackedEmbedding(w) if isinstance(mod, torch.nn.Embedding)
               else packed.PackedLinear(w, getattr(mod, "bias", None)))
        setattr(qmodel.get_submodule(parent), attr, new)
        if name == "model.embed_tokens":  # tied output head: the same blocks
            qmodel.lm_head = packed.PackedLinear(w, None)
    return qmodel


@needs_quant
@pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")
@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0"])
def test_lean_forward_on_blocks_equals_float32_twin_bit_for_bit(fmt):
    model = tiny_llama(torch.float32, seed=1, scale=1.0)
    qmodel = _quantize_tiny(model, fmt)
    fq, ff = LeanForward(qmodel), LeanForward(model)
    assert "gguf" in fq.backend and "gguf" not in ff.backend
    script = call_script(4, steps=8, prompt_len=20)
    for a, b in zip(play(fq, script), play(ff, script)):
        assert torch.equal(bits(a), bits(b))
    assert fq.plan is not None  # all layers in one kernel call, which gives the per-layer calls' bits
    stepped = LeanForward(qmodel)
    stepped.plan = None
    for a, b in zip(play_segments(fq, 5), play_segments(stepped, 5), strict=True):
        assert torch.equal(bits(a), bits(b))
    # the HF forward runs on the blocks too (through PackedLinear / PackedEmbedding)
    ids = torch.tensor([[3, 9, 27, 81 % 128, 5]])
    with torch.inference_mode():
        assert (qmodel(ids).logits - model(ids).logits).abs().max().item() < 1e-3


@needs_quant
def test_fusing_keeps_one_copy():
    kern = quant.kernels()
    rng = np.random.default_rng(0)
    ws = [kern.pack("Q4_0", list(random_blocks("Q4_0", n, 64, rng)), 64) for n in (32, 16, 20)]
    before = [w.dequantize() for w in ws]
    fused = packed.cat(ws)
    assert fused.shape == (68, 64) and torch.equal(fused.dequantize(), torch.cat(before))
    for w, b in zip(ws, before):
        assert torch.equal(w.dequantize(), b)
        assert w.data.untyped_storage().data_ptr() == fused.data.untyped_storage().data_ptr()
    again = packed.cat(ws)  # already consecutive views of one buffer: fused without a copy
    assert again.data.data_ptr() == fused.data.data_ptr() and torch.equal(again.dequantize(), torch.cat(before))
    with pytest.raises(GooseError):
        packed.cat([ws[2], ws[0]])  # 20 rows: not a whole panel


def test_unknown_weights_kind_is_refused():
    with pytest.raises(GooseError):
        gguf_file.load_gguf_model(gguf_source("smollm2-135m"), "int4", torch.float32, torch.device("cpu"), "sdpa")


def test_explicit_gguf_needs_a_gguf_source(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(GooseError, match="GGUF"):
        gguf_file.load_gguf_model(gguf_source(str(tmp_path)), "gguf", torch.float32, torch.device("cpu"),
                                  "sdpa")
    with pytest.raises(GooseError, match="float32 on the CPU"):
        gguf_file.load_gguf_model(gguf_source("smollm2-135m"), "gguf", torch.float64, torch.device("cpu"),
                                  "sdpa")
    assert gguf_file.load_gguf_model(gguf_source(str(tmp_path)), None, torch.float32, torch.device("cpu"),
                                 "sdpa") is None


def test_truncated_gguf_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    with pytest.raises(GooseError, match="cannot read GGUF"):
        gguf_file.use_gguf_weights(None, bad)


# ---- the packaged SmolLM2 (Q4_1 blocks, Q8_0 embedding / tied head) ---------------------------------------

REAL_PROMPTS = [
    "Write a short story about a goose who learns to fly.",
    "List three facts about the Moon.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Explain what a hash table is to a ten-year-old.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the main differences between Python lists and tuples?",
    "Give me a recipe for pancakes.",
    "Rename the variable `x` to `count` in: def bump(x):\n    x = x + 1\n    return x\n",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
]


@pytest.fixture(scope="module")
def smollm_pair():
    from goose.loading.model import load_model

    q, tok = load_model("smollm2-135m", weights="gguf")
    f, _ = load_model("smollm2-135m", weights="float32")
    return q, f, tok


@pytest.mark.slow
@needs_quant
def test_packaged_smollm2_blocks_are_the_dequantized_weights(smollm_pair):
    q, f, _ = smollm_pair
    assert type(q.model.layers[0].self_attn.q_proj) is packed.PackedLinear
    assert quant.weights_kind(q) == "gguf (Q4_1, Q8_0)" and quant.weights_kind(f) == "float32"
    assert q.lm_head.weight is q.model.embed_tokens.weight  # tied head: one copy of the Q8_0 blocks
    def values(w):  # (the float32 model holds goose's panels where its kernel runs: load_model packs them)
        return w.dequantize() if isinstance(w, packed.PackedWeight) else w.detach()

    for lq, lf in zip(q.model.layers, f.model.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
            a, b = lq.get_submodule(name).weight, lf.get_submodule(name).weight
            assert torch.equal(bits(a.dequantize()), bits(values(b)))
    assert torch.equal(bits(q.model.embed_tokens.weight.dequantize()), bits(values(f.model.embed_tokens.weight)))


@pytest.mark.slow
@needs_quant
@pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")
def test_packaged_smollm2_gguf_tokens_equal_float32_ar(smollm_pair):
    """goose (and ar) on the blocks produce exactly the tokens of ar on the dequantized float32 model; the
    logits are bit-identical, so not even a near-tie can flip (any difference is reported with its logits)."""
    from goose.decoding import Decoder

    q, f, tok = smollm_pair
    ref, got_ar, got_goose = Decoder(f, tok, "ar"), Decoder(q, tok, "ar"), Decoder(q, tok, "goose")
    for text in REAL_PROMPTS:
        ids = ref.encode(text, chat=True)
        want = ref.generate(ids, 48).token_ids
        for dec in (got_ar, got_goose):
            got = dec.generate(ids, 48).token_ids
            if got != want:
                from goose.cli import first_mismatch

                pytest.fail(f"{text[:30]!r}: {first_mismatch(f, ids, want, got)}")


def _write_gguf(path, raw: np.ndarray, fmt: str, k: int):
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=GGMLQuantizationType[fmt])
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("fmt", ["Q4_1", "Q6_K"])
def test_gguf_reader_reads_what_gguf_writes_and_refuses_truncation(tmp_path, fmt):
    rng = np.random.default_rng(1)
    raw = random_blocks(fmt, 16, 256, rng)
    path = tmp_path / "m.gguf"
    _write_gguf(path, raw, fmt, 256)
    meta, tensors = gguf_file.read_gguf(path)
    t = tensors["blk.0.attn_q.weight"]
    assert meta["general.architecture"] == "llama" and t.type == fmt and t.shape == [256, 16]
    assert np.array_equal(gguf_file.tensor_bytes(path, t, 16), raw)
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 40, 10):  # truncated anywhere: a one-line error
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(GooseError, match="cannot read GGUF"):
            gguf_file.read_gguf(tmp_path / "cut.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGUX" + data[4:])
    with pytest.raises(GooseError, match="magic"):
        gguf_file.read_gguf(tmp_path / "bad.gguf")


def test_the_cpp_format_table_is_written_once_and_matches_python():
    """Both quantized kernel libraries take the formats from gguf_formats.h (none defines its own), and its
    codes, GGUF block sizes and bytes are quant.FORMATS's (checked against the gguf package's too)."""
    import re

    folder = cpukernel.SOURCE.parent
    header = (folder / "gguf_formats.h").read_text()
    codes = {name: int(code) for name, code in re.findall(r"kQ(\w+) = (\d+)", header)}
    rows = re.findall(r"\{\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+)\s*\},\s*//\s*Q(\w+)", header)
    table = {"Q" + name: (codes[name], int(block), int(nbytes)) for *_, block, nbytes, name in rows}
    assert table == quant.FORMATS and len(rows) == len(codes) == int(re.search(r"kFormats = (\d+)", header)[1])
    assert [codes[name] for *_, name in rows] == sorted(codes.values())  # rows in code order
    assert int(re.search(r"kCols = (\d+)", header)[1]) == quant.PANEL
    for name, (_, block, nbytes) in quant.FORMATS.items():
        assert quants.GGML_QUANT_SIZES[GGMLQuantizationType[name]] == (block, nbytes)
    for source in ("quant_kernels.cpp", "int8_kernels.cpp"):
        text = (folder / source).read_text()
        assert '#include "gguf_formats.h"' in text and "enum Fmt" not in text and "kInfo[kFormats] =" not in text
