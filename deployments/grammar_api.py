"""The grammar registration API: its body, its answers and its routes' handlers (`Ingress`
binds them to the paths)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from deployments.answers import ApiError
from deployments.observe import RequestObs, observe
from deployments.protocol import BadRequest, ResponseFormat, StructuredOutputs
from deployments.translate import structured_from

if TYPE_CHECKING:
    from deployments.gate import Gate


class GrammarRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    fidelity: str = Field(default="warn", pattern="^(warn|strict)$")


def raise_for(out: Any) -> None:
    """The grammar service's error answer as an HTTP error; a busy compile service is worth a
    retry, a full registrations cap is not until the tenant deletes some."""
    if not (isinstance(out, dict) and "error" in out):
        return
    status, reason = int(out["status"]), out.get("reason")
    if status == 429 and reason == "registration":
        raise ApiError(429, out["error"], reason="registrations_cap")
    if status == 429:
        raise ApiError(429, out["error"], retry_after=2, reason="grammar_busy")
    raise ApiError(status, out["error"])


def grammar_view(reg: dict[str, Any], spec: bool = False) -> dict[str, Any]:
    view = {
        "id": reg["grammar_id"],
        "object": "grammar",
        "name": reg["name"],
        "kind": reg["spec"]["kind"],
        "created": int(reg["created"]),
        "bytes": reg["bytes"],
        "compile_seconds": reg["compile_s"],
        "fidelity": {"loosened": reg["warnings"]},
    }
    if spec:
        view["spec"] = reg["spec"]
    return view


# -- the routes (`Ingress` binds them; `gate` is its deployments/gate.py) ------------------------


async def register(gate: Gate, grammar: Any, request: Any) -> JSONResponse:
    obs = observe("grammars", request.headers)
    try:
        response = await _register(gate, grammar, request, obs)
    except BaseException as err:
        obs.finish(err.status if isinstance(err, ApiError) else 499, err)
        raise
    obs.finish(201)
    return response


async def _register(gate: Gate, grammar: Any, request: Any, obs: RequestObs) -> JSONResponse:
    tenant = obs.tenant = await gate.tenant(request)
    start = time.perf_counter()
    lease = await gate.admit(tenant)  # a registration is a compile: it counts like a request
    try:
        body = await gate.body(request, GrammarRegistration)
        try:
            structured = structured_from(body)
        except BadRequest as exc:
            raise ApiError(400, str(exc), exc.param) from exc
        if structured is None or structured.grammar_id is not None:
            raise ApiError(400, "give the grammar in structured_outputs or response_format")
        structured = replace(structured, fidelity=body.fidelity)
        out = await grammar.register.remote(tenant, body.name, structured)
        await gate.tenants.release(lease)
    finally:
        gate.tenants.release(lease)  # any other end (idempotent)
    raise_for(out)
    return JSONResponse(
        {
            "id": out["grammar_id"],
            "object": "grammar",
            "name": out["name"],
            "status": "ready",
            "compile_seconds": out["compile_s"],
            "registration_seconds": time.perf_counter() - start,
            "fidelity": {"loosened": out["warnings"]},
        },
        status_code=201,
    )


async def listed(
    gate: Gate, grammar: Any, request: Any, grammar_id: str | None = None
) -> JSONResponse:
    """The tenant's registrations, or one of them with its spec."""
    async with gate.metered(request) as tenant:
        out = await grammar.registrations.remote(tenant, grammar_id)
    raise_for(out)
    if grammar_id is not None:
        return JSONResponse(grammar_view(out, spec=True))
    return JSONResponse({"object": "list", "data": [grammar_view(r) for r in out]})


async def delete(gate: Gate, grammar: Any, request: Any, grammar_id: str) -> JSONResponse:
    async with gate.metered(request) as tenant:
        out = await grammar.delete.remote(tenant, grammar_id)
    raise_for(out)
    return JSONResponse({"id": grammar_id, "object": "grammar", "deleted": True})
