"""`goose serve --memory-snapshot PATH`: the suffix memories written to PATH at an interval and on shutdown, and
loaded from it at start-up (`goose.drafting.snapshot` holds the file format and its checks).

A snapshot is refused, in one line logged and shown by ``/health`` (``memory_snapshot``), when it is damaged or
was made for another model, tokenizer or memory setting; the server then starts with empty memories. Another
replica of the same model may start from a copy of the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from .. import cachefs
from ..backends.head import target_identity
from ..config import DEFAULT_SNAPSHOT_S
from ..drafting.snapshot import read_snapshot, write_snapshot
from ..errors import GooseError

EXPORT_TIMEOUT_S = 60.0  # how long a snapshot waits for the engine's loop to copy the memories
log = logging.getLogger("goose.server")


def snapshot_identity(model, tokenizer, min_match: int) -> dict:
    """What a snapshot must have been made with: the model (`target_identity`: shape and a digest of its output
    head rounded to bfloat16, so replicas of the same weights in float32 and bfloat16 share snapshots: the file
    holds token ids), the tokenizer (a digest of its vocabulary) and the memory's k-gram length."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":")).encode("utf-8")
    return {"model": target_identity(model, bf16=True), "tokenizer": hashlib.sha256(vocab).hexdigest()[:16],
            "min_match": int(min_match)}


class MemorySnapshots:
    """The snapshot file of one server: `acquire` (the file's lock for the server's lifetime) and `load` at
    start-up, `save` at an interval (`run`) and on shutdown, `carry` when a failed engine is replaced, `release`
    last. `status`: what happened last (for /health). No failure here stops the server: each is kept in
    `status` (and logged) and the server goes on with the memories it has."""

    def __init__(self, path: str | Path, identity: dict, vocab: int, interval_s: float = DEFAULT_SNAPSHOT_S) -> None:
        if not interval_s > 0:
            raise GooseError(f"the snapshot interval must be > 0 seconds, got {interval_s}")
        self.path, self.identity, self.vocab, self.interval_s = Path(path), identity, int(vocab), float(interval_s)
        self.status = "not loaded yet"
        self._saved = None  # the engine's memory report when the last snapshot was taken
        self._engine = None  # the engine loaded or saved last (another one is saved only when forced)
        self._lock_fd: int | None = None  # the lifetime lock (`acquire`)
        self.held_elsewhere = False  # another server holds the file: this one neither loads nor saves it
        self._saving = threading.Lock()  # one save at a time: the final one waits for a periodic one
        self._inflight: asyncio.Task | None = None  # the periodic save running now, if any
        self.loading = False  # a load is rebuilding the memories now

    # ---- the lifetime lock -------------------------------------------------------------------------------
    def acquire(self) -> bool:
        """Take the snapshot's lifetime lock (``PATH.owner``, an exclusive `flock` held until `release`) and
        remove the temporaries of writers that are gone (`cachefs.clean_stale`); False (and no load or save by
        this server) when another server holds it."""
        lock = self.path.with_name(self.path.name + ".owner")
        try:
            cachefs.private_dirs(self.path.parent)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            self.held_elsewhere = True
            self.status = f"cannot lock the memory snapshot {self.path} ({exc}): not loaded, not saved"
            log.error("%s", self.status)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            self.held_elsewhere = True
            self.status = (f"the memory snapshot {self.path} is in use by another server: this one starts with "
                           "empty memories and neither loads nor saves it")
            log.error("%s", self.status)
            return False
        self._lock_fd = fd
        cachefs.clean_stale(self.path.parent)  # temporaries a writer that is gone left beside the file
        return True

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- load and save -----------------------------------------------------------------------------------
    def load(self, engine) -> None:
        """Restore the engine's memories from the snapshot file, when there is one and it is whole and made for
        this model; otherwise log why in one line and go on with the memories the engine has. The pool is rebuilt
        off the step loop (`Engine.restore_memories`), with no deadline: its time grows with the file."""
        self._engine = engine
        if self.held_elsewhere:
            return
        if not self.path.exists():
            self.status = f"no snapshot at {self.path} yet: starting with empty memories"
            return
        self.loading = True  # (no save meanwhile: it would replace the file with less than it holds)
        self.status = f"loading {self.path}"
        try:
            tenants = read_snapshot(self.path, self.identity, self.vocab)
            engine.restore_memories(tenants, EXPORT_TIMEOUT_S)
        except Exception as exc:  # (GooseError for a refused file; anything else must not stop the server)
            why = str(exc) if isinstance(exc, GooseError) else f"{type(exc).__name__}: {exc}"
            self.status = f"{why}; starting with empty memories"
            log.warning("%s", self.status)
            return
        finally:
            self.loading = False
        self._saved = engine.memory_report
        self.status = f"loaded {len(tenants)} tenants from {self.path}"

    def save(self, engine, force: bool = False) -> bool:
        """Write a snapshot of the engine's memories when they changed since the last one (or `force`: whatever
        engine it is); True when written. An engine not seen before is saved only when forced (a replacement is
        loaded first: `carry`). A failure is logged and kept in `status`; the server goes on."""
        if self.held_elsewhere or self.loading or (engine is not self._engine and not force):
            return False
        with self._saving:
            report = engine.memory_report
            if not force and report == self._saved:
                return False
            try:
                nbytes = write_snapshot(self.path, self.identity, engine.export_memories(EXPORT_TIMEOUT_S))
            except Exception as exc:
                self.status = f"writing the memory snapshot {self.path} failed: {type(exc).__name__}: {exc}"
                log.error("%s", self.status)
                return False
            self._engine, self._saved = engine, report
            self.status = (f"wrote {report.tenants} tenants ({nbytes:,} bytes) to {self.path} at "
                           f"{time.strftime('%H:%M:%S')}")
            return True

    def carry(self, old, new) -> None:
        """A failed engine `old` is replaced by `new`: its memories are written to the file (the step loop has
        ended, so they are copied on this thread), then the file is loaded into `new`; when the write fails, the
        last snapshot written is loaded."""
        self.save(old, force=True)
        self.load(new)

    async def run(self, engine_now) -> None:
        """Until cancelled: every `interval_s` seconds, `save` the current engine's (``engine_now()``) memories.
        A save that fails or raises is kept in `status`; the next one is tried at the next interval."""
        while True:
            await asyncio.sleep(self.interval_s)
            self._inflight = asyncio.ensure_future(asyncio.to_thread(self.save, engine_now()))
            try:
                await asyncio.shield(self._inflight)
            except Exception as exc:  # (a cancellation is no Exception: it ends the loop)
                self.status = f"saving the memory snapshot {self.path} failed: {type(exc).__name__}: {exc}"
                log.error("%s", self.status)

    async def finished(self) -> None:
        """Wait for a periodic save still running (after `run` was cancelled), so the final save lands last."""
        if self._inflight is not None and not self._inflight.done():
            with contextlib.suppress(Exception):
                await self._inflight
