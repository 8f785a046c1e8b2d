"""The benchmark's method names: goose's own (`goose.engine.methods`) and Hugging Face's `generate` with the
keyword arguments each one adds, and goose's suffix-memory variants (``goose@cold``, ``goose@earlier``,
``goose@warm``). Free of torch, so the command line can check names before any load."""

from __future__ import annotations

from ..errors import GooseError
from ..names import METHODS

HF_METHODS = {"hf-ar": {}, "hf-pld": {"prompt_lookup_num_tokens": 10}}
ALL_METHODS = METHODS + tuple(HF_METHODS)
# What the suffix memory holds when a session starts (it then also takes in the session's own turns):
# cold: nothing; earlier: every earlier session of the run; warm: every other session of the run.
MEMORY_MODES = ("cold", "earlier", "warm")
MEMORY_METHODS = ("goose",)  # the methods that draft from the memory


def split(method: str) -> tuple[str, str | None]:
    """`goose@warm` -> ("goose", "warm"); a plain method name -> (name, None)."""
    base, sep, mode = method.partition("@")
    return base, (mode if sep else None)


def check(method: str) -> str:
    """`method` if it names a method or a memory variant of one; a clear error otherwise."""
    base, mode = split(method)
    if base not in ALL_METHODS:
        raise GooseError(f"unknown method '{base}'; choose from: {', '.join(ALL_METHODS)}")
    if mode is not None:
        if base not in MEMORY_METHODS:
            raise GooseError(f"'{method}': only {', '.join(MEMORY_METHODS)} drafts from the suffix memory")
        if mode not in MEMORY_MODES:
            raise GooseError(f"'{method}': unknown memory mode '{mode}'; choose from: {', '.join(MEMORY_MODES)}")
    return method


def remembered(mode: str | None, sessions: list, i: int) -> list | None:
    """The sessions a memory in `mode` holds when session `i` of `sessions` starts (see MEMORY_MODES); None
    for a method without a memory."""
    if mode is None:
        return None
    if mode == "cold":
        return []
    return sessions[:i] if mode == "earlier" else sessions[:i] + sessions[i + 1:]


def parse_memory(text: str | None) -> list[str]:
    """`--memory cold,warm` -> ["cold", "warm"] (checked); None or "" -> []."""
    modes = [m.strip() for m in (text or "").split(",") if m.strip()]
    for m in modes:
        if m not in MEMORY_MODES:
            raise GooseError(f"--memory: unknown mode '{m}'; choose from: {', '.join(MEMORY_MODES)}")
    return list(dict.fromkeys(modes))


def with_memory(methods: list[str], modes: list[str], memory_methods: tuple[str, ...] = MEMORY_METHODS) -> list[str]:
    """`methods` with a `@mode` variant of each memory method after it, for every mode."""
    if not modes:
        return methods
    bases = [m for m in methods if m in memory_methods]
    if not bases:
        raise GooseError(f"--memory needs a method that drafts from the memory in --methods "
                         f"({', '.join(memory_methods)})")
    out = []
    for m in methods:
        out.append(m)
        if m in memory_methods:
            out += [f"{m}@{mode}" for mode in modes if f"{m}@{mode}" not in methods]
    return list(dict.fromkeys(out))
