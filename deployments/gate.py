"""What every route of the ingress passes before its work: the tenant from its key, the tenant's
limits, the body (bounded in bytes, time and shape), the model's name and the prompt's size.

Every route that costs CPU (completions, grammars, `/tokenize`, `/detokenize`) holds one of the
tenant's concurrency slots and a rate token for as long as it runs (`metered`), so no route is a
way around a tenant's limits.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from pydantic import BaseModel

from deployments.answers import ApiError
from deployments.edge import BodyLimits, read_body, refuse_control_headers
from deployments.quota import Lease, LimitError
from deployments.service_config import ServiceConfig
from deployments.tenants import AuthError, AuthUnavailable, NeverFits, Tenants


class Gate:
    def __init__(self, config: ServiceConfig, tenants: Tenants, llm: Any) -> None:
        self.config = config
        self.tenants = tenants
        self.llm = llm
        ing = config.ingress
        self.body_limits = BodyLimits(
            ing.max_body_bytes,
            ing.body_timeout_s,
            ing.max_json_depth,
            ing.max_json_values,
            ing.max_messages,
        )
        self._prompt_chars: int | None = None  # the replicas' max_prompt_chars, asked once

    async def tenant(self, request: Any) -> str:
        refuse_control_headers(request.headers)
        try:
            return await self.tenants.authenticate(request.headers.get("authorization"))
        except AuthUnavailable as exc:  # the key may be valid: say so, and when to try again
            raise ApiError(503, str(exc), retry_after=exc.retry_after) from exc
        except AuthError as exc:
            raise ApiError(401, str(exc)) from exc

    async def admit(
        self, tenant: str, lease: Lease | None = None, more: int = 0, tokens_only: bool = False
    ) -> Lease:
        """A new lease (one slot and a rate token; `tokens_only`: neither, a batch line's), or
        `more` slots on `lease`."""
        try:
            if lease is None:
                return await self.tenants.admit(tenant, tokens_only=tokens_only)
            await self.tenants.grow(lease, more)
            return lease
        except NeverFits as exc:  # no retry can help: a 400, not a 429
            raise ApiError(400, str(exc), "n") from exc
        except LimitError as exc:
            raise ApiError(429, str(exc), retry_after=exc.retry_after, reason=exc.reason) from exc

    @asynccontextmanager
    async def metered(self, request: Any) -> AsyncIterator[str]:
        """The tenant, holding a slot and a rate token until the block ends."""
        tenant = await self.tenant(request)
        lease = await self.admit(tenant)
        try:
            yield tenant
            await self.tenants.release(lease)  # before answering: the next request finds it
        finally:
            self.tenants.release(lease)  # any other end (idempotent)

    async def body(self, request: Any, model: type[BaseModel]) -> Any:
        return await read_body(request, model, self.body_limits)

    def check_model(self, model: str) -> None:
        names = (self.config.served_model_name, *self.config.model_aliases)
        if model not in names:
            raise ApiError(
                404,
                f"model: {model[:100]!r} does not exist; this server serves {names[0]!r}",
                "model",
                code="model_not_found",
            )

    async def check_prompt(
        self, prompt: Any = None, messages: list[dict[str, Any]] | None = None
    ) -> None:
        """400 for a prompt over the replicas' `max_prompt_chars`, counted as they count it,
        before it crosses to one."""
        if self._prompt_chars is None:
            try:
                limits = await self.llm.limits.remote()
            except Exception as exc:  # no replica to ask: none to send the prompt to either
                message = "the model replica is unavailable; try again"
                raise ApiError(503, message, retry_after=1) from exc
            self._prompt_chars = int(limits["max_prompt_chars"])
        cap = self._prompt_chars
        if messages is not None:
            field, chars = "messages", sum(len(json.dumps(m)) for m in messages)
        elif isinstance(prompt, str):
            field, chars = "prompt", len(prompt)
        else:
            return
        if chars > cap:
            message = f"{field}: {chars} characters exceed the limit of {cap} (max_prompt_chars)"
            raise ApiError(400, message, field)
