"""Float32 weights held once, as goose's panels (`goose.backends.packed`, `goose.loading.stream`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from goose.backends import cpukernel, packed
from goose.backends.cpukernel import CpuKernels
from goose.backends.lean import LeanForward
from goose.errors import GooseError

needs_kernel = pytest.mark.skipif(cpukernel.kernel() is None, reason=f"{cpukernel.unavailable_reason()}")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 48, 100])
def test_pack_into_is_pack_and_rows_give_the_weight_back(n):
    w = torch.randn(n, 24)
    p = CpuKernels.pack(w)
    assert p.shape == (-(-n // 16), 2, 24, 8)
    manual = torch.cat([w, w.new_zeros((-n) % 16, 24)]).view(-1, 2, 8, 24).transpose(2, 3)  # the documented layout
    assert torch.equal(p, manual)
    out = torch.full((p.shape[0] + 2, 2, 24, 8), float("nan"))
    CpuKernels.pack_into(w, out[1:-1])  # into a slice of a bigger buffer
    assert torch.equal(out[1:-1], p) and out[0].isnan().all() and out[-1].isnan().all()
    with pytest.raises(ValueError):
        CpuKernels.pack_into(w, out)
    if cpukernel.kernel() is None:
        return
    pw = packed.PanelWeight(cpukernel.kernel(), n, 24, p)
    assert torch.equal(bits(pw.dequantize()), bits(w))
    ids = torch.tensor([[n - 1, 0], [n // 2, n - 1]])
    assert torch.equal(pw.rows(ids), w[ids]) and torch.equal(F.embedding(ids, pw), w[ids])
    assert torch.equal(pw[1:3], w[1:3])
    with pytest.raises(IndexError):
        pw.rows(torch.tensor([n]))
    with pytest.raises(TypeError):
        torch.matmul(torch.ones(1, n), pw)  # no silent full float32 copy
    with pytest.raises(GooseError):
        packed.PanelWeight(cpukernel.kernel(), n + 16, 24, p)  # data of the wrong size


def _tied_llama(tie: bool, seed: int = 0, bias: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                      attention_bias=bias, mlp_bias=bias, eos_token_id=1, bos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).float().eval()


def _storages(model) -> set[int]:
    out = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    out |= {m.weight.data.untyped_storage().data_ptr() for m in model.modules()
            if isinstance(getattr(m, "weight", None), packed.PackedWeight)}
    return out


@needs_kernel
@pytest.mark.parametrize("tie,bias", [(True, False), (False, True)])
def test_pack_float32_keeps_one_copy_and_the_same_logits(tie, bias):
    ref = _tied_llama(tie, bias=bias)
    model = _tied_llama(tie, bias=bias)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with torch.inference_mode():
        want_hf = ref(ids).logits
    want = LeanForward(ref)(ids[0].tolist())  # goose's kernel on its own packed copy
    weight_bytes = sum(m.weight.numel() * 4 for m in ref.modules() if isinstance(m, torch.nn.Linear))
    held = packed.pack_float32(model, cpukernel.kernel())
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert held >= weight_bytes - (tie and ref.lm_head.weight.numel() * 4)  # (padding to whole panels at most)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.data._base is attn.v_proj.weight.data._base is not None  # q/k/v fused, one buffer
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert isinstance(model.model.embed_tokens, packed.PackedEmbedding)
    else:
        assert type(model.model.embed_tokens) is torch.nn.Embedding
    before = _storages(model)
    fwd = LeanForward(model)
    assert _storages(model) == before  # adopting the panels re-points nothing
    for lin in (fwd.layers[0].qkv, fwd.layers[1].gate_up, fwd.layers[1].down, fwd.lm_head):
        assert lin.packed.untyped_storage().data_ptr() in before  # ... and copies nothing
    got = fwd(ids[0].tolist())
    assert torch.equal(bits(got), bits(want))  # the same panels and kernel: the same bits
    with torch.inference_mode():  # HF's forward runs on goose's kernel through PackedLinear
        torch.testing.assert_close(model(ids).logits, want_hf, rtol=1e-4, atol=1e-4)
    with pytest.raises(GooseError, match="pack=False"):
        LeanForward(model, kernel=False)


@needs_kernel
def test_a_change_of_packed_weights_is_never_decoded_stale():
    model = _tied_llama(True)
    packed.pack_float32(model, cpukernel.kernel())
    fwd = LeanForward(model)
    assert not fwd.stale()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.data.mul_(2.0)  # in place: a version bump
    assert fwd.stale()
    fwd = LeanForward(model)
    assert not fwd.stale()
    old = model.model.layers[0].self_attn.o_proj
    model.model.layers[0].self_attn.o_proj = packed.PackedLinear(
        packed.PanelWeight.pack(cpukernel.kernel(), old.weight.dequantize() * 0.5), None)  # a replaced module
    assert fwd.stale()


@needs_kernel
@pytest.mark.parametrize("tie,bias", [(True, False), (False, True)])
def test_load_model_streams_weights_into_panels(tmp_path, tie, bias):
    from goose.loading.model import load_model

    src = _tied_llama(tie, seed=3, bias=bias)
    src.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    model, _ = load_model(str(tmp_path))
    assert isinstance(model.model.layers[0].mlp.gate_proj.weight, packed.PanelWeight)
    assert model.model.layers[0].mlp.gate_proj.weight.data._base is model.model.layers[0].mlp.up_proj.weight.data._base
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    plain, _ = load_model(str(tmp_path), pack=False)
    assert type(plain.model.layers[0].mlp.gate_proj) is torch.nn.Linear
    for name, p in plain.named_parameters():
        mod = model.get_submodule(name.rpartition(".")[0])
        w = getattr(mod, name.rpartition(".")[2])
        w = w.dequantize() if isinstance(w, packed.PackedWeight) else w.detach()
        assert torch.equal(bits(w), bits(p.detach())), name
    ids = [5, 6, 7, 8, 9, 10]
    assert torch.equal(bits(LeanForward(model)(ids)), bits(LeanForward(plain)(ids)))


def _write_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(100)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0").save_pretrained(path)


@needs_kernel
def test_load_model_streams_a_qwen2_with_biases(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from goose.loading.model import load_model

    torch.manual_seed(5)
    cfg = Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=1, bos_token_id=0)
    Qwen2ForCausalLM(cfg).float().eval().save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    model, _ = load_model(str(tmp_path))
    plain, _ = load_model(str(tmp_path), pack=False)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, packed.PackedLinear) and q.bias is not None
    assert torch.equal(q.bias, plain.model.layers[0].self_attn.q_proj.bias)
    ids = [5, 6, 7, 8]
    assert torch.equal(bits(LeanForward(model)(ids)), bits(LeanForward(plain)(ids)))


@needs_kernel
def test_load_model_reports_a_missing_tensor(tmp_path):
    """A checkpoint without a tensor the model needs: the streamed load names it and transformers' own loader
    (which knows more checkpoint layouts) takes over, as it would without packing."""
    from safetensors.torch import load_file, save_file

    from goose.loading.stream import stream_load

    _tied_llama(True, seed=4).save_pretrained(tmp_path)
    f = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(str(f))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(GooseError, match="down_proj"):
        stream_load(tmp_path, "sdpa", place=packed.PanelPacker(cpukernel.kernel()))
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(32, 24, dtype=torch.uint8)  # packed int4, say
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(GooseError, match="down_proj.weight is torch.uint8"):
        stream_load(tmp_path, "sdpa", place=packed.PanelPacker(cpukernel.kernel()))
