"""`ar`: plain decoding."""

from __future__ import annotations

from .base import Method


class AR(Method):
    """One token per forward: the reference every other method must equal."""

    name = "ar"
