"""Hugging Face `model.generate` integration.

Two entries, both running goose's step loop under transformers' own argument handling (max_new_tokens,
do_sample, temperature, top_k, top_p, eos_token_id, logits processors, stopping criteria):

* ``model.generate(**inputs, custom_generate=goose.custom_generate, ...)``: a callable. transformers does
  not hand a ``streamer`` to callables, so use the directory entry to stream.
* ``model.generate(**inputs, custom_generate=goose.HUB_ENTRY, trust_remote_code=True, streamer=..., ...)``:
  the same function as a local ``custom_generate/generate.py`` repository (transformers asks for
  ``trust_remote_code`` for any such directory), which also receives the streamer.

goose-specific options: ``goose_method`` (default "goose") and ``goose_config`` (a GooseConfig). One Decoder
per (model, method, config) is kept while the model lives, so learned drafting state and the cost curve carry
over between calls, as with a reused `Decoder`.
"""

from __future__ import annotations

import functools
import weakref
from pathlib import Path

import torch

from ..config import DecodeConfig, GooseConfig
from ..decoding import Decoder, id_set
from ..engine.sampling import Chooser
from ..errors import GooseError

HUB_ENTRY = str(Path(__file__).parents[1] / "hub")

_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _decoder(model, method: str, config: GooseConfig | None) -> Decoder:
    per_model = _DECODERS.setdefault(model, {})
    key = (method, config)
    if key not in per_model:
        per_model[key] = Decoder(model, None, method, config)
    return per_model[key]


def _eos(gc) -> set[int]:
    ids = getattr(gc, "_eos_token_tensor", None)
    return id_set(gc.eos_token_id if ids is None else ids)


def custom_generate(model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None,
                    generation_config=None, synced_gpus: bool = False, streamer=None, goose_method: str = "goose",
                    goose_config: GooseConfig | None = None, goose_streamer=None, **model_kwargs):
    """Returns what `model.generate` returns: the sequences ``[1, prompt + new]``, or a
    GenerateDecoderOnlyOutput (sequences, and scores / logits when asked) with return_dict_in_generate."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    gc = generation_config if generation_config is not None else model.generation_config
    if (gc.num_beams or 1) > 1:
        raise GooseError("goose does not do beam search: use num_beams=1")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise GooseError(f"goose decodes one sequence at a time; got input_ids of shape {tuple(input_ids.shape)}")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise GooseError("padded inputs are not supported: pass one unpadded sequence")
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(gc, flag, False):
            raise GooseError(f"{flag}=True is not supported by goose's custom_generate")
    streamer = streamer if streamer is not None else goose_streamer
    prompt = input_ids[0].tolist()
    max_new = gc.max_length - len(prompt) if gc.max_length is not None else gc.max_new_tokens
    if max_new is None or max_new < 1:
        raise GooseError(f"nothing to generate: max_length {gc.max_length} <= prompt length {len(prompt)}")
    record = bool(gc.return_dict_in_generate and (gc.output_scores or gc.output_logits))
    chooser = Chooser(logits_processor, bool(gc.do_sample), None, record)

    def stop(generated: list[int]) -> bool:
        ids = torch.tensor([prompt + generated], device=input_ids.device)
        return bool(stopping_criteria(ids, None).any())
    on_tokens = None
    if goose_streamer is not None:  # the directory entry: transformers left the prompt to us
        goose_streamer.put(input_ids.cpu())
    if streamer is not None:
        on_tokens = lambda block: streamer.put(torch.tensor(block))  # noqa: E731
    dec = _decoder(model, goose_method, goose_config)
    try:
        out, _ = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=max_new), chooser,
                                  stop if stopping_criteria else None, on_tokens,
                                  eos=_eos(gc))
    finally:
        if streamer is not None:
            streamer.end()
    sequences = torch.tensor([prompt + out], dtype=input_ids.dtype, device=input_ids.device)
    if not gc.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences,
                                     scores=tuple(chooser.scores[: len(out)]) if gc.output_scores else None,
                                     logits=tuple(chooser.raw[: len(out)]) if gc.output_logits else None)


def hub_generate(model, streamer=None, custom_generate=None, trust_remote_code=None, **kwargs):
    """The directory entry's `generate`: re-enters transformers' generate with the callable, carrying the
    streamer that transformers passes to directory entries but not to callables."""
    from transformers.generation.utils import GenerationMixin

    fn = functools.partial(globals()["custom_generate"], goose_streamer=streamer)
    return GenerationMixin.generate(model, custom_generate=fn, **kwargs)
