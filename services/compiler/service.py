"""The compile service: every caller-supplied grammar passes static limits, then the Redis verdict
cache, then one compile in a killable worker process with a mask-time probe.

`CompileService.verdict()` is what the grammar deployment serves; `ServiceGrammarProvider`
(provider.py) turns verdicts into compiled grammars inside an engine. Tenant registrations live here
too, because registering a grammar is compiling it under the tenant's own cache scope.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from importlib.metadata import version
from typing import Any

import xgrammar as xgr
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from grammar_registry.cache import LRUBytes, RedisVerdicts, Verdict
from grammar_registry.family import Family
from grammar_registry.limits import GrammarLimits, LimitExceeded, check_limits
from grammar_registry.registrations import (
    Registration,
    RegistrationCaps,
    RegistrationError,
    RegistrationStore,
)
from grammar_registry.specs import GrammarSpec, grammar_key
from services import telemetry
from services.compiler.family_records import FamilyRecords
from services.compiler.probe import PROBE_STEPS
from services.grammar.backend import MASK_BUDGET_MS, GrammarError
from services.grammar.xgrammar_backend import fidelity_error
from services.sandbox import WorkerPool

log = logging.getLogger(__name__)

# How each refusal reaches a client: bad input is 400, input that is valid but too costly to serve
# is 422, a full queue is 429 (try later).
STATUS = {
    "invalid": 400,
    "limit": 400,
    "fidelity": 400,
    "timeout": 422,
    "slow_mask": 422,
    "memory": 422,
    "crash": 422,
    "busy": 429,
    "unavailable": 503,
}
_NOT_CACHED = ("busy", "unavailable")  # about the service's state, not the grammar
# Refusals that depend on how loaded the machine was: cached for the tenant that met them only,
# so one tenant saturating the workers cannot poison a grammar for everyone.
LOAD_DEPENDENT = ("timeout", "slow_mask", "memory", "crash")


class CompileSettings(BaseModel):
    """What an operator sets of the compile service, defined here once: `ServiceConfig.grammar`
    takes these fields as they are, and the GrammarService hands them on."""

    model_config = ConfigDict(extra="forbid")

    workers: int = Field(default=2, ge=1)
    deadline_s: float = Field(default=10.0, gt=0)
    # probe medians above it are refused; the LLM replicas' masks are held to it while decoding
    mask_budget_ms: float = Field(default=MASK_BUDGET_MS, gt=0)
    limits: GrammarLimits = GrammarLimits()
    caps: RegistrationCaps = RegistrationCaps()


class CompilerConfig(CompileSettings):
    model_config = ConfigDict(frozen=True, extra="forbid")

    queue_wait_s: float = Field(default=30.0, ge=0)  # for a free worker, before "busy"
    worker_memory_bytes: int = Field(default=4 << 30, ge=0)  # RLIMIT_AS per worker; 0: none
    probe_steps: int = Field(default=PROBE_STEPS, ge=1)
    max_inflight: int = Field(default=16, ge=1)
    max_inflight_per_tenant: int = Field(default=4, ge=1)
    # Store the blob only when loading it is clearly faster than compiling it again.
    blob_gain: float = Field(default=0.8, gt=0)
    # A compile faster than this is never shipped as a blob: serializing and loading a compiled
    # grammar of a whole vocabulary costs more than such a compile does, so the worker would
    # spend most of its time on a blob nobody keeps (benchmarks/grammar_cache.py measures both).
    blob_min_compile_s: float = Field(default=0.1, ge=0)
    fetch_overhead_s: float = Field(default=0.002, ge=0)
    fetch_bytes_per_s: float = Field(default=200e6, gt=0)
    redis_ttl_s: int = Field(default=7 * 24 * 3600, ge=1)
    failure_ttl_s: int = Field(default=600, ge=1)
    max_entry_bytes: int = Field(default=64 << 20, ge=1)
    # keys the Redis entries' HMAC (the chart generates it); required with Redis, the same in
    # every process sharing it. A JSON dump shows "**********", never the secret.
    verdict_secret: SecretStr | None = Field(default=None, min_length=16)
    recent_verdict_bytes: int = Field(default=256 << 20, ge=0)


class GrammarKeys:
    """Cache keys for one tokenizer and this xgrammar build (replicas compute them locally)."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo) -> None:
        self.fingerprint = hashlib.sha256(tokenizer_info.serialize_json().encode()).hexdigest()
        self.backend_version = "xgrammar-" + version("xgrammar")
        self.serialization = xgr.get_serialization_version()

    def key(self, spec: GrammarSpec, scope: str = "shared") -> str:
        return grammar_key(
            spec,
            backend_version=self.backend_version,
            serialization=self.serialization,
            tokenizer=self.fingerprint,
            scope=scope,
        )

    def family_key(self, kind: str, family: Family, scope: str, tenant: str) -> str:
        """Where a tenant's record of a family's slow members is kept (its own, like every
        refusal the load could cause)."""
        parts = (self.backend_version, self.fingerprint[:16], scope, kind, family.key)
        return "structserve:family:" + ":".join(parts) + f":tenant:{tenant}"


class CompileService:
    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        config: CompilerConfig | None = None,
        redis: Any | None = None,
        pool: WorkerPool | None = None,
    ) -> None:
        self.config = config = config or CompilerConfig()
        self.tokenizer_info = tokenizer_info
        self.keys = GrammarKeys(tokenizer_info)
        # Recent verdicts in this process: serves without Redis, and saves a round trip with it.
        self.recent = LRUBytes(config.recent_verdict_bytes)
        self._pool = pool
        secret = config.verdict_secret
        self.verdicts = RedisVerdicts(
            redis,
            config.redis_ttl_s,
            config.failure_ttl_s,
            config.max_entry_bytes,
            secret=secret.get_secret_value().encode() if secret else None,
        )
        self.registrations = RegistrationStore(redis, config.caps)
        self.families = FamilyRecords(self.keys.family_key, self._cached, self._store)
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[Verdict]] = {}
        self._per_tenant: dict[str, int] = {}
        self.compiles = 0  # jobs sent to the pool: what single flight saves

    @property
    def pool(self) -> WorkerPool:
        # Started on the first compile: a replica that only reads verdicts never spawns workers.
        with self._lock:
            if self._pool is None:
                cfg = self.config
                info = self.tokenizer_info.serialize_json()
                setup = {"tokenizer_json": info}
                self._pool = WorkerPool("compile", setup, cfg.workers, cfg.worker_memory_bytes)
            return self._pool

    def key(self, spec: GrammarSpec, scope: str = "shared") -> str:
        return self.keys.key(spec, scope)

    # -- verdicts ---------------------------------------------------------------------------

    def verdict(
        self, spec: GrammarSpec, tenant: str = "default", scope: str = "shared", fresh: bool = False
    ) -> Verdict:
        """The grammar's verdict (refusals included); `fresh` skips the Redis entry (a blob that
        would not load) and replaces it. `Verdict.source` says which level answered."""
        try:
            check_limits(spec, self.config.limits)
        except LimitExceeded as exc:
            return _answered(Verdict(ok=False, reason="limit", error=str(exc)), "rejected")
        key = self.key(spec, scope)
        mine = f"{key}:tenant:{tenant}"
        if not fresh:
            # A downgrade the tenant's decoding showed overrides a shared "ok"; a compile that
            # crashed or ran out of time under load is the tenant's answer only until someone's
            # compile of it has a verdict of its own.
            for k in (_downgraded(key, tenant), key, mine):
                found = self._cached(k)
                if found is not None:
                    return found
        refused, hints = self.families.judge(spec, scope, tenant)
        if refused is not None:  # a near-duplicate of a grammar its decoding showed slow
            return _answered(refused, "rejected")
        for _ in range(2):  # a joiner of a compile that crashed compiles on its own, once
            verdict, joined = self._single_flight(spec, tenant, key, mine, hints)
            if not (joined and verdict.reason in LOAD_DEPENDENT):
                break
        if verdict.reason == "slow_mask" and verdict.source == "compiled":
            path = verdict.slow[0].get("path", "") if verdict.slow else ""
            self.families.add(spec, scope, tenant, path)
        return verdict

    def _cached(self, key: str) -> Verdict | None:
        level, cached = "recent", self.recent.get(key)
        if cached is None:
            level, cached = "redis", self.verdicts.get(key)
        if cached is None:
            return None
        self._remember(key, cached)
        return _answered(cached, level)

    def _single_flight(
        self, spec: GrammarSpec, tenant: str, key: str, mine: str, hints: list[str]
    ) -> tuple[Verdict, bool]:
        """The verdict of one compile of `key`: ours, or (joined: True) that of the caller
        compiling it now."""
        with self._lock:
            running = self._inflight.get(key)
            if running is None:
                busy = self._over_capacity(tenant)
                if busy:
                    return Verdict(ok=False, reason="busy", error=busy), False
                running = self._inflight[key] = Future()
                self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
                owner = True
            else:
                owner = False
        if not owner:  # the same grammar is compiling for another caller: its answer
            shared = running.result()
            return (shared if shared.reason in _NOT_CACHED else _answered(shared, "compiled")), True
        try:
            verdict, judged = self._compile(spec, tenant, hints), True
            if verdict.reason in ("crash", "timeout"):  # maybe the load, not the grammar: again
                # (on the worker that replaces the one killed, once it is up: it was this
                # tenant's restart, so it waits for it rather than taking the reserve)
                again = self._compile(spec, tenant, hints)
                if again.reason in _NOT_CACHED:  # no second try: the answer, but not a verdict
                    judged = False
                else:
                    verdict = again
            if judged and verdict.reason not in _NOT_CACHED:
                where = mine if verdict.reason in LOAD_DEPENDENT else key
                self.verdicts.put(where, verdict)
                self._remember(where, verdict)
            running.set_result(verdict)
            return (
                verdict if verdict.reason in _NOT_CACHED else _answered(verdict, "compiled")
            ), False
        except BaseException as exc:
            running.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._inflight[key]
                self._per_tenant[tenant] -= 1

    def downgrade(
        self, spec: GrammarSpec, tenant: str, scope: str, reason: str, error: str, path: str = ""
    ) -> None:
        """Replaces the tenant's verdict with a refusal that decoding showed (masks over the
        budget): kept for the tenant that met it only, like every load-dependent refusal.
        `path`: the output that reached the slow mask, which its family's probes replay."""
        mine = _downgraded(self.key(spec, scope), tenant)
        verdict = Verdict(ok=False, reason=reason, error=error)
        self.verdicts.put(mine, verdict)
        self._remember(mine, verdict)
        if reason == "slow_mask":
            self.families.add(spec, scope, tenant, path)

    def _store(self, key: str, verdict: Verdict) -> None:
        self.verdicts.put(key, verdict)
        self._remember(key, verdict)

    def _remember(self, key: str, verdict: Verdict) -> None:
        self.recent.put(key, verdict, len(verdict.blob or b"") + 1024)

    def _over_capacity(self, tenant: str) -> str:
        cfg = self.config
        if len(self._inflight) >= cfg.max_inflight:
            return f"{cfg.max_inflight} grammars are compiling; try later"
        # A worker restart the tenant's compile caused (past the deadline, or a crash) counts as
        # one of its compiles until the replacement is up: the tenant pays for it, not the others.
        restarts = self._pool.restarting(tenant) if self._pool is not None else 0
        cap = cfg.max_inflight_per_tenant
        if self._per_tenant.get(tenant, 0) + restarts >= cap:
            if restarts:
                return (
                    f"the tenant has {cap} grammars compiling, counting {restarts} compile "
                    "workers restarting after its compiles ran out of time or crashed; try later"
                )
            return f"the tenant has {cap} grammars compiling; try later"
        return ""

    def _compile(self, spec: GrammarSpec, tenant: str, hints: list[str]) -> Verdict:
        cfg = self.config
        self.compiles += 1
        job = {
            "spec": spec.model_dump_json(),
            "mask_budget_ms": cfg.mask_budget_ms,
            "probe_steps": cfg.probe_steps,
            "hints": hints,
            "blob_min_compile_s": cfg.blob_min_compile_s,
            "seed": 0,
        }
        start = time.perf_counter()
        out = self.pool.run(job, cfg.deadline_s, cfg.queue_wait_s, tenant)
        if out.get("reason") not in ("busy", "unavailable"):  # then no compile ran
            seconds = out.get("compile_s") or time.perf_counter() - start
            outcome = "ok" if out["ok"] else out["reason"]
            labels = {"kind": spec.kind, "outcome": outcome, "where": "worker"}
            telemetry.get().metrics.grammar_compile.record(seconds, labels)
        if not out["ok"]:
            slow_path = out.get("slow_path")
            return Verdict(
                ok=False,
                reason=out["reason"],
                error=out["error"],
                compile_s=out.get("compile_s", 0.0),
                mask_ms=out.get("mask_ms", 0.0),
                slow=[{"path": slow_path}] if slow_path else [],
            )
        blob: bytes | None = out.get("blob")  # None: the compile was too quick to ship
        # Loading also pays for moving the blob out of Redis and a fixed round trip: a blob is
        # kept only when all of that still beats compiling by a margin.
        size = len(blob) if blob is not None else 0
        fetch_s = cfg.fetch_overhead_s + size / cfg.fetch_bytes_per_s
        keep = blob is not None and out["load_s"] + fetch_s < cfg.blob_gain * out["compile_s"]
        return Verdict(
            ok=True,
            warnings=out["warnings"],
            compile_s=out["compile_s"],
            load_s=out.get("load_s", 0.0),
            mask_ms=out["mask_ms"],
            blob_bytes=size,
            blob=blob if keep else None,  # None: "compile locally" is faster
        )

    # -- registrations ----------------------------------------------------------------------

    def register(
        self, tenant: str, name: str, spec: GrammarSpec, fidelity: str = "warn"
    ) -> Registration:
        """Compiles under the tenant's own scope, then stores; refusals raise `GrammarError`."""
        verdict = self.verdict(spec, tenant, scope=tenant)
        raise_for(verdict, spec.kind)
        if verdict.warnings and fidelity == "strict":
            raise fidelity_error(verdict.warnings)
        try:
            return self.registrations.add(
                tenant, name, spec, compile_s=verdict.compile_s, warnings=verdict.warnings
            )
        except RegistrationError as exc:
            raise GrammarError(str(exc), reason="registration", status=exc.status) from exc

    def resolve(self, tenant: str, grammar_id: str) -> GrammarSpec:
        """The spec a tenant registered; another tenant's id is "not found", like a missing one."""
        try:
            return self.registrations.get(tenant, grammar_id).spec
        except RegistrationError as exc:
            reason = "not_found" if exc.status == 404 else "unavailable"
            raise GrammarError(
                f"structured.grammar_id: {exc}", reason=reason, status=exc.status
            ) from exc

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


def _downgraded(key: str, tenant: str) -> str:
    """Where a tenant's downgrade (a refusal its decoding showed) is kept."""
    return f"{key}:tenant:{tenant}:downgraded"


def _answered(verdict: Verdict, level: str) -> Verdict:
    """The verdict, marked and counted at the level that answered it (a copy: cached verdicts
    are shared between callers)."""
    telemetry.get().metrics.grammar_cache.add(1, {"level": level})
    return replace(verdict, source=level)


def refusal(verdict: Verdict, kind: str) -> GrammarError:
    """What a caller gets for a refused grammar."""
    return GrammarError(
        f"structured.{kind}: {verdict.error}",
        reason=verdict.reason,
        status=STATUS.get(verdict.reason, 400),
    )


def raise_for(verdict: Verdict, kind: str) -> None:
    if not verdict.ok:
        raise refusal(verdict, kind)
