"""A tiny GGUF file written with the `gguf` package (a 2-layer random Llama and a 64-token vocabulary with a
sentencepiece-style tokenizer), for tests of GGUF loading and its cache: dequantizing it takes a second."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2


def vocabulary() -> list[str]:
    words = ["<unk>", "<s>", "</s>", "▁"] + [f"▁{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    words += list("abcdefghijklmnopqrstuvwxyz.,?!")
    return words[:64] + [f"<extra{i}>" for i in range(64 - len(words[:64]))]


def write_tiny_gguf(path: Path, seed: int = 0, quant: str | None = None, tied: bool = False) -> Path:
    """Write a tiny random Llama GGUF (float32 tensors) to `path`; another `seed` gives other weights of
    the same shapes and byte size. `quant` (a GGML type name such as "Q8_0"): its matrices in that format.
    `tied`: no output.weight, so the output head is the token embedding."""
    import gguf

    rng = np.random.default_rng(seed)
    vocab = vocabulary()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(0)  # all float32
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab)
    w.add_token_scores([0.0, 0.0, 0.0] + [-float(i) for i in range(len(vocab) - 3)])
    w.add_token_types([2, 3, 3] + [1] * (len(vocab) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def t(name: str, *shape: int) -> None:
        value = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if quant is None:
            w.add_tensor(name, value)
        else:
            kind = gguf.GGMLQuantizationType[quant]
            w.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)

    t("token_embd.weight", len(vocab), HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}."
        t(b + "attn_q.weight", HIDDEN, HIDDEN)
        t(b + "attn_k.weight", HIDDEN * KV_HEADS // HEADS, HIDDEN)
        t(b + "attn_v.weight", HIDDEN * KV_HEADS // HEADS, HIDDEN)
        t(b + "attn_output.weight", HIDDEN, HIDDEN)
        t(b + "ffn_gate.weight", FFN, HIDDEN)
        t(b + "ffn_up.weight", FFN, HIDDEN)
        t(b + "ffn_down.weight", HIDDEN, FFN)
        w.add_tensor(b + "attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    if not tied:
        t("output.weight", len(vocab), HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
