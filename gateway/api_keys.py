"""ApiKeys: the gateway's API keys, each naming the tenant whose requests it may touch.

Keys come as `TENANT=KEY` (or a bare `KEY`, tenant `default`) from `--api-key` (repeatable),
`LLMQ_API_KEYS` (several, separated by commas or whitespace) and `--api-keys-file` (one per line,
`TENANT=KEY` or `TENANT KEY`, `#` comments). Several keys may name one tenant (rotation).

A tenant's request ids are `<tenant>:<id>`, its files and batches are filed under its name, so a
key reaches its own tenant's requests, files and batches and nothing else: not by guessing ids,
not by resuming or cancelling, not by reusing an id another tenant chose.

Admin tenants (`--admin-tenant`, every key of theirs) see and act on the whole pool in the
dashboard: every dead letter, every request id. A gateway without keys (`--no-auth`) is on a
trusted network by definition, so its one tenant is an admin.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

from llmq.broker.keys import TENANT_PATTERN, is_valid_tenant

__all__ = ["DEFAULT_TENANT", "ApiKeys"]

DEFAULT_TENANT = "default"
_SPLIT = re.compile(r"[\s,]+")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: dict[str, str] | None = None, *, anonymous: bool = False,
                 admin_tenants: Iterable[str] = ()) -> None:
        """`keys`: key -> tenant. `anonymous`: no key needed, everyone is tenant `default`.
        `admin_tenants`: tenants whose keys may see and act on the whole pool."""
        self._tenants: dict[bytes, str] = {}
        for key, tenant in (keys or {}).items():
            if not key:
                raise ValueError("an API key may not be empty")
            if not is_valid_tenant(tenant):
                raise ValueError(f"tenant {tenant!r:.60} must match {TENANT_PATTERN}")
            self._tenants[_digest(key)] = tenant
        self.anonymous = anonymous
        if not self._tenants and not anonymous:
            raise ValueError("no API keys: give --api-key TENANT=KEY (or LLMQ_API_KEYS, or "
                             "--api-keys-file), or --no-auth for a gateway on a trusted network")
        self.admin_tenants = frozenset(admin_tenants)
        if unknown := self.admin_tenants - self.tenants:
            raise ValueError(f"admin tenant(s) {', '.join(sorted(unknown))} have no API key")

    @classmethod
    def parse(cls, entries: Iterable[str], *, files: Iterable[str | Path] = (),
              anonymous: bool = False, admin_tenants: Iterable[str] = ()) -> ApiKeys:
        """Keys from `TENANT=KEY` entries (each may hold several) and key files; admin tenants
        from entries that may each hold several, separated by commas or whitespace."""
        keys: dict[str, str] = {}
        for entry in entries:
            for item in _SPLIT.split(entry.strip()):
                if item:
                    cls._add(keys, *cls._pair(item))
        for path in files:
            for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                tenant, sep, key = line.partition("=") if "=" in line else line.partition(" ")
                if not sep or not key.strip():
                    raise ValueError(f"{path}:{number}: expected TENANT=KEY or TENANT KEY")
                cls._add(keys, tenant.strip(), key.strip())
        admins = [name for entry in admin_tenants for name in _SPLIT.split(entry.strip()) if name]
        return cls(keys, anonymous=anonymous, admin_tenants=admins)

    @staticmethod
    def _pair(item: str) -> tuple[str, str]:
        tenant, sep, key = item.partition("=")
        return (tenant, key) if sep else (DEFAULT_TENANT, item)

    @staticmethod
    def _add(keys: dict[str, str], tenant: str, key: str) -> None:
        if key in keys and keys[key] != tenant:
            raise ValueError(f"one API key is given for two tenants ({keys[key]}, {tenant})")
        keys[key] = tenant

    @property
    def tenants(self) -> set[str]:
        return set(self._tenants.values()) | ({DEFAULT_TENANT} if self.anonymous else set())

    def is_admin(self, tenant: str) -> bool:
        return self.anonymous or tenant in self.admin_tenants

    def tenant_of_digest(self, digest: bytes) -> str | None:
        """The tenant of the key whose SHA-256 is `digest` (the dashboard's session cookie)."""
        if self.anonymous:
            return DEFAULT_TENANT
        return self._tenants.get(digest)

    @staticmethod
    def digest(key: str) -> bytes:
        return _digest(key.strip())

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer <key>` header; None when it names none."""
        if self.anonymous:
            return DEFAULT_TENANT
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        # NOTE: keys are looked up by their SHA-256: how long a lookup takes says nothing about
        # the key that was tried, and the keys themselves are not kept in memory.
        return self._tenants.get(_digest(key.strip()))
