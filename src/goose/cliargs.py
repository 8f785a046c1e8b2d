"""Command-line pieces shared by `goose`'s subcommands (model and sampling options, argument types) and the
first-mismatch report of a lossless check."""

from __future__ import annotations

import argparse

from .config import DecodeConfig, EngineConfig
from .errors import GooseError
from .loading.packaged import DEFAULT_MODEL, PACKAGED
from .names import ARITHS, METHODS  # the choices of --arith and --method, read without torch


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"packaged name ({', '.join(PACKAGED)}), Hugging Face model directory, or .gguf file "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16, float64")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    p.add_argument("--weights", choices=["gguf", "float32"], default=None,
                   help="GGUF sources: gguf = multiply with the file's quantized blocks (same weights, "
                        "bit-identical logits, ~1/5 of the memory); float32 = the dequantized weights "
                        "(default: gguf where it applies)")
    p.add_argument("--arith", choices=(*ARITHS, "auto"), default="auto",
                   help="auto (default) = int8 where goose's integer kernels run the model's GGUF blocks (the "
                        "packaged models on an x86-64 CPU with AVX2), else exact; exact = float32 products of the "
                        "weights' values: the tokens of Hugging Face's float32 generate; int8 = 8-bit activations "
                        "times the GGUF blocks in integers (faster on every CPU measured; its tokens may differ "
                        "from float32's). Either is lossless against plain greedy decoding in the same arithmetic")


def add_head_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", default=None,
                   help="draft head for eagle2 and goose: a folder (`goose train-head`), 'packaged' (the model's "
                        "packaged head) or 'none'; default: packaged for eagle2, none for goose (training-free)")


def goose_config(args):
    """The GooseConfig of `--head` (None when it is not given: every default)."""
    if getattr(args, "head", None) is None:
        return None
    from .config import EagleConfig, GooseConfig

    return GooseConfig(eagle=EagleConfig(head=args.head))


def int_in(low: int, high: int | None = None):
    """An argparse type: an integer in low..high (no upper bound when high is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


positive_int = int_in(1)


def cli_arith(args) -> str:
    """The command's ``--arith`` as it will run ("auto" resolved before the model loads: `resolve_arith`), kept
    in `args` so that what a run records is what ran."""
    from .loading.model import resolve_arith

    args.arith = resolve_arith(args.arith, args.model, getattr(args, "weights", None), args.device, args.dtype)
    return args.arith


def method_name(text: str) -> str:
    if text not in METHODS:
        raise argparse.ArgumentTypeError(f"unknown method '{text}'; choose one of: {', '.join(METHODS)}")
    return text


def prefix_cache_mb(text: str) -> float:
    """``--prefix-cache-mb``: MiB for the engine's prefix cache, checked where every engine setting is
    (`EngineConfig`)."""
    try:
        return EngineConfig(prefix_cache_mb=float(text)).prefix_cache_mb
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    except GooseError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed's range


def seed_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be in 0..2^64-1, got {text}")
    return value


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="0 (default): greedy; > 0: sample at this temperature (lossless: same distribution)")
    p.add_argument("--top-k", type=positive_int, default=None, help="sample from the k most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep probability mass top-p (0, 1]")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="sampling seed, 0..2^64-1 (default 0): same seed, same tokens")


def sampling_options(args) -> dict:
    """DecodeConfig sampling fields from --temperature / --top-k / --top-p / --seed (temperature 0: greedy),
    checked together with --max-new-tokens, so bad values fail before any model loads."""
    if args.temperature == 0:
        if args.top_k is not None or args.top_p is not None:
            raise GooseError("--top-k / --top-p need sampling: give --temperature > 0")
        options = {}
    else:
        options = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                   "seed": args.seed}
    DecodeConfig(max_new_tokens=args.max_new_tokens, **options)
    return options


def first_mismatch(model, prompt_ids: list[int], ref: list[int], got: list[int]) -> dict:
    """Where two generations diverge, with both tokens' logits after the common prefix (tie vs bug), in the
    model's own arithmetic (``load_model(..., arith=...)``: int8 logits come from goose's int8 forward)."""
    import torch

    pos = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    info = {"position": pos, "ar_token": ref[pos] if pos < len(ref) else None,
            "token": got[pos] if pos < len(got) else None}
    if info["ar_token"] is not None and info["token"] is not None:
        from .engine.requests import default_forward
        from .loading.model import model_arith

        with torch.inference_mode():
            if model_arith(model) != "exact":  # Hugging Face's forward computes in float32
                fwd = default_forward(model)
                fwd.reset()  # (its single-sequence cache; requests decode on caches of their own)
                logits = fwd(prompt_ids + ref[:pos], keep_last=1)[-1].float()
                fwd.reset()
            else:
                ids = torch.tensor([prompt_ids + ref[:pos]], device=model.device)
                logits = model(ids).logits[0, -1].float()
        info["ar_logit"] = float(logits[info["ar_token"]])
        info["logit"] = float(logits[info["token"]])
    return info
