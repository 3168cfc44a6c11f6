"""Tenant grammar registrations: a named grammar gets an id that only its tenant can use.

Each tenant has its own Redis hash (`structserve:tenant:<tenant>:grammars`, id -> record), so every
operation is scoped by construction: another tenant's id is simply absent, and "not found" is the
only answer it can get (the same answer, on the same path, as for an id that never existed).
Without Redis (offline use) the same code runs on an in-process dict.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from grammar_registry.specs import GrammarSpec


class RegistrationError(ValueError):
    """`status` is the HTTP status the ingress answers with (404 not found, 409 name taken, 429
    cap reached, 503 store unavailable)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class RegistrationCaps(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_registrations: int = Field(default=100, ge=0)
    max_bytes: int = Field(default=8 << 20, ge=0)  # summed canonical spec sizes


class Registration(BaseModel):
    grammar_id: str
    name: str
    spec: GrammarSpec
    created: float
    bytes: int
    compile_s: float = 0.0
    warnings: list[str] = []


def hash_call(client: Any, what: str, method: str, *args: Any) -> Any:
    """A Redis hash command on `client`; its failures become a 503 naming `what`: per-tenant
    registrations (grammars, adapters, files) need the store, unlike the grammar cache, which
    falls back to compiling."""
    try:
        return getattr(client, method)(*args)
    except Exception as exc:
        message = f"{what}: the store is unavailable ({type(exc).__name__}); try again later"
        raise RegistrationError(message, 503) from exc


class DictHashes:
    """The few Redis hash commands the store uses, on a dict: for running without Redis."""

    def __init__(self) -> None:
        self._data: dict[str, dict[str, bytes]] = {}
        self._lock = threading.Lock()

    def hget(self, key: str, field: str) -> bytes | None:
        with self._lock:
            return self._data.get(key, {}).get(field)

    def hset(self, key: str, field: str, value: bytes | str) -> int:
        raw = value.encode() if isinstance(value, str) else value
        with self._lock:
            self._data.setdefault(key, {})[field] = raw
        return 1

    def hdel(self, key: str, field: str) -> int:
        with self._lock:
            return 1 if self._data.get(key, {}).pop(field, None) is not None else 0

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        with self._lock:
            return {k.encode(): v for k, v in self._data.get(key, {}).items()}


class RegistrationStore:
    def __init__(self, client: Any | None = None, caps: RegistrationCaps | None = None) -> None:
        self.client = client if client is not None else DictHashes()
        self.caps = caps or RegistrationCaps()
        self._lock = threading.Lock()  # caps are checked and written under one lock per process

    @staticmethod
    def _key(tenant: str) -> str:
        return f"structserve:tenant:{tenant}:grammars"

    def _call(self, method: str, *args: Any) -> Any:
        return hash_call(self.client, "registrations", method, *args)

    def add(self, tenant: str, name: str, spec: GrammarSpec, **meta: Any) -> Registration:
        size = spec.size_bytes()
        with self._lock:
            existing = self.list(tenant)
            if any(r.name == name for r in existing):
                raise RegistrationError(f"name: {name!r} is already registered", 409)
            if len(existing) >= self.caps.max_registrations:
                raise RegistrationError(
                    f"registrations: the tenant's cap of {self.caps.max_registrations} is reached",
                    429,
                )
            used = sum(r.bytes for r in existing)
            if used + size > self.caps.max_bytes:
                raise RegistrationError(
                    f"registrations: {used + size} bytes would exceed the tenant's cap of "
                    f"{self.caps.max_bytes}",
                    429,
                )
            reg = Registration(
                grammar_id="gr_" + secrets.token_hex(12),
                name=name,
                spec=spec,
                created=time.time(),
                bytes=size,
                **meta,
            )
            self._call("hset", self._key(tenant), reg.grammar_id, reg.model_dump_json())
        return reg

    def get(self, tenant: str, grammar_id: str) -> Registration:
        raw = self._call("hget", self._key(tenant), grammar_id)
        if raw is None:
            raise RegistrationError(f"grammar_id: {grammar_id!r} not found", 404)
        return Registration.model_validate_json(raw)

    def list(self, tenant: str) -> list[Registration]:
        rows = self._call("hgetall", self._key(tenant))
        regs = [Registration.model_validate(json.loads(v)) for v in rows.values()]
        return sorted(regs, key=lambda r: r.created)

    def delete(self, tenant: str, grammar_id: str) -> None:
        if not self._call("hdel", self._key(tenant), grammar_id):
            raise RegistrationError(f"grammar_id: {grammar_id!r} not found", 404)
