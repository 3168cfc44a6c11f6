"""The model routes beside completions (`Ingress` binds them): `/v1/models`, vLLM's
`/tokenize` and `/detokenize`, and the health check."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi.responses import JSONResponse

from deployments.answers import ApiError
from deployments.grammar_api import raise_for
from deployments.protocol import DetokenizeRequest, TokenizeRequest, template_options

log = logging.getLogger(__name__)


async def models(ingress: Any, request: Any) -> JSONResponse:
    """The base model, its aliases, and the adapters this tenant may name (its own and the
    operator's), each with the base as `parent` (vLLM's listing)."""
    tenant = await ingress.gate.tenant(request)
    config = ingress.config
    names = (config.served_model_name, *config.model_aliases)
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "structserve"} for n in names]
    for a in await ingress.adapters.models(tenant):
        owner = "structserve" if a.operator else tenant
        entry = {"id": a.name, "object": "model", "created": int(a.created), "owned_by": owner}
        data.append({**entry, "parent": names[0]})
    return JSONResponse({"object": "list", "data": data})


async def tokenize(ingress: Any, request: Any) -> JSONResponse:
    """vLLM's /tokenize: the token ids a prompt (or templated messages) becomes."""
    gate = ingress.gate
    async with gate.metered(request) as tenant:
        body = await gate.body(request, TokenizeRequest)
        gate.check_model(body.model)
        messages = template = None
        try:
            if body.messages is not None:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                template = template_options(body)
        except ValueError as exc:
            raise ApiError(400, str(exc), str(exc).split(":")[0]) from exc
        await gate.check_prompt(body.prompt, messages)
        out = await ingress.llm.tokenize.remote(body.prompt, messages, template, tenant)
    raise_for(out)
    return JSONResponse(out)


async def detokenize(ingress: Any, request: Any) -> JSONResponse:
    async with ingress.gate.metered(request):
        body = await ingress.gate.body(request, DetokenizeRequest)
        ingress.gate.check_model(body.model)
        out = await ingress.llm.detokenize.remote(body.tokens)
    raise_for(out)
    return JSONResponse(out)


async def health(ingress: Any) -> JSONResponse:
    try:
        grammar = await asyncio.wait_for(ingress.grammar.health.remote(), timeout=5)
        llm = await asyncio.wait_for(ingress.llm.check_health.remote(), timeout=5)
    except Exception as exc:  # its text names actors and addresses: for the log only
        log.warning("health check failed: %s", exc)
        return JSONResponse({"status": "unhealthy"}, status_code=503)
    if (llm or {}).get("engine", "ready") != "ready":  # its core starting again after a crash
        return JSONResponse({"status": llm["engine"]}, status_code=503)
    status = "ok" if grammar["redis"] is not False else "degraded"
    return JSONResponse({"status": status, "redis": grammar["redis"]})
