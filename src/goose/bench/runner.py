"""The bench loop: every question, every method, interleaved prompt by prompt, checked against `ar`.

For each question the methods still missing from the answers files run in turn (A B C, A B C, ...), so
machine drift hits all of them alike; `repeats` runs that round R times and keeps, per turn, the repeat
with the median wall time. `ar` (goose's own loop, one token per forward) is always run: it is the
reference of the lossless check and of the speedups. Multi-turn questions run every turn, each turn
conditioned on the same method's earlier answers. A memory variant (`goose@cold|earlier|warm`) starts each
run of a session with its suffix memory emptied and filled as its mode says (`_fill`); with a warm one, `ar`
answers every question first. One question's rows are written as soon as it is done, so Ctrl-C loses at
most the question in flight and a rerun resumes.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..cliargs import first_mismatch
from ..config import DEFAULT_MEMORY_MB
from ..decoding import eos_ids
from ..errors import GooseError
from ..loading.model import model_arith
from . import store
from .datasets import Question
from .engines import HF_METHODS, make_engine
from .methods import remembered, split

REFERENCE = "ar"
WARMUP_TOKENS = 8


@dataclass
class RunResult:
    done: int  # questions completed in this call
    skipped: int  # questions already complete in the answers files
    interrupted: bool


def with_reference(methods: list[str]) -> list[str]:
    """The methods to run: `ar` first (added when missing), no duplicates, order kept."""
    out = [REFERENCE]
    for m in methods:
        if m not in out:
            out.append(m)
    return out


class Prompter:
    """Token ids of each turn: raw text (turns joined with the previous answer) or the chat template."""

    def __init__(self, tokenizer, model, chat: bool, eos: set[int] | None = None) -> None:
        """eos: the stop tokens a raw context drops from earlier answers (default: the model's)."""
        if tokenizer is None:
            raise GooseError("goose bench needs a tokenizer")
        if chat and not getattr(tokenizer, "chat_template", None):
            raise GooseError("--chat needs a tokenizer with a chat template, and this one has none")
        self.tok, self.chat = tokenizer, chat
        self.eos = eos_ids(model, tokenizer) if eos is None else set(eos)

    def turn_ids(self, q: Question, turn: int, answers: list[list[int]]) -> list[int]:
        """Prompt of turn `turn`, given this method's answers (token ids) to the earlier turns."""
        if self.chat:
            msgs = [{"role": "system", "content": q.system}] if q.system else []
            for t in range(turn + 1):
                msgs.append({"role": "user", "content": q.turns[t]})
                if t < turn:
                    msgs.append({"role": "assistant", "content": self.tok.decode(answers[t], skip_special_tokens=True)})
            ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        ids = list(self.tok(q.system + "\n\n" + q.turns[0] if q.system else q.turns[0])["input_ids"])
        for t in range(1, turn + 1):
            ans = list(answers[t - 1])
            while ans and ans[-1] in self.eos:  # a stop token does not belong inside a raw context
                ans.pop()
            ids += ans + list(self.tok("\n\n" + q.turns[t], add_special_tokens=False)["input_ids"])
        return ids


class Runner:
    def __init__(self, model, tokenizer, methods: list[str], max_new_tokens: int = 256, chat: bool = False,
                 repeats: int = 1, config=None, model_id: str = "model", sampling: dict | None = None,
                 baseline=None, memory_mb: float = DEFAULT_MEMORY_MB) -> None:
        """baseline: the model `hf-ar` / `hf-pld` run on (`engines.load_baseline`); default `model`.
        memory_mb: the suffix memory of each memory variant (`goose@cold`, `goose@earlier`, `goose@warm`)."""
        if repeats < 1:
            raise GooseError(f"--repeats must be >= 1, got {repeats}")
        self.model, self.tok = model, tokenizer
        self.arith = model_arith(model)  # goose's arithmetic (the hf-* baselines run float32)
        self.methods = with_reference(methods)
        self.sampling = sampling or {}
        self.engines = {m: make_engine(model, tokenizer, m, config, self.sampling, baseline, memory_mb)
                        for m in self.methods}
        self.prompter = Prompter(tokenizer, model, chat)
        self.max_new, self.repeats, self.model_id = max_new_tokens, repeats, model_id
        self.live = {m: [0, 0, 0.0] for m in self.methods}  # tokens, forwards, seconds (this session)
        self._seq_cache: dict[int | str, list[list[int]]] = {}  # question id -> what a memory takes in from it

    # -- one method on one question -------------------------------------------------------------------
    def _run_turns(self, method: str, q: Question, fill: list[list[int]] | None = None) -> list[tuple]:
        engine, answers, turns = self.engines[method], [], []
        if fill is not None:  # a memory variant: the memory as this mode has it when the session starts
            engine.reset(fill)
        for t in range(len(q.turns)):
            ids = self.prompter.turn_ids(q, t, answers)
            out, stats = engine.generate(ids, self.max_new)
            answers.append(out)
            turns.append((ids, out, stats))
        return turns

    def warmup(self, q: Question) -> None:
        ids = self.prompter.turn_ids(q, 0, [])[:64]
        for engine in self.engines.values():
            engine.generate(ids, WARMUP_TOKENS)

    def _sequences(self, q: Question, row: dict) -> list[list[int]]:
        """What a decoder's memory takes in from one answered session: each turn's prompt and answer."""
        answers = row["token_ids"]
        return [self.prompter.turn_ids(q, t, answers) + list(answers[t]) for t in range(len(answers))]

    def _fill(self, mode: str | None, q: Question, questions: list[Question], ref_rows: dict) -> list | None:
        """The sequences a memory variant starts session `q` with: none (cold), those of the sessions before
        `q` (earlier) or of every other session (warm), as `ar` answered them (every method is lossless)."""
        i = next(k for k, p in enumerate(questions) if p.question_id == q.question_id)
        others = remembered(mode, questions, i)
        if others is None:
            return None
        out = []
        for p in others:
            if p.question_id not in self._seq_cache:
                self._seq_cache[p.question_id] = self._sequences(p, ref_rows[p.question_id])
            out += self._seq_cache[p.question_id]
        return out

    # -- the whole pass -----------------------------------------------------------------------------------
    def run(self, questions: list[Question], out: Path, progress: bool = True) -> RunResult:
        """Every method on every question. With a `@warm` memory variant, `ar` first answers every question
        still missing its answer (the warm memory holds the other sessions' answers); then the methods take
        turns question by question."""
        rows = {m: {r["question_id"]: r for r in store.read_answers(store.answers_path(out, m))} for m in self.methods}
        pending = [q for q in questions if any(q.question_id not in rows[m] for m in self.methods)]
        skipped = len(questions) - len(pending)
        if not pending:
            return RunResult(0, skipped, False)
        bar = _progress(len(questions), skipped, progress)
        done, interrupted = 0, False
        try:
            self.warmup(pending[0])
            if any(split(m)[1] == "warm" for m in self.methods):
                for q in pending:
                    if q.question_id not in rows[REFERENCE]:
                        self._question(q, [REFERENCE], questions, rows, out)
            for q in pending:
                todo = [m for m in self.methods if q.question_id not in rows[m]]
                if todo:
                    self._question(q, todo, questions, rows, out)
                done += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(self._postfix(), refresh=True)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if bar is not None:
                bar.close()
        return RunResult(done, skipped, interrupted)

    def _question(self, q: Question, todo: list[str], questions: list[Question], rows: dict, out: Path) -> None:
        """The methods `todo` on question `q` (`repeats` rounds), checked against `ar`, rows written."""
        fills = {m: self._fill(split(m)[1], q, questions, rows[REFERENCE]) for m in todo}
        runs = {m: [] for m in todo}
        for _ in range(self.repeats):
            for m in todo:
                runs[m].append(self._run_turns(m, q, fills[m]))
        ref = self._reference(q, runs, rows[REFERENCE].get(q.question_id))
        for m in todo:
            row = self._row(q, m, runs[m], ref)
            store.append_row(out, m, row)
            rows[m][q.question_id] = row

    def _reference(self, q: Question, runs: dict, stored: dict | None) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, tokens) of `ar` per turn: from this round, or rebuilt from its stored row."""
        if REFERENCE in runs:
            return [(ids, out) for ids, out, _ in runs[REFERENCE][0]]
        answers = stored["token_ids"]
        return [(self.prompter.turn_ids(q, t, answers), answers[t]) for t in range(len(answers))]

    def _row(self, q: Question, method: str, reps: list, ref: list) -> dict:
        """One Spec-Bench answer row, plus goose's fields (token ids, lossless, stats, every repeat's time)."""
        texts, ids_out, stats_out, walls, lossless, mismatches = [], [], [], [], [], []
        for t in range(len(q.turns)):
            times = [rep[t][2]["wall_time_s"] for rep in reps]
            pick = times.index(statistics.median_low(times))  # the median repeat (an actual run)
            ids, out, stats = reps[pick][t]
            same = all(rep[t][1] == out for rep in reps)
            ref_ids, ref_out = ref[t]
            # sampled hf-* draw other random numbers than goose's sampler, and compute in float32 where goose
            # runs in int8: their tokens are not comparable
            ok = None if (self.sampling or self.arith != "exact") and method in HF_METHODS else out == ref_out
            mismatch = None
            if ok is False:
                if ids == ref_ids:
                    mismatch = first_mismatch(self.model, ids, ref_out, out)
                else:  # an earlier turn diverged, so this turn saw a different context
                    pos = next((i for i, (a, b) in enumerate(zip(ref_out, out)) if a != b), min(len(out), len(ref_out)))
                    mismatch = {"position": pos, "context_differs": True}
            texts.append(self.tok.decode(out, skip_special_tokens=True))
            ids_out.append(out)
            stats_out.append({**stats, "deterministic": same})
            walls.append(times)
            lossless.append(ok)
            mismatches.append(mismatch)
            live = self.live[method]
            live[0] += stats["new_tokens"]
            live[1] += stats["forward_calls"]
            live[2] += stats["wall_time_s"]
        accept = [a + 1 for s in stats_out for a in (s["accept_lengths"] or [])]
        choice = {"index": 0, "turns": texts, "decoding_steps": [s["forward_calls"] for s in stats_out],
                  "new_tokens": [s["new_tokens"] for s in stats_out],
                  "wall_time": [s["wall_time_s"] for s in stats_out], "accept_lengths": accept}
        return {"question_id": q.question_id, "category": q.category, "answer_id": f"{method}-{q.question_id}",
                "model_id": self.model_id, "method": method, "tstamp": time.time(), "choices": [choice],
                "token_ids": ids_out, "prompt_tokens": [s["prompt_tokens"] for s in stats_out],
                "lossless": lossless, "mismatches": mismatches, "wall_times": walls, "stats": stats_out}

    def _postfix(self) -> str:
        parts = []
        for m, (tokens, fwd, secs) in self.live.items():
            tps = tokens / secs if secs else 0.0
            plain = m in ("ar", "hf-ar")
            parts.append(f"{m} {tps:.1f}t/s" if plain else f"{m} τ{tokens / max(fwd, 1):.2f} {tps:.1f}t/s")
        return " | ".join(parts)


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="q", desc="bench", file=sys.stderr, dynamic_ncols=True)
