"""The names the command line offers, held where reading them imports nothing: its choices, help and argument
errors come before torch is loaded.

- `METHODS`: the decoding methods, in the order help and benchmarks list them. `goose.engine.methods` builds
  each from its registry, and refuses to import when the registry's names differ from these.
- `ARITHS`: the arithmetics of goose's forward (`goose.backends.lean.LeanForward`'s ``arith``).
"""

from __future__ import annotations

METHODS = ("ar", "pld", "tr", "iso3", "iso5", "goose-paper", "goose", "goose-nohead", "lookahead", "rest",
           "eagle2")
ARITHS = ("exact", "int8")
