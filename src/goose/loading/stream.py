"""Build a model without ever holding its weights twice: on the meta device, then tensor by tensor.

`stream_load` builds the model from its config on the meta device, lets `prepare` put weights in place first
(GGUF blocks), then reads the safetensors files one tensor at a time. `place(net, name, tensor)` may take a
tensor (packing it into goose's layout, `goose.backends.packed.PanelPacker`); any other tensor becomes the
parameter or buffer of that name. Each tensor is read with its own short-lived file mapping, so the pages read
are released as soon as the tensor is copied out, and the peak memory is what the model keeps plus one tensor
(`transformers`' own loader maps whole files, and a packing step after it holds both copies).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..errors import GooseError


def stream_load(path: Path, attn_implementation: str, prepare: Callable[[nn.Module], None] | None = None,
                place: Callable[[nn.Module, str, torch.Tensor], bool] | None = None) -> nn.Module:
    """The float32 model of the HF directory `path` (see the module doc); raises GooseError when its files do
    not hold every tensor the model needs, naming them."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        with no_init_weights():  # (every tensor is read below: initialising them is waste)
            net = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn_implementation)
        net.init_weights()  # (on the meta device this only ties the weights, as building the model would)
    if prepare is not None:
        prepare(net)
    shapes = {n: tuple(t.shape) for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta}
    wanted = set(shapes)
    files = sorted(Path(path).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            keys = [k for k in st.keys() if k in wanted]
        for key in keys:
            with safe_open(str(f), framework="pt") as st:  # one mapping per tensor: its pages go with it
                value = st.get_tensor(key)
            if tuple(value.shape) != shapes[key] or not (value.is_floating_point()):
                raise GooseError(f"{f.name}: {key} is {value.dtype} {list(value.shape)}, the model needs "
                                 f"float {list(shapes[key])} (a quantized or foreign checkpoint)")
            value = value.to(torch.float32)
            if place is None or not place(net, key, value):
                assign(net, key, value)
            wanted.discard(key)
            del value
    head, emb = net.get_output_embeddings(), net.get_input_embeddings()
    if (getattr(net.config, "tie_word_embeddings", False) and type(head) is nn.Linear and head.weight.is_meta
            and type(emb) is nn.Embedding and not emb.weight.is_meta):
        head.weight = emb.weight  # (assigning the embedding untied them)
    rotary = net.model.rotary_emb  # non-persistent buffers (inv_freq): computed from the config
    if any(b.is_meta for b in rotary.buffers()):
        net.model.rotary_emb = type(rotary)(config=net.config)
    left = [n for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta]
    if left:
        raise GooseError(f"{path} does not hold {', '.join(left[:3])}{' ...' if len(left) > 3 else ''}")
    try:
        net.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    return net.eval()


def assign(net: nn.Module, name: str, value: torch.Tensor) -> None:
    """Set the parameter or buffer `name` of `net` to `value` (a parameter without gradients)."""
    parent, _, attr = name.rpartition(".")
    mod = net.get_submodule(parent)
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[attr] = value
