"""Session workloads for `goose bench`: several turns each, every turn answered with the model's own earlier
answers in the context, where a memory of earlier requests has something to draft from.

- ``multiturn``: Spec-Bench's MT-Bench questions (two turns each), in round-robin order of their eight
  categories so that ``--limit N`` takes N sessions from as many categories as it can;
- ``code-edit``: six small Python files, each opened in a session of three successive edit requests
  ("reply with the whole updated file"), so every answer re-emits the file with a small change;
- ``agent``: six sessions of one tool-using support agent: the same system prompt with the tools' JSON
  schema, a customer task, then the results of the tools as user turns; the agent answers with tool-call
  JSON lines and a final JSON answer.

The code-edit and agent sessions are written out below and built the same way every time (no randomness,
no download): the files, edit requests, tasks and tool results were written for this benchmark. The tool
results are scripted (they do not depend on which tool the model called), so every method sees the same
turns; the model's own answers differ only where a method is not lossless, which the bench checks.
Each workload is one category of the bench's tables.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import GooseError
from .questions import MT_BENCH_CATEGORIES, Question, read_jsonl, spec_bench_file

WORKLOADS = ("multiturn", "code-edit", "agent")


def load(name: str, path: Path | None = None) -> list[Question]:
    """The sessions of one workload; `path`: Spec-Bench's question.jsonl (multiturn only; default: the packaged
    copy)."""
    if name == "multiturn":
        return multiturn(spec_bench_file() if path is None else path)
    if name == "code-edit":
        return code_edit()
    if name == "agent":
        return agent()
    raise GooseError(f"unknown workload '{name}'; choose from: {', '.join(WORKLOADS)}")


def multiturn(path: Path) -> list[Question]:
    """MT-Bench's two-turn questions from Spec-Bench, round-robin over its categories (category `multiturn`)."""
    by_cat: dict[str, list[Question]] = {c: [] for c in MT_BENCH_CATEGORIES}
    for q in read_jsonl(Path(path)):
        if q.category in by_cat and len(q.turns) >= 2:
            by_cat[q.category].append(q)
    out = []
    for i in range(max((len(v) for v in by_cat.values()), default=0)):
        for cat in MT_BENCH_CATEGORIES:
            if i < len(by_cat[cat]):
                q = by_cat[cat][i]
                out.append(Question(f"multiturn-{q.question_id}", "multiturn", q.turns))
    if not out:
        raise GooseError(f"{path} holds no two-turn MT-Bench questions")
    return out


# -- code editing ---------------------------------------------------------------------------------------------

EDIT_FIRST = ("Here is the file `{name}`:\n\n```python\n{source}```\n\n{edit} Reply with the whole updated file "
              "in one ```python block.")
EDIT_NEXT = "Next edit to `{name}`: {edit} Reply with the whole updated file in one ```python block."

CODE_FILES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("inventory.py", '''\
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 0


class Inventory:
    def __init__(self):
        self.items = {}

    def add_item(self, name, price, quantity=0):
        if name in self.items:
            self.items[name].quantity += quantity
        else:
            self.items[name] = Item(name, price, quantity)

    def total_value(self):
        return sum(item.price * item.quantity for item in self.items.values())
''', ("Add a method `remove_item(self, name, quantity)` that lowers the quantity and deletes the item when it "
      "reaches zero; raise KeyError for an unknown item.",
      "Add a method `low_stock(self, threshold=5)` that returns the names of items with fewer than `threshold` "
      "units, sorted by name.",
      "Add docstrings to the class `Inventory` and to each of its methods.")),
    ("temperature.py", '''\
def celsius_to_fahrenheit(c):
    return c * 9 / 5 + 32


def fahrenheit_to_celsius(f):
    return (f - 32) * 5 / 9


def convert(value, unit):
    if unit == "C":
        return celsius_to_fahrenheit(value)
    if unit == "F":
        return fahrenheit_to_celsius(value)
    raise ValueError("unit must be C or F")


def convert_all(values, unit):
    return [convert(v, unit) for v in values]
''', ("Add Kelvin: functions `celsius_to_kelvin` and `kelvin_to_celsius`, and let `convert` accept unit \"K\" "
      "(Kelvin to Celsius).",
      "Add type hints to every function.",
      "Make `convert_all` skip values that are None instead of failing on them.")),
    ("todo.py", '''\
import json


class TodoList:
    def __init__(self):
        self.tasks = []

    def add(self, title):
        self.tasks.append({"title": title, "done": False})

    def complete(self, index):
        self.tasks[index]["done"] = True

    def pending(self):
        return [t["title"] for t in self.tasks if not t["done"]]

    def save(self, path):
        with open(path, "w") as f:
            json.dump(self.tasks, f)
''', ("Add a classmethod `load(cls, path)` that reads a list saved by `save`.",
      "Give every task a `priority` field (default 1) and make `pending` return the titles sorted by priority, "
      "highest first.",
      "Make `complete` raise IndexError with a clear message when the index is out of range.")),
    ("stats.py", '''\
def mean(values):
    return sum(values) / len(values)


def median(values):
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    if n % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)
''', ("Add a function `std(values)` that returns the standard deviation, using `variance`.",
      "Make `mean`, `median` and `variance` raise ValueError(\"empty input\") for an empty list.",
      "Add a function `mode(values)` that returns the most common value (the smallest one on a tie).")),
    ("bank.py", '''\
class Account:
    def __init__(self, owner, balance=0.0):
        self.owner = owner
        self.balance = balance
        self.history = []

    def deposit(self, amount):
        self.balance += amount
        self.history.append(("deposit", amount))

    def withdraw(self, amount):
        self.balance -= amount
        self.history.append(("withdraw", amount))

    def __repr__(self):
        return f"Account({self.owner!r}, {self.balance:.2f})"
''', ("Make `deposit` and `withdraw` raise ValueError for amounts that are not positive.",
      "Make `withdraw` raise ValueError(\"insufficient funds\") when the balance would go below zero.",
      "Add a method `transfer(self, other, amount)` that withdraws from this account and deposits into `other`.")),
    ("text_utils.py", '''\
import re


def word_count(text):
    return len(text.split())


def slugify(text):
    text = text.lower().strip()
    text = re.sub(r"[^a-z0-9]+", "-", text)
    return text.strip("-")


def truncate(text, width):
    if len(text) <= width:
        return text
    return text[:width] + "..."
''', ("Make `truncate` count the three dots within `width`, so the result is never longer than `width`.",
      "Add a function `capitalize_words(text)` that capitalizes the first letter of every word.",
      "Make `word_count` ignore punctuation-only tokens such as \"-\" or \"...\".")),
)


def code_edit() -> list[Question]:
    """Six files, three successive edit requests each (category `code-edit`)."""
    out = []
    for i, (name, source, edits) in enumerate(CODE_FILES, 1):
        turns = [EDIT_FIRST.format(name=name, source=source, edit=edits[0])]
        turns += [EDIT_NEXT.format(name=name, edit=e) for e in edits[1:]]
        out.append(Question(f"code-edit-{i}", "code-edit", tuple(turns)))
    return out


# -- agent loops ----------------------------------------------------------------------------------------------

AGENT_TOOLS = (
    {"name": "search_orders", "description": "Find a customer's orders by e-mail address.",
     "parameters": {"type": "object", "properties": {"email": {"type": "string"}}, "required": ["email"]}},
    {"name": "get_order", "description": "Details of one order: items, status, dates, total.",
     "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}},
    {"name": "refund_order", "description": "Refund an order, fully or some of its items.",
     "parameters": {"type": "object", "properties": {
         "order_id": {"type": "string"}, "items": {"type": "array", "items": {"type": "string"}},
         "reason": {"type": "string"}}, "required": ["order_id", "reason"]}},
    {"name": "send_email", "description": "Send an e-mail to the customer.",
     "parameters": {"type": "object", "properties": {
         "to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
         "required": ["to", "subject", "body"]}},
)

AGENT_SYSTEM = (
    "You are the support agent of an online shop. You act only through these tools:\n\n"
    + json.dumps(AGENT_TOOLS, indent=2)
    + "\n\nTo call a tool, answer with exactly one line of JSON: "
      '{"tool": "<name>", "arguments": {...}}. The tool\'s result comes back in the next message, starting with '
      '"Tool result". When the task is done, answer with one line of JSON: {"final": "<what you did>"}.'
)


def _result(tool: str, payload: dict) -> str:
    return f"Tool result ({tool}): {json.dumps(payload)}"


# (task, tool results in order): a scripted environment, the same whatever the agent called
AGENT_SESSIONS: tuple[tuple[str, tuple[tuple[str, dict], ...]], ...] = (
    ("Customer anna.berg@example.com says her blender arrived broken and wants her money back.",
     (("search_orders", {"orders": [{"order_id": "A-1041", "date": "2024-03-02", "total": 89.0}]}),
      ("get_order", {"order_id": "A-1041", "items": ["blender B200"], "status": "delivered", "total": 89.0}),
      ("refund_order", {"order_id": "A-1041", "refunded": 89.0, "status": "refunded"}))),
    ("Customer li.wei@example.com asks where his order of running shoes is.",
     (("search_orders", {"orders": [{"order_id": "A-1187", "date": "2024-03-09", "total": 120.0}]}),
      ("get_order", {"order_id": "A-1187", "items": ["running shoes R5"], "status": "shipped",
                     "tracking": "TRK-55821", "expected": "2024-03-14"}),
      ("send_email", {"to": "li.wei@example.com", "status": "sent"}))),
    ("Customer maria.lopez@example.com was charged twice for one order and wants one charge refunded.",
     (("search_orders", {"orders": [{"order_id": "A-1203", "date": "2024-03-11", "total": 45.5},
                                    {"order_id": "A-1204", "date": "2024-03-11", "total": 45.5}]}),
      ("get_order", {"order_id": "A-1204", "items": ["desk lamp L3"], "status": "duplicate", "total": 45.5}),
      ("refund_order", {"order_id": "A-1204", "refunded": 45.5, "status": "refunded"}))),
    ("Customer tom.smith@example.com wants to return one of the two books in his last order.",
     (("search_orders", {"orders": [{"order_id": "A-0990", "date": "2024-02-20", "total": 38.0}]}),
      ("get_order", {"order_id": "A-0990", "items": ["book: Dune", "book: Emma"], "status": "delivered",
                     "total": 38.0}),
      ("refund_order", {"order_id": "A-0990", "refunded": 19.0, "items": ["book: Emma"], "status": "partial"}))),
    ("Customer sara.k@example.com asks for a copy of the invoice of her order of headphones.",
     (("search_orders", {"orders": [{"order_id": "A-1250", "date": "2024-03-13", "total": 199.0}]}),
      ("get_order", {"order_id": "A-1250", "items": ["headphones H9"], "status": "delivered", "total": 199.0,
                     "invoice": "INV-1250"}),
      ("send_email", {"to": "sara.k@example.com", "status": "sent"}))),
    ("Customer omar.h@example.com says his coffee grinder order never arrived and wants a refund.",
     (("search_orders", {"orders": [{"order_id": "A-1122", "date": "2024-03-05", "total": 64.0}]}),
      ("get_order", {"order_id": "A-1122", "items": ["coffee grinder G1"], "status": "lost in transit",
                     "total": 64.0}),
      ("refund_order", {"order_id": "A-1122", "refunded": 64.0, "status": "refunded"}))),
)


def agent() -> list[Question]:
    """Six sessions of the support agent: its task, then three tool results (category `agent`)."""
    out = []
    for i, (task, results) in enumerate(AGENT_SESSIONS, 1):
        turns = (task,) + tuple(_result(tool, payload) for tool, payload in results)
        out.append(Question(f"agent-{i}", "agent", turns, system=AGENT_SYSTEM))
    return out
