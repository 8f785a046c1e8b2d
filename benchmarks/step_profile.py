"""Per-stage time of one decoding step (draft, tensorize, forward, verify, compact, harvest, commit).

Runs each method on a few Spec-Bench questions (chat template) with the generic Hugging Face forward
(alone and with its linear layers on goose's kernel) and with the lean forward (on PyTorch's kernels, on
goose's linear kernel with PyTorch's attention, and on goose's linear and attention kernels), and prints ms per step
by stage and the share of the step spent outside the
forward. A long-prompt run shows that drafting cost does not grow with the context (incremental
indexes, no rescans; the prompt itself is indexed once, at the first draft, so a 32-token run of a 4k-token
prompt carries ~4 ms of it).

    python benchmarks/step_profile.py [--model smollm2-135m] [--methods ar,goose] [--max-new-tokens 96]
                                      [--weights gguf --arith exact|int8]

--weights gguf times the packaged model's GGUF blocks (what `goose run` uses) on the lean forward only, in the
arithmetic --arith.
"""

from __future__ import annotations

import argparse

from goose.backends.forward import HFForward
from goose.backends.lean import LeanForward
from goose.backends.lean import supports as lean_supports
from goose.decoding import Decoder
from goose.loading.model import load_model

STAGES = ("select", "draft", "tensorize", "forward", "verify", "compact", "harvest", "commit")


def prompts(n: int) -> list[str]:
    """The first question of each Spec-Bench category (the packaged copy), first `n` of them."""
    from goose.bench import datasets

    return [q.turns[0] for q in datasets.load("spec-bench", limit=1)][:n]


def profile(dec: Decoder, texts: list[str], max_new: int, chat: bool = True) -> tuple[dict, int, float]:
    stages = dict.fromkeys(STAGES, 0.0)
    steps = tokens = 0
    wall = 0.0
    dec.generate(texts[0], 8, chat=chat)  # warm-up
    for text in texts:
        res = dec.generate(text, max_new, chat=chat)
        for k, v in res.stats.stage_ms.items():
            if k not in stages:
                raise KeyError(f"the decoder reports a stage this script does not know: {k!r} (add it to STAGES)")
            stages[k] += v
        steps += len(res.stats.tree_sizes)
        tokens += res.stats.new_tokens
        wall += res.stats.wall_time_s
    return {k: v / max(1, steps) for k, v in stages.items()}, tokens, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="ar,goose")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--long-prompt-tokens", type=int, default=4000)
    ap.add_argument("--weights", choices=["float32", "gguf"], default="float32")
    ap.add_argument("--arith", choices=["exact", "int8"], default="exact", help="with --weights gguf")
    args = ap.parse_args()
    if args.weights == "gguf":
        model, tok = load_model(args.model, weights="gguf", arith=args.arith)
        backends = {f"gguf-{args.arith}": LeanForward}
    else:
        model, tok = load_model(args.model, pack=False)  # (HF and PyTorch kernels are timed too)
        # generic forward; "hf+kernel": its linears on goose's kernel
        backends = {"hf": lambda m: HFForward(m, kernel=False), "hf+kernel": HFForward}
    texts = prompts(args.prompts)
    if args.weights == "float32" and lean_supports(model):
        backends["lean-torch"] = lambda m: LeanForward(m, kernel=False)  # PyTorch's kernels
        backends["lean-linear"] = lambda m: LeanForward(m, attention_kernel=False)  # goose's linear kernel only
        backends["lean"] = LeanForward  # goose's linear and attention kernels where available (the default)
    print(f"{'method':12} {'forward':10} " + " ".join(f"{s:>9}" for s in STAGES) + f" {'outside%':>9} {'tok/s':>7}")
    for method in args.methods.split(","):
        for name, cls in backends.items():
            per_step, tokens, wall = profile(Decoder(model, tok, method, forward=cls(model)), texts,
                                             args.max_new_tokens)
            total = sum(per_step.values())
            outside = 100.0 * (total - per_step["forward"]) / total if total else 0.0
            print(f"{method:12} {name:10} " + " ".join(f"{per_step[s]:9.2f}" for s in STAGES)
                  + f" {outside:9.1f} {tokens / wall:7.1f}")
    # drafting cost vs context length: same method, a short and a ~4k-token prompt
    base = "def f(x):\n    return x + 1\n"
    long_text = (base * (args.long_prompt_tokens // max(1, len(tok(base)["input_ids"])) + 1))
    for label, text in (("short", base * 4), ("long", long_text)):
        dec = Decoder(model, tok, "goose")
        res = dec.generate(text, 32)
        steps = max(1, len(res.stats.tree_sizes))
        print(f"goose draft ms/step with a {label} prompt ({res.stats.prompt_tokens} tokens): "
              f"{res.stats.stage_ms.get('draft', 0.0) / steps:.2f}  "
              f"(harvest {res.stats.stage_ms.get('harvest', 0.0) / steps:.2f})")


if __name__ == "__main__":
    main()
