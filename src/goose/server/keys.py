"""The API keys `goose serve` accepts, and the tenant each one names.

A key file (``goose serve --api-key-file PATH``) holds one key per line, optionally followed by its tenant::

    # key                      tenant
    sk-team-a-laptop           team-a
    sk-team-a-ci               team-a
    sk-guest

Blank lines and lines starting with ``#`` are skipped. Requests with keys of one tenant share that tenant's
prefix cache and suffix memory (docs/serving.md, "Tenants"); a key without a tenant names none. Keys are
looked up by their SHA-256 digest, so how long a lookup takes says nothing about the keys themselves.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..errors import GooseError

MAX_KEY_LINES = 10_000  # lines of a key file, comments and blank lines included
MAX_KEY_CHARS = 256  # characters of one key (visible ASCII: a bearer token)
MAX_TENANT_CHARS = 128  # characters of one tenant name


@dataclass(frozen=True)
class Key:
    """An accepted key: `scope` separates its requests' tenants from other keys' (the key file's tenant, else
    the key's own digest); `tenant` is the key file's tenant (None: the key names none)."""

    scope: str
    tenant: str | None


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class ApiKeys:
    """Keys and their tenants (``{key: tenant or None}``)."""

    def __init__(self, keys: dict[str, str | None]) -> None:
        self._keys = {}
        for key, tenant in keys.items():
            digest = _digest(key)
            self._keys[digest] = Key("key:" + digest if tenant is None else "tenant:" + tenant, tenant)

    def __len__(self) -> int:
        return len(self._keys)

    def lookup(self, token: str) -> Key | None:
        """The key `token` is (None: not one of these)."""
        return self._keys.get(_digest(token))


def read_key_file(path: str) -> ApiKeys:
    """The keys of a key file (see the module docstring). GooseError naming the line for a malformed one:
    more than two fields, a key of other than visible ASCII or over MAX_KEY_CHARS, a tenant over
    MAX_TENANT_CHARS, a key given twice; and for an unreadable file, one over MAX_KEY_LINES or one without
    keys."""
    keys: dict[str, str | None] = {}
    lines: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if n > MAX_KEY_LINES:
                    raise GooseError(f"the API key file {path} has more than {MAX_KEY_LINES:,} lines "
                                     "(MAX_KEY_LINES)")
                entry = _entry(line, f"the API key file {path}, line {n}")
                if entry is None:
                    continue
                key, tenant = entry
                if key in lines:
                    raise GooseError(f"the API key file {path}, line {n}: the key of line {lines[key]} again")
                keys[key], lines[key] = tenant, n
    except (OSError, UnicodeDecodeError) as exc:
        raise GooseError(f"cannot read the API key file {path}: {exc}") from None
    if not keys:
        raise GooseError(f"the API key file {path} holds no key")
    return ApiKeys(keys)


def _entry(line: str, where: str) -> tuple[str, str | None] | None:
    """(key, tenant or None) of one line of a key file; None for a blank line or a comment."""
    fields = line.split()
    if not fields or fields[0].startswith("#"):
        return None
    if len(fields) > 2:
        raise GooseError(f"{where}: expected 'KEY' or 'KEY TENANT', got {len(fields)} fields")
    key, tenant = fields[0], (fields[1] if len(fields) == 2 else None)
    if len(key) > MAX_KEY_CHARS or not all("!" <= c <= "~" for c in key):
        raise GooseError(f"{where}: a key is 1 to {MAX_KEY_CHARS} visible ASCII characters (MAX_KEY_CHARS)")
    if tenant is not None and len(tenant) > MAX_TENANT_CHARS:
        raise GooseError(f"{where}: a tenant has at most {MAX_TENANT_CHARS} characters (MAX_TENANT_CHARS), "
                         f"got {len(tenant)}")
    return key, tenant
