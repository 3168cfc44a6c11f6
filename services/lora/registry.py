"""Tenant adapter registrations: a name a tenant gives a checked adapter, which only it can use.

Like grammar registrations (grammar_registry/registrations.py): each tenant has its own Redis
hash (`structserve:tenant:<tenant>:adapters`, name -> record), so another tenant's name is simply
absent and "not found" is the only answer it gets. Operator-wide adapters (`--lora-modules`)
come from the configuration, are every tenant's, and no tenant can take or delete their names.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from grammar_registry.registrations import DictHashes, RegistrationError, hash_call

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$"


class AdapterCaps(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_adapters: int = Field(default=16, ge=0)
    max_bytes: int = Field(default=2 << 30, ge=0)  # the tenant's weights files, summed


class AdapterRecord(BaseModel):
    name: str
    source: str  # inside the adapter store; an operator module's: its folder
    rank: int
    target_modules: list[str]
    bytes: int
    created: float = Field(default_factory=time.time)
    operator: bool = False  # from the configuration (`--lora-modules`): every tenant's

    def view(self) -> dict[str, Any]:
        """The API's answer (deployments/adapter_api.py): the operator's folders stay unsaid."""
        return {
            "id": self.name,
            "object": "adapter",
            "name": self.name,
            "source": None if self.operator else self.source,
            "rank": self.rank,
            "target_modules": self.target_modules,
            "bytes": self.bytes,
            "created": int(self.created),
            "owned_by": "operator" if self.operator else "tenant",
        }


class AdapterRegistry:
    def __init__(
        self,
        client: Any | None = None,
        caps: AdapterCaps | None = None,
        modules: dict[str, AdapterRecord] | None = None,
    ) -> None:
        self.client = client if client is not None else DictHashes()
        self.caps = caps or AdapterCaps()
        self.modules = dict(modules or {})
        self._lock = threading.Lock()  # caps are checked and written under one lock per process

    @staticmethod
    def _key(tenant: str) -> str:
        return f"structserve:tenant:{tenant}:adapters"

    def _call(self, method: str, *args: Any) -> Any:
        return hash_call(self.client, "adapters", method, *args)

    def check_new(self, tenant: str, name: str, taken: tuple[str, ...] = ()) -> None:
        """Before a registration reads a byte: its name free, the tenant's count under its cap.
        `taken`: the names of the base model (a tenant cannot shadow them)."""
        if name in taken or name in self.modules:
            raise RegistrationError(f"name: {name!r} is the name of a served model", 409)
        existing = self.list(tenant)
        if any(r.name == name for r in existing):
            raise RegistrationError(f"name: {name!r} is already registered", 409)
        if len(existing) >= self.caps.max_adapters:
            cap = self.caps.max_adapters
            raise RegistrationError(f"adapters: the tenant's cap of {cap} is reached", 429)

    def add(self, tenant: str, record: AdapterRecord, taken: tuple[str, ...] = ()) -> None:
        with self._lock:
            self.check_new(tenant, record.name, taken)
            used = sum(r.bytes for r in self.list(tenant))
            if used + record.bytes > self.caps.max_bytes:
                raise RegistrationError(
                    f"adapters: {used + record.bytes} bytes would exceed the tenant's cap of "
                    f"{self.caps.max_bytes}",
                    429,
                )
            self._call("hset", self._key(tenant), record.name, record.model_dump_json())

    def get(self, tenant: str, name: str) -> AdapterRecord:
        """The tenant's adapter or an operator's; 404 for any other name (another tenant's
        included: the same answer as for a name never registered)."""
        if name in self.modules:
            return self.modules[name]
        raw = self._call("hget", self._key(tenant), name)
        if raw is None:
            raise RegistrationError(f"adapter {name[:100]!r} not found", 404)
        return AdapterRecord.model_validate_json(raw)

    def list(self, tenant: str, with_modules: bool = False) -> list[AdapterRecord]:
        rows = self._call("hgetall", self._key(tenant))
        own = sorted(
            (AdapterRecord.model_validate(json.loads(v)) for v in rows.values()),
            key=lambda r: r.created,
        )
        return [*self.modules.values(), *own] if with_modules else own

    def delete(self, tenant: str, name: str) -> None:
        if name in self.modules:
            raise RegistrationError(f"adapter {name[:100]!r} is the operator's", 403)
        if not self._call("hdel", self._key(tenant), name):
            raise RegistrationError(f"adapter {name[:100]!r} not found", 404)


def engine_name(tenant: str, record: AdapterRecord) -> str:
    """The adapter's name inside an engine: tenants' names never meet (two tenants may both
    call theirs `support-v2`); an operator's is one adapter for all."""
    return f"operator/{record.name}" if record.operator else f"tenant/{tenant}/{record.name}"
