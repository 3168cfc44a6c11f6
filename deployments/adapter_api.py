"""LoRA adapters over HTTP: a tenant's registrations, vLLM's load/unload routes, and the adapter
a completion's `model` names (`Ingress` binds the routes).

A registration is checked in full before it is kept (services/lora/adapter.py, on a thread of
the ingress: the folder inside the store, sizes, shapes against the base model, finite weights),
so a bad adapter is a 400 naming what is wrong and never reaches a replica. The base model's
shape is asked of a replica once. Registrations live in Redis (services/lora/registry.py), each
tenant's in its own hash: another tenant's name is a 404 for every verb.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from deployments.answers import ApiError
from deployments.service_config import ServiceConfig
from grammar_registry.registrations import RegistrationError
from services.lora.adapter import (
    CONFIG,
    WEIGHTS,
    AdapterError,
    BaseShape,
    Limits,
    check_adapter,
)
from services.lora.registry import ADAPTER_NAME, AdapterRecord, AdapterRegistry, engine_name
from services.lora.store import AdapterStore, StoreUnavailable, open_store

if TYPE_CHECKING:
    from deployments.gate import Gate


class AdapterRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=ADAPTER_NAME)
    source: str = Field(min_length=1, max_length=1024)  # a folder inside the adapter store


class LoadLoRAAdapter(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter` body: `lora_path` is a folder inside the store."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(pattern=ADAPTER_NAME)
    lora_path: str = Field(min_length=1, max_length=1024)
    load_inplace: bool = False  # vLLM's: replace an adapter of that name


class UnloadLoRAAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=64)
    lora_int_id: int | None = None  # vLLM's; names are what identify adapters here


@dataclass(frozen=True)
class AdapterRef:
    """What a replica needs to serve a request on an adapter: its engine name (scoped by
    tenant), and where its files are (a store source, or an operator module's folder)."""

    name: str
    source: str
    operator: bool = False

    def folder(self, store: AdapterStore | None) -> Path:
        """The local folder (copied from a bucket first); call it off the event loop."""
        if self.operator:
            return Path(self.source)
        if store is None:
            raise AdapterError("model", "this replica has no adapter store (adapters.store)")
        return store.folder(self.source)


def store_of(config: ServiceConfig) -> AdapterStore | None:
    a = config.adapters
    if a.store is None:
        return None
    return open_store(a.store, a.cache_dir, config.llm.engine.max_lora_bytes, a.store_options)


def module_record(name: str, folder: str) -> AdapterRecord:
    """An operator module's listing, from its config (the engine checks it when it loads)."""
    try:
        config = json.loads((Path(folder) / CONFIG).read_text("utf-8"))
        size = (Path(folder) / WEIGHTS).stat().st_size
        targets = config["target_modules"]
        targets = [targets] if isinstance(targets, str) else list(targets)
        return AdapterRecord(
            name=name, source=folder, rank=int(config["r"]), target_modules=targets,
            bytes=size, operator=True,
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"adapters.modules.{name}: not a PEFT LoRA folder ({exc})") from exc


class Adapters:
    def __init__(self, config: ServiceConfig, redis: Any, llm: Any) -> None:
        self.enabled = config.llm.engine.enable_lora
        self.store = store_of(config)
        modules = {n: module_record(n, f) for n, f in config.adapters.modules.items()}
        self.registry = AdapterRegistry(redis, config.adapters.caps, modules)
        self.base_names = (config.served_model_name, *config.model_aliases)
        self.llm = llm
        self._shape: tuple[BaseShape, Limits] | None = None

    async def _call(self, fn: Any, *args: Any) -> Any:
        """A registry call (Redis, blocking) off the event loop; its errors as HTTP errors."""
        try:
            return await asyncio.to_thread(fn, *args)
        except RegistrationError as exc:
            reason = "adapters_cap" if exc.status == 429 else None
            code = "model_not_found" if exc.status == 404 else None
            raise ApiError(exc.status, str(exc), reason=reason, code=code) from exc

    async def resolve(self, tenant: str, model: str) -> AdapterRef | None:
        """None for the base model; the adapter `model` names, or the base model's 404."""
        if model in self.base_names:
            return None
        if not self.registry.modules and not self.enabled:
            raise _not_found(model, self.base_names[0])
        try:
            record = await self._call(self.registry.get, tenant, model)
        except ApiError as exc:
            if exc.status == 404:
                raise _not_found(model, self.base_names[0]) from exc
            raise
        return AdapterRef(engine_name(tenant, record), record.source, record.operator)

    async def models(self, tenant: str) -> list[AdapterRecord]:
        if not self.enabled:
            return []
        return list(await self._call(self.registry.list, tenant, True))

    async def shape(self) -> tuple[BaseShape, Limits]:
        if self._shape is None:
            try:
                limits = await self.llm.limits.remote()
            except Exception as exc:
                raise ApiError(503, "the model replica is unavailable; try again") from exc
            lora = limits["lora"]
            dims = {k: tuple(v) for k, v in lora["dims"].items()}
            base = BaseShape(lora["layers"], dims)
            self._shape = base, Limits(lora["max_rank"], lora["max_bytes"])
        return self._shape

    async def register(
        self, tenant: str, name: str, source: str, replace: bool = False
    ) -> AdapterRecord:
        """Checks and keeps a tenant's adapter; `replace`: one of that name gives way (only
        once the new one has passed every check)."""
        if not self.enabled:
            raise ApiError(400, "adapters: LoRA is off on this service (llm.engine.enable_lora)")
        if self.store is None:
            raise ApiError(400, "adapters: no adapter store is configured (adapters.store)")
        if not replace:
            await self._call(self.registry.check_new, tenant, name, self.base_names)
        base, limits = await self.shape()
        store = self.store
        try:  # the whole adapter, weights included: nothing half-checked is ever kept
            checked = await asyncio.to_thread(
                lambda: check_adapter(store.folder(source), base, limits)
            )
            adapter = await asyncio.to_thread(checked.read)
        except AdapterError as exc:
            raise ApiError(400, str(exc), exc.field) from exc
        except StoreUnavailable as exc:
            raise ApiError(503, str(exc), retry_after=2) from exc
        record = AdapterRecord(
            name=name,
            source=source,
            rank=adapter.rank,
            target_modules=list(adapter.targets),
            bytes=(checked.folder / WEIGHTS).stat().st_size,
        )
        if replace:
            await _forget(self, tenant, name)
        await self._call(self.registry.add, tenant, record, self.base_names)
        return record

    async def delete(self, tenant: str, name: str) -> None:
        await self._call(self.registry.delete, tenant, name)

    async def get(self, tenant: str, name: str) -> AdapterRecord:
        record: AdapterRecord = await self._call(self.registry.get, tenant, name)
        return record


def _not_found(model: str, base: str) -> ApiError:
    message = f"model: {model[:100]!r} does not exist; this server serves {base!r} and its adapters"
    return ApiError(404, message, "model", code="model_not_found")


# -- the routes (`Ingress` binds them; `gate` is its deployments/gate.py) ------------------------


async def register(gate: Gate, adapters: Adapters, request: Any) -> JSONResponse:
    async with gate.metered(request) as tenant:
        body = await gate.body(request, AdapterRegistration)
        record = await adapters.register(tenant, body.name, body.source)
    return JSONResponse(record.view(), status_code=201)


async def listed(gate: Gate, adapters: Adapters, request: Any, name: str | None) -> JSONResponse:
    async with gate.metered(request) as tenant:
        if name is not None:
            return JSONResponse((await adapters.get(tenant, name)).view())
        records = await adapters.models(tenant)
    return JSONResponse({"object": "list", "data": [r.view() for r in records]})


async def delete(gate: Gate, adapters: Adapters, request: Any, name: str) -> JSONResponse:
    async with gate.metered(request) as tenant:
        await adapters.delete(tenant, name)
    return JSONResponse({"id": name, "object": "adapter", "deleted": True})


async def load_lora(gate: Gate, adapters: Adapters, request: Any) -> PlainTextResponse:
    """vLLM's route: the same registration, answered as vLLM answers."""
    async with gate.metered(request) as tenant:
        body = await gate.body(request, LoadLoRAAdapter)
        try:
            await adapters.register(tenant, body.lora_name, body.lora_path, body.load_inplace)
        except ApiError as exc:  # named as this body names it
            renamed = {"source": "lora_path", "name": "lora_name"}
            exc.param = renamed.get(exc.param or "", exc.param)
            raise
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora(gate: Gate, adapters: Adapters, request: Any) -> PlainTextResponse:
    async with gate.metered(request) as tenant:
        body = await gate.body(request, UnloadLoRAAdapter)
        await adapters.delete(tenant, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _forget(adapters: Adapters, tenant: str, name: str) -> None:
    try:
        await adapters.delete(tenant, name)
    except ApiError as exc:
        if exc.status != 404:
            raise
