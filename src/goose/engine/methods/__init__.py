"""Decoding methods as (drafter, builder) pairs that all run through the same step loop.

A method keeps its drafting state (n-gram index, adjacency table, EMA) and answers four calls from the
loop: `begin` (new request), `draft` (the tree to verify this step), `harvest` (logits of every processed
position) and `commit` (tokens accepted). `observe` sees each verification result.

`base` holds `Method`; each method has its module (`ar`, `pld`, `tr`, `goose_paper`, `isotropic` for `iso3`
and `iso5`, `goose`, `lookahead`, `rest`, `eagle2`; `adjacency` is the base of those that keep an adjacency table);
`registry` builds them by name (`make_method`, `METHODS`).
"""

from __future__ import annotations

from .adjacency import AdjacencyMethod
from .ar import AR
from .base import Method
from .eagle2 import Eagle2
from .goose import DeviceAwareGoose, load_budget
from .goose_paper import GoosePaper
from .isotropic import Isotropic
from .lookahead import Lookahead
from .pld import PLD
from .registry import METHODS, REGISTRY, make_method
from .rest import Rest
from .tr import TokenRecycling

__all__ = ["Method", "AdjacencyMethod", "AR", "PLD", "TokenRecycling", "GoosePaper", "Isotropic",
           "DeviceAwareGoose", "load_budget", "Lookahead", "Rest", "Eagle2", "METHODS", "REGISTRY", "make_method"]
