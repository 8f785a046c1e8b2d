"""Every decoding method by name: `REGISTRY` holds how `make_method` builds each, `METHODS` is its names.

A new method is one module in this package and one line in `REGISTRY` (its name also goes into
`goose.names.METHODS`, which the command line reads without importing torch; importing this module fails while
the two differ).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ... import names
from ...config import GooseConfig
from ...errors import GooseError
from ...selection.costmodel import CostCurve
from .ar import AR
from .base import Method
from .eagle2 import Eagle2
from .goose import DeviceAwareGoose
from .goose_paper import GoosePaper
from .isotropic import Isotropic
from .lookahead import Lookahead
from .pld import PLD
from .rest import Rest
from .tr import TokenRecycling

# what builds a method from (vocab_size, the GOOSE configuration, the device's cost curve or None)
Factory = Callable[[int, GooseConfig, CostCurve | None], Method]

# name -> its factory, in the order of goose.names.METHODS
REGISTRY: dict[str, Factory] = {
    "ar": lambda vocab, cfg, cost: AR(),
    "pld": lambda vocab, cfg, cost: PLD(),
    "tr": lambda vocab, cfg, cost: TokenRecycling(vocab),
    "iso3": lambda vocab, cfg, cost: Isotropic(vocab, 3, cfg),
    "iso5": lambda vocab, cfg, cost: Isotropic(vocab, 5, cfg),
    "goose-paper": lambda vocab, cfg, cost: GoosePaper(vocab, cfg),
    "goose": lambda vocab, cfg, cost: DeviceAwareGoose(vocab, cfg, cost),
    "goose-nohead": lambda vocab, cfg, cost: DeviceAwareGoose(vocab, _no_head(cfg), cost),
    "lookahead": lambda vocab, cfg, cost: Lookahead(),
    "rest": lambda vocab, cfg, cost: Rest(),
    "eagle2": lambda vocab, cfg, cost: Eagle2(cfg.eagle, cost),
}

def _no_head(cfg: GooseConfig) -> GooseConfig:
    """`cfg` with the draft head off (`goose-nohead`: GOOSE training-free, whatever heads are packaged)."""
    return replace(cfg, eagle=replace(cfg.eagle, head="none"))


METHODS = tuple(REGISTRY)
if METHODS != names.METHODS:
    raise ImportError(f"goose.engine.methods' registry holds {METHODS}, goose.names.METHODS {names.METHODS}: "
                      f"the two must name the same methods in the same order")


def make_method(name: str, vocab_size: int, config: GooseConfig | None = None,
                cost: CostCurve | None = None) -> Method:
    factory = REGISTRY.get(name)
    if factory is None:
        raise GooseError(f"unknown method '{name}'; choose one of: {', '.join(METHODS)}")
    return factory(vocab_size, config or GooseConfig(), cost)
