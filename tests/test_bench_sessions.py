"""goose bench's session workloads (multiturn, code-edit, agent) and the suffix-memory variants
(goose@cold, goose@earlier, goose@warm): sessions built the same every time, each turn's context holding
the method's own earlier answers, the memory filled as each mode says, every output identical to `ar`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from goose.bench import datasets, store, workloads
from goose.bench.cli import parse_methods, render_dir
from goose.bench.datasets import Question
from goose.bench.runner import Prompter, Runner
from goose.errors import GooseError
from test_bench import make_model, make_tokenizer, saved

MAX_NEW = 10


@pytest.fixture(scope="module")
def tiny():
    tok = make_tokenizer()
    return make_model(len(tok)), tok


def test_workloads_are_built_the_same_every_time():
    for name in ("code-edit", "agent"):
        assert workloads.load(name) == workloads.load(name)
    code = workloads.code_edit()
    assert len(code) == 6 and all(len(q.turns) == 3 and q.category == "code-edit" for q in code)
    for q, (name, source, edits) in zip(code, workloads.CODE_FILES):
        assert source in q.turns[0] and edits[0] in q.turns[0]  # the file, then the first edit request
        assert all(name in t and e in t for t, e in zip(q.turns[1:], edits[1:]))
    agent = workloads.agent()
    assert len(agent) == 6 and {q.system for q in agent} == {workloads.AGENT_SYSTEM}
    assert all(len(q.turns) == 4 and all(t.startswith("Tool result (") for t in q.turns[1:]) for q in agent)
    tools = [t["name"] for t in json.loads(workloads.AGENT_SYSTEM.split("\n\n")[1])]
    assert tools == ["search_orders", "get_order", "refund_order", "send_email"]


def test_multiturn_takes_two_turn_questions_round_robin(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}", f"follow-up {i}"]}
            for i, c in enumerate(["writing", "writing", "roleplay", "math", "roleplay"])]
    rows.append({"question_id": 9, "category": "translation", "turns": ["one turn only"]})
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    qs = datasets.load(f"multiturn:{path}")
    assert [q.question_id for q in qs] == ["multiturn-0", "multiturn-2", "multiturn-3", "multiturn-1",
                                           "multiturn-4"]  # writing, roleplay, math, then their second ones
    assert {q.category for q in qs} == {"multiturn"} and all(len(q.turns) == 2 for q in qs)
    assert [q.question_id for q in datasets.load(f"multiturn:{path}", limit=2)] == ["multiturn-0", "multiturn-2"]


def test_workload_names_and_bad_input():
    both = datasets.load("code-edit,agent", limit=2)
    assert [q.question_id for q in both] == ["code-edit-1", "code-edit-2", "agent-1", "agent-2"]
    with pytest.raises(GooseError, match="takes no file"):
        datasets.load("agent:foo.jsonl")
    mt = datasets.load("multiturn")  # the packaged Spec-Bench questions: MT-Bench's 80, round-robin
    assert len(mt) == 80 and all(len(q.turns) == 2 for q in mt)
    assert [q.question_id for q in datasets.load("multiturn", limit=2)] == ["multiturn-81", "multiturn-91"]


def test_jsonl_sessions_may_carry_a_system_prompt(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"id": 1, "turns": ["a"], "system": "be brief"}\n')
    assert datasets.load(f"jsonl:{path}")[0].system == "be brief"
    path.write_text('{"id": 1, "turns": ["a"], "system": 3}\n')
    with pytest.raises(GooseError, match="'system' must be a non-empty string"):
        datasets.load(f"jsonl:{path}")


def test_system_prompt_leads_the_context(tiny):
    model, tok = tiny
    q = Question("s", "agent", ("Write a short story", "Now rewrite the story"), system="Summarize the poem")
    raw = Prompter(tok, model, chat=False).turn_ids(q, 0, [])
    assert raw == tok("Summarize the poem\n\nWrite a short story")["input_ids"]
    chat = tok.decode(Prompter(tok, model, chat=True).turn_ids(q, 1, [[5, 6]]))
    assert chat.index("Summarize") < chat.index("Write") < chat.index("Now")


def test_memory_method_names():
    assert parse_methods("goose", "cold,warm") == ["goose", "goose@cold", "goose@warm"]
    assert parse_methods("pld,goose@earlier") == ["pld", "goose@earlier"]
    assert parse_methods("goose,pld", "warm,warm") == ["goose", "goose@warm", "pld"]
    for methods, memory, msg in (("goose", "hot", "unknown mode 'hot'"), ("pld@warm", None, "only goose"),
                                 ("goose@hot", None, "unknown memory mode"), ("pld", "warm", "needs a method")):
        with pytest.raises(GooseError, match=msg):
            parse_methods(methods, memory)


def _run(tiny, out: Path, questions, methods, chat=False, spy=None):
    model, tok = tiny
    store.open_run(out, {"model": "tiny", "dtype": "float32", "max_new_tokens": MAX_NEW, "chat": chat,
                         "methods": ["ar"] + methods, "dataset": "sessions", "commands": ["goose bench (test)"],
                         **{k: v for k, v in store.environment("tiny", model, "float32", "cpu", []).items()
                            if k not in ("model", "commands")}})
    runner = Runner(model, tok, methods, MAX_NEW, chat=chat, model_id="tiny")
    if spy is not None:
        spy(runner)
    return runner, runner.run(questions, out, progress=False)


def _sessions(tok) -> list[Question]:
    """Three-turn sessions over the tiny tokenizer's words, sharing a system prompt."""
    turns = ("Write a short story about a robot who learns to paint.", "Now rewrite the story as a poem.",
             "What is the capital of France?")
    return [Question(f"s{i}", "agent", turns[i:] + turns[:i], system="Summarize: The city council met")
            for i in range(3)]


def test_memory_modes_fill_run_order_and_identity(tiny, tmp_path):
    model, tok = tiny
    qs = _sessions(tok)
    calls: list[tuple] = []  # (method, prompt ids, answer) of every generate, in order
    resets: dict[str, list] = {}

    def spy(runner):
        for m, engine in runner.engines.items():
            def generate(ids, n, _m=m, _g=engine.generate):
                out, stats = _g(ids, n)
                calls.append((_m, list(ids), list(out)))
                return out, stats
            engine.generate = generate
            if "@" in m:
                def reset(seqs, _m=m, _r=engine.reset, _e=engine):
                    _r(seqs)
                    resets.setdefault(_m, []).append((list(seqs), [] if _e.memory is None else _e.memory.tokens))
                engine.reset = reset

    methods = ["goose", "goose@cold", "goose@earlier", "goose@warm"]
    runner, res = _run(tiny, tmp_path / "run", qs, methods, spy=spy)
    assert (res.done, res.interrupted) == (3, False)
    rows = {m: {r["question_id"]: r for r in store.read_answers(store.answers_path(tmp_path / "run", m))}
            for m in ["ar"] + methods}
    # every output is `ar`'s, turn by turn
    for m in methods:
        for q in qs:
            assert rows[m][q.question_id]["token_ids"] == rows["ar"][q.question_id]["token_ids"]
            assert all(ok is True for ok in rows[m][q.question_id]["lossless"])
    # each turn's context is the earlier turn's context, the method's own answer (no stop token) and the turn
    timed = calls[len(runner.engines):]  # after the warm-up
    for m in ["ar"] + methods:
        mine = [(ids, out) for k, ids, out in timed if k == m]
        assert len(mine) == 9
        for s in range(3):
            (p0, a0), (p1, _) = mine[3 * s], mine[3 * s + 1]
            kept = [t for t in a0 if t not in runner.prompter.eos]
            assert p1[: len(p0) + len(kept)] == p0 + kept
    # ar answers every session before the first warm session runs
    first_warm = next(i for i, c in enumerate(timed) if c[0] == "goose@warm")
    assert sum(1 for c in timed[:first_warm] if c[0] == "ar") == 9
    # what each mode's memory held when a session started: the sessions' prompts and ar's answers
    ar_calls = [(ids, out) for k, ids, out in timed if k == "ar"]
    seqs = {q.question_id: [ids + out for ids, out in ar_calls[3 * i: 3 * i + 3]] for i, q in enumerate(qs)}
    assert [fill for fill, _ in resets["goose@cold"]] == [[], [], []]
    assert [fill for fill, _ in resets["goose@earlier"]] == [[], seqs["s0"], seqs["s0"] + seqs["s1"]]
    assert [fill for fill, _ in resets["goose@warm"]] == [seqs["s1"] + seqs["s2"], seqs["s0"] + seqs["s2"],
                                                           seqs["s0"] + seqs["s1"]]
    assert [n for _, n in resets["goose@warm"]] == [sum(map(len, f)) for f, _ in resets["goose@warm"]]
    # the summary counts memory drafts: none without memory, some for the warm sessions
    render_dir(tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    cell = {m: summary["table"][m]["all"] for m in methods}
    assert cell["goose"]["drafted_memory"] == 0 and cell["goose"]["memory_token_share"] == 0
    assert cell["goose@warm"]["drafted_memory"] > 0
    assert cell["goose@warm"]["memory_token_share"] == cell["goose@warm"]["accepted_memory"] / \
        cell["goose@warm"]["new_tokens"]
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Suffix memory: cold and warm by category" in report and "from memory goose@warm" in report


def test_warm_sessions_resume(tiny, tmp_path):
    model, tok = tiny
    qs = _sessions(tok)[:2]
    _, first = _run(tiny, tmp_path / "r", qs[:1], ["goose@warm"])
    assert first.done == 1
    _, again = _run(tiny, tmp_path / "r", qs, ["goose@warm"])
    assert (again.done, again.skipped) == (1, 1)
    rows = store.read_answers(store.answers_path(tmp_path / "r", "goose@warm"))
    assert [r["question_id"] for r in rows] == ["s0", "s1"] and all(all(r["lossless"]) for r in rows)


def test_cli_sessions_with_memory(tiny, tmp_path, capsys):
    from goose.cli import main

    mdir = saved(tiny, tmp_path)
    out = tmp_path / "out"
    argv = ["bench", "--model", str(mdir), "--dataset", "agent", "--limit", "2", "--chat", "--methods", "goose",
            "--memory", "cold,warm", "--max-new-tokens", "4", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    meta = store.read_meta(out)
    assert meta["memory_mb"] == 64 and meta["methods"] == ["ar", "goose", "goose@cold", "goose@warm"]
    assert "suffix memory by category" in capsys.readouterr().out
    assert main(argv[:-3] + ["--memory-mb", "8", "--out", str(out), "--no-progress"]) == 2
    assert "memory_mb=64, not 8.0" in capsys.readouterr().err
    assert main(argv + ["--concurrency", "2"]) == 2
    assert "cannot be combined with --concurrency" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(argv + ["--memory-mb", "0"])
    assert "must be > 0" in capsys.readouterr().err


def test_vllm_sessions_logic_with_stand_in_engines(tiny, tmp_path, monkeypatch):
    """`--engine vllm` sessions without vLLM: its workers stood in by goose Decoders on the tiny model (plain
    by `ar`, suffix@MODE by goose@MODE, which resets the same way), to check the passes, fills and table."""
    from goose.bench import vllm_engine as ve

    model, tok = tiny
    mdir = saved(tiny, tmp_path)
    resets: list = []

    class StandIn(ve._DecoderEngine):
        def __init__(self, method):
            super().__init__(model, tok, "ar" if method == "plain" else method.replace("suffix", "goose"), 64)
            self.method = method

        def reset(self, sequences):
            resets.append((self.method, [list(p) + list(a) for p, a in sequences]))
            return super().reset(sequences)

    class Engines:
        def __init__(self, methods, *args):
            self.methods = methods

        def __enter__(self):
            return {m: StandIn(m) for m in self.methods}

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(ve, "_engines", Engines)
    monkeypatch.setattr("goose.loading.model.load_model", lambda path, *a, **k: (model, tok))
    qs = _sessions(tok)
    methods = ["plain", "suffix@cold", "suffix@warm", "decoder/ar", "decoder/goose@warm"]
    result = ve.run_sessions(methods, str(mdir), qs, False, MAX_NEW)
    ref = result["reference"]["plain"]
    for m in methods:
        for q in qs:
            assert [t["token_ids"] for t in result["turns"][m][q.question_id]] == \
                [t["token_ids"] for t in ref[q.question_id]]
    prompter = ve.session_prompter(str(mdir), False)
    seqs = {}
    for q in qs:
        answers = [t["token_ids"] for t in ref[q.question_id]]
        seqs[q.question_id] = [prompter.turn_ids(q, t, answers) + answers[t] for t in range(len(answers))]
    warm = [fill for m, fill in resets if m == "suffix@warm"]
    assert warm == [seqs["s1"] + seqs["s2"], seqs["s0"] + seqs["s2"], seqs["s0"] + seqs["s1"]]
    assert [fill for m, fill in resets if m == "suffix@cold"] == [[], [], []]
    table = ve.session_table(result, qs)
    assert all(r["identical"] == r["turns"] == 9 for r in table["all"].values())
    assert table["all"]["plain"]["tau"] == 1.0 and table["all"]["decoder/goose@warm"]["from_memory"] > 0
    assert table["all"]["decoder/ar"]["same_as_vllm_plain"] == 9
    text = ve.render_sessions(table, {"cpu": "cpu", "threads": 1, "vllm": "x", "model": "tiny", "sessions": 3,
                                      "dataset": "d", "max_new_tokens": MAX_NEW, "chat": False, "decoder": True})
    assert "| suffix@warm |" in text and "| decoder/goose@warm |" in text
