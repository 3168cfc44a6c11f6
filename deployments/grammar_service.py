"""`GrammarService`: hosts the compile service (worker processes, limits, verdict cache, tenant
registrations). Replicas ask it for verdicts; the ingress for registrations.

Methods return plain values or `{"error": ..., "status": ...}` dicts rather than raising, so a
refusal crosses the deployment handle with its status intact. A verdict call carries the caller's
trace context (`trace`) and answers inside a `structserve.grammar.verdict` span.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from opentelemetry.trace import Status, StatusCode
from pydantic import SecretStr

from deployments.service_config import ServiceConfig
from deployments.telemetry_hub import setup
from grammar_registry.cache import Verdict
from grammar_registry.family import MAX_PATH_CHARS
from grammar_registry.registrations import RegistrationError
from grammar_registry.specs import GrammarSpec
from services import settings, telemetry
from services.compiler import CompilerConfig, CompileService
from services.compiler.service import CompileSettings
from services.grammar.backend import GrammarError
from services.grammar.backends import from_folder
from services.grammar.canonical import to_spec
from services.grammar.structured import StructuredOutput
from services.grammar.xgrammar_backend import XGrammarBackend
from services.models import resolve_model_dir
from services.telemetry import spans

log = logging.getLogger(__name__)

REMOTE_TIMEOUT_S = 180.0  # above queue wait + deadline of a compile, below a client's patience


def redis_client(url: str | None) -> Any | None:
    """A client for `url` (else `REDIS_URL`), with short timeouts: a dead Redis must cost little."""
    url = url or settings.redis_url()
    if not url:
        return None
    import redis

    return redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)


def grammar_backend(config: ServiceConfig) -> XGrammarBackend:
    """The served model's xgrammar backend, built as the engine builds it (`for_model`), from
    the tokenizer and configs only (no weights)."""
    _, folder = resolve_model_dir(config.model)
    return from_folder(str(folder)).xgrammar


class GrammarService:
    def __init__(self, config: dict[str, Any], hub: Any | None = None) -> None:
        cfg = ServiceConfig.model_validate(config)
        self.tel = setup(cfg, "GrammarService", hub)
        g = cfg.grammar
        compiler = CompilerConfig(
            **{name: getattr(g, name) for name in CompileSettings.model_fields},
            # one tenant never holds every worker: the others always have one to compile on
            max_inflight_per_tenant=max(1, g.workers // 2),
            verdict_secret=SecretStr(secret) if (secret := settings.verdict_secret()) else None,
        )
        backend = grammar_backend(cfg)
        self.service = CompileService(
            backend.tokenizer_info, compiler, redis=redis_client(cfg.redis_url)
        )
        self.service.pool  # noqa: B018 (start the workers now, not on the first request)

    async def verdict(
        self, spec_json: str, tenant: str, scope: str, fresh: bool, trace: Any = None
    ) -> Verdict:
        spec = GrammarSpec.model_validate_json(spec_json)
        attrs = {spans.GRAMMAR_KIND: spec.kind, spans.TENANT: tenant}
        span = self.tel.tracer.start_span(
            spans.GRAMMAR_VERDICT, self.tel.extract(trace), attributes=attrs
        )
        verdict: Verdict | None = None
        try:
            verdict = await asyncio.to_thread(self.service.verdict, spec, tenant, scope, fresh)
            return verdict
        finally:
            _end_verdict_span(span, verdict)

    async def downgrade(
        self, spec_json: str, tenant: str, scope: str, reason: str, error: str, path: str = ""
    ) -> None:
        """A replica saw the grammar's masks run over budget while decoding (`path`: the output
        that reached the slow mask)."""
        spec = GrammarSpec.model_validate_json(spec_json)
        down = self.service.downgrade
        await asyncio.to_thread(down, spec, tenant, scope, reason, error, path[:MAX_PATH_CHARS])

    async def resolve(self, tenant: str, grammar_id: str) -> dict[str, Any]:
        try:
            spec = await asyncio.to_thread(self.service.resolve, tenant, grammar_id)
        except GrammarError as exc:
            return {"error": str(exc), "status": exc.status, "reason": exc.reason}
        return {"spec": spec.model_dump_json()}

    async def register(
        self, tenant: str, name: str, structured: StructuredOutput
    ) -> dict[str, Any]:
        try:
            spec = to_spec(structured)
            reg = await asyncio.to_thread(
                self.service.register, tenant, name, spec, structured.fidelity
            )
        except GrammarError as exc:
            return {"error": str(exc), "status": exc.status, "reason": exc.reason}
        except (ValueError, RecursionError) as exc:
            return {"error": f"structured: {exc}"[:300], "status": 400, "reason": "invalid"}
        return reg.model_dump(mode="json")

    async def registrations(self, tenant: str, grammar_id: str | None = None) -> Any:
        store = self.service.registrations
        try:
            if grammar_id is None:
                regs = await asyncio.to_thread(store.list, tenant)
                return [r.model_dump(mode="json") for r in regs]
            reg = await asyncio.to_thread(store.get, tenant, grammar_id)
            return reg.model_dump(mode="json")
        except RegistrationError as exc:
            return {"error": str(exc), "status": exc.status}

    async def delete(self, tenant: str, grammar_id: str) -> dict[str, Any]:
        try:
            await asyncio.to_thread(self.service.registrations.delete, tenant, grammar_id)
        except RegistrationError as exc:
            return {"error": str(exc), "status": exc.status}
        return {"id": grammar_id, "deleted": True}

    async def health(self) -> dict[str, Any]:
        client = self.service.verdicts.client
        redis_ok: bool | None = None
        if client is not None:
            try:
                redis_ok = bool(await asyncio.to_thread(client.ping))
            except Exception:
                redis_ok = False
        return {"workers": self.service.pool.size, "redis": redis_ok}

    def __del__(self) -> None:
        if (service := getattr(self, "service", None)) is not None:  # it may not have started
            service.close()


def _end_verdict_span(span: Any, verdict: Verdict | None) -> None:
    try:
        if verdict is None:
            span.set_status(Status(StatusCode.ERROR, "the verdict call failed"))
        else:
            span.set_attribute(spans.CACHE_LEVEL, verdict.source)
            span.set_attribute(spans.GRAMMAR_OUTCOME, "ok" if verdict.ok else verdict.reason)
            span.set_attribute(spans.GRAMMAR_BACKEND, verdict.backend)
            span.set_attribute(spans.COMPILE_SECONDS, verdict.compile_s)
        span.end()
    except Exception:  # telemetry never fails a verdict
        log.debug("telemetry: ending a verdict span failed", exc_info=True)


class RemoteVerdicts:
    """The replica's view of `GrammarService`: a `VerdictSource` over a deployment handle.

    Called from the provider's resolver threads, never from the replica's event loop.
    """

    def __init__(self, handle: Any, tokenizer_info: Any | None = None) -> None:
        """Without `tokenizer_info` it answers an engine core's calls (core_client.py), which
        computes keys itself."""
        from services.compiler.service import GrammarKeys

        self.handle = handle
        self.keys = GrammarKeys(tokenizer_info) if tokenizer_info is not None else None

    def key(self, spec: GrammarSpec, scope: str = "shared") -> str:
        assert self.keys is not None, "made without the tokenizer's info"
        return self.keys.key(spec, scope)

    def verdict(
        self, spec: GrammarSpec, tenant: str = "default", scope: str = "shared", fresh: bool = False
    ) -> Verdict:
        carrier = telemetry.get().inject()  # the replica's grammar span: the service's parent
        call = self.handle.verdict.remote(spec.model_dump_json(), tenant, scope, fresh, carrier)
        result: Verdict = call.result(timeout_s=REMOTE_TIMEOUT_S)
        return result

    def downgrade(
        self, spec: GrammarSpec, tenant: str, scope: str, reason: str, error: str, path: str = ""
    ) -> None:
        args = (spec.model_dump_json(), tenant, scope, reason, error, path)
        self.handle.downgrade.remote(*args).result(timeout_s=REMOTE_TIMEOUT_S)

    def resolve(self, tenant: str, grammar_id: str) -> GrammarSpec:
        out = self.handle.resolve.remote(tenant, grammar_id).result(timeout_s=REMOTE_TIMEOUT_S)
        if "error" in out:
            raise GrammarError(out["error"], reason=out["reason"], status=out["status"])
        return GrammarSpec.model_validate_json(out["spec"])

    def close(self) -> None:
        pass
