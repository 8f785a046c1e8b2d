"""The exceptions users see: one line about bad input, an unsupported setup, or an engine that cannot take work.

Every one is a `GooseError` (a `ValueError`), so ``except GooseError`` catches them all; the subclasses let a
caller (the server maps them to HTTP statuses) act on the kind without reading the message:

| class | raised when | `goose serve` answers |
|---|---|---|
| `GooseError` | bad input or an unsupported configuration; the message says what to change | 400 |
| `QueueFull` | `Engine.submit` while `max_queue` requests wait | 429 |
| `EngineClosed` | `Engine.submit` after `close()` | 503 |
| `EngineFailed` | `Engine.submit` after the step loop failed (`Engine.failure`), or a request failed with it | 503 |
| `RequestFailed` | a request's own stage failed (its cache, prefix, drafting, forward, ...): that request only | 500 |
| `RequestCancelled` | `Request.result()` of a cancelled request | - |
"""


class GooseError(ValueError):
    """Bad input or unsupported configuration; the message says what to change."""


class QueueFull(GooseError):
    """The engine's queue holds `max_queue` waiting requests: try again later."""


class MethodNotAllowed(GooseError):
    """A request named a method its engine does not offer (`EngineConfig.methods`)."""


class EngineClosed(GooseError):
    """The engine was closed and takes no more requests."""


class EngineFailed(EngineClosed):
    """The engine's step loop failed (`Engine.failure` says why): it takes no more requests."""


class RequestFailed(GooseError):
    """One request's own stage failed; the engine and the other requests go on."""

    @classmethod
    def stage(cls, stage: str, exc: BaseException) -> "RequestFailed":
        """The error of a request whose `stage` (drafting, the forward, ...) raised `exc`."""
        return cls(f"{stage} failed: {type(exc).__name__}: {exc}")


class RequestCancelled(GooseError):
    """The request was cancelled before it finished."""
