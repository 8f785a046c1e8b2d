"""Where goose keeps its files: the user cache folder, and data files shipped inside installed packages."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .errors import GooseError


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "goose"


def package_file(pkg: str, relpath: str, what: str, hint: str) -> Path:
    """A data file shipped inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(pkg)
    if spec is None or spec.origin is None:
        raise GooseError(f"{what} needs the '{pkg}' package: {hint}")
    path = Path(spec.origin).parent / relpath
    if not path.is_file():
        raise GooseError(f"{what}: file {path} is missing; reinstall with: {hint}")
    return path
