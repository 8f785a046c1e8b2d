"""`goose serve --memory-snapshot PATH`: the suffix memories written to PATH at an interval and on shutdown, and
loaded from it at start-up (`goose.drafting.snapshot` holds the file format and its checks).

A snapshot is refused, in one line logged and shown by ``/health`` (``memory_snapshot``), when it is damaged or
was made for another model, tokenizer or memory setting; the server then starts with empty memories. Another
replica of the same model may start from a copy of the file.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from pathlib import Path

from ..backends.head import target_identity
from ..config import DEFAULT_SNAPSHOT_S
from ..drafting.snapshot import read_snapshot, write_snapshot
from ..errors import GooseError

EXPORT_TIMEOUT_S = 60.0  # how long a snapshot waits for the engine's loop to copy the memories
log = logging.getLogger("goose.server")


def snapshot_identity(model, tokenizer, min_match: int) -> dict:
    """What a snapshot must have been made with: the model (`target_identity`: shape and a digest of its output
    head), the tokenizer (a digest of its vocabulary) and the memory's k-gram length."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":")).encode("utf-8")
    return {"model": target_identity(model), "tokenizer": hashlib.sha256(vocab).hexdigest()[:16],
            "min_match": int(min_match)}


class MemorySnapshots:
    """The snapshot file of one server: `load` at start-up, `save` at an interval (`run`) and on shutdown.
    `status`: what happened last (for /health)."""

    def __init__(self, path: str | Path, identity: dict, vocab: int, interval_s: float = DEFAULT_SNAPSHOT_S) -> None:
        if not interval_s > 0:
            raise GooseError(f"the snapshot interval must be > 0 seconds, got {interval_s}")
        self.path, self.identity, self.vocab, self.interval_s = Path(path), identity, int(vocab), float(interval_s)
        self.status = "not loaded yet"
        self._saved = None  # the engine's memory report when the last snapshot was taken
        self._engine = None  # the engine loaded or saved last (a rebuilt one is loaded first, never saved empty)

    def load(self, engine) -> None:
        """Restore the engine's memories from the snapshot file, when there is one and it is whole and made for
        this model; otherwise log why in one line and start empty."""
        self._engine = engine
        if not self.path.exists():
            self.status = f"no snapshot at {self.path} yet: starting with empty memories"
            return
        try:
            tenants = read_snapshot(self.path, self.identity, self.vocab)
        except GooseError as exc:
            self.status = f"{exc}; starting with empty memories"
            log.warning("%s", self.status)
            return
        engine.restore_memories(tenants, EXPORT_TIMEOUT_S)
        self._saved = engine.memory_report
        self.status = f"loaded {len(tenants)} tenants from {self.path}"

    def save(self, engine, force: bool = False) -> bool:
        """Write a snapshot of the engine's memories when they changed since the last one (or `force`); True when
        written. A failure is logged and kept in `status`; the server goes on. An engine not seen before (the
        server rebuilt a failed one) is first loaded from the snapshot instead."""
        if engine is not self._engine:
            self.load(engine)
            return False
        report = engine.memory_report
        if not force and report == self._saved:
            return False
        try:
            nbytes = write_snapshot(self.path, self.identity, engine.export_memories(EXPORT_TIMEOUT_S))
        except (OSError, TimeoutError, GooseError) as exc:
            self.status = f"writing the memory snapshot {self.path} failed: {exc}"
            log.error("%s", self.status)
            return False
        self._saved = report
        self.status = f"wrote {report.tenants} tenants ({nbytes:,} bytes) to {self.path} at {time.strftime('%H:%M:%S')}"
        return True

    async def run(self, engine_now) -> None:
        """Until cancelled: every `interval_s` seconds, `save` the current engine's (``engine_now()``) memories."""
        while True:
            await asyncio.sleep(self.interval_s)
            await asyncio.to_thread(self.save, engine_now())
