"""The service's one configuration: every deployment option, validated at start-up.

The Helm chart's values mirror these fields (`serveConfigV2.applications[0].args`), the CLI builds
one from its flags, and `deployments.app:build_app` takes its dict form. Unknown keys are errors.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from services.batches.files import FileCaps
from services.batches.jobs import BatchCaps
from services.compiler.service import CompileSettings
from services.dialects import check
from services.engine.config import EngineConfig
from services.grammar.backend import MASK_BUDGET_MS
from services.lora.registry import ADAPTER_NAME, AdapterCaps


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Backpressure(_Strict):
    """Ray Serve's admission: requests beyond these are answered 429 with `Retry-After`."""

    num_replicas: int = Field(default=1, ge=1)
    max_ongoing_requests: int = Field(default=64, ge=1)
    max_queued_requests: int = Field(default=128, ge=0)
    num_cpus: float = Field(default=0.0, ge=0)


class IngressConfig(Backpressure):
    port: int = Field(default=8000, ge=1, le=65535)
    host: str = "127.0.0.1"
    # "own": the ingress replicas answer HTTP on host:port themselves (deployments/listener.py:
    # one process hop less per chunk); "proxy": Ray Serve's proxy does (the plain twin, and the
    # Helm chart's way: KubeRay's Service targets the proxy). One application per own port.
    listener: Literal["own", "proxy"] = "own"
    max_body_bytes: int = Field(default=4 << 20, ge=1024)
    # a body still arriving after this is a 408: a slow sender holds one of its tenant's slots
    # (taken before the body is read) for this long at most
    body_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    # a body's shape, checked before it is validated (deployments/edge.py: a 400 naming it)
    max_json_depth: int = Field(default=128, ge=8, le=1000)
    max_json_values: int = Field(default=1 << 18, ge=1024)
    max_messages: int = Field(default=2048, ge=1)


class RoutingConfig(_Strict):
    """How the ingress picks an LLM replica (deployments/routing.py). `prefix_affinity`: requests
    with the same tenant, salt and start go to the replica caching that start, unless it is over
    `max_load_gap` requests busier than the least busy; `power_of_two`: Ray's default."""

    policy: Literal["prefix_affinity", "power_of_two"] = "prefix_affinity"
    prefix_chars: int = Field(default=2048, ge=1)  # a completion prompt's start that is keyed
    max_load_gap: int = Field(default=8, ge=0)


class LLMConfig(Backpressure):
    # well above the engine's max_num_seqs: requests then wait in the engine's fair queue
    # (weighted between tenants), not in the handle's arrival order (cheap: a waiting request
    # holds no KV pages)
    max_ongoing_requests: int = Field(default=256, ge=1)
    num_gpus: float = Field(default=0.0, ge=0)
    # services.engine.config.EngineConfig, e.g. {"kv_cache_memory": 268435456}; a misspelt
    # field fails at load
    engine: EngineConfig = Field(default_factory=EngineConfig)
    routing: RoutingConfig = RoutingConfig()
    # the model's tool-call and thinking dialects (services/dialects: auto reads the chat
    # template; an unknown name fails at load, with the list)
    tool_call_format: str = "auto"
    reasoning_format: str = "auto"
    # the engine core (model, scheduler, step loop) in a process of its own, so the replica's
    # request traffic never shares its interpreter lock (services/engine/core.py); false: on a
    # thread of the replica's process. A core silent this long is killed and started again.
    engine_process: bool = True
    engine_core_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    # a request arriving while the core restarts waits this long for it, then gets a 503: about
    # what the model takes to load again (seconds for SmolLM2 on an idle host, far more for a
    # large model or a busy one)
    restart_wait_s: float = Field(default=30.0, gt=0, le=600)

    @field_validator("tool_call_format", "reasoning_format")
    @classmethod
    def _dialect(cls, name: str, info: ValidationInfo) -> str:
        return check(name, str(info.field_name))

    @field_validator("engine")
    @classmethod
    def _model_at_top(cls, engine: EngineConfig) -> EngineConfig:
        if engine.model is not None:
            raise ValueError("llm.engine.model: name the model in the top-level `model` field")
        if engine.mask_budget_ms != MASK_BUDGET_MS:
            raise ValueError("llm.engine.mask_budget_ms: set it once, as grammar.mask_budget_ms")
        return engine


class GrammarServiceConfig(Backpressure, CompileSettings):
    """The GrammarService's deployment and its compile service (`CompileSettings`: workers,
    deadline_s, mask_budget_ms, limits, caps)."""

    # inline grammars' compiled forms, verdicts and timings shared between tenants; off: each
    # tenant's are its own (another tenant's request cannot tell what it sent by how fast its
    # own compiles). Registered grammars are always the registering tenant's.
    share_inline_cache: bool = False


TENANT_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # it becomes part of Redis keys and metric labels


class TenantLimits(_Strict):
    """For the whole service, whatever the number of ingress replicas (deployments/quota.py)."""

    requests_per_minute: int = Field(default=600, ge=1)
    max_concurrent: int = Field(default=32, ge=1)
    # prompt + completion tokens, charged as each answer ends; None: no token limit
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_tokens: int = Field(default=4096, ge=1)


class TenantConfig(_Strict):
    name: str = Field(pattern=TENANT_NAME)
    # sha256 hex digests of the API keys (never the keys themselves)
    api_key_sha256: list[str] = Field(default_factory=list)
    limits: TenantLimits = TenantLimits()
    # the tenant's share of each LLM replica (batch slots, prompt tokens per step) against the
    # others' weights, while they compete; an idle tenant's share goes to the rest
    weight: float = Field(default=1.0, gt=0, le=1000)


class TelemetryConfig(_Strict):
    """Traces, metrics and logs (services/telemetry). `enabled: false` turns traces and metrics
    into no-ops (`/metrics` answers an empty page); JSON logs stay."""

    enabled: bool = True
    # an OTLP collector for spans and metrics, e.g. http://otel-collector:4318; None: spans stay
    # in each process, metrics are only scraped at /metrics
    otlp_endpoint: str | None = None
    otlp_protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    sampling_ratio: float = Field(default=1.0, ge=0, le=1)
    # prompt text in request logs and spans (`gen_ai.input.messages`); off: never written
    log_prompts: bool = False
    # metric series labelled by tenant; off: summed over tenants (a scrape learns no tenant's
    # traffic). /metrics answers only the metrics token's holder either way.
    tenant_labels: bool = False
    export_interval_s: float = Field(default=5.0, gt=0, le=300)  # OTLP batches and metric pushes


class AdaptersConfig(_Strict):
    """LoRA adapters over HTTP (deployments/adapter_api.py; the engine needs
    `llm.engine.enable_lora`). Tenants register folders from `store`, a directory (the chart's
    PVC) or a bucket URL (`s3://bucket/prefix`, the `s3` extra; credentials from the
    environment, as s3fs reads them), each checked before anything loads it."""

    store: str | None = None  # None: no tenant registrations (operator modules still serve)
    store_options: dict[str, Any] = Field(default_factory=dict)  # fsspec's, e.g. endpoint_url
    cache_dir: str | None = None  # a bucket's adapters copied here; None: a temp folder
    # operator-wide adapters, every tenant's: name -> folder (vLLM's --lora-modules)
    modules: dict[str, str] = Field(default_factory=dict)
    caps: AdapterCaps = AdapterCaps()  # per tenant: registrations and their weights' bytes

    @field_validator("modules")
    @classmethod
    def _names(cls, modules: dict[str, str]) -> dict[str, str]:
        bad = [n for n in modules if not re.match(ADAPTER_NAME, n)]
        if bad:
            raise ValueError(f"adapters.modules: {bad[0]!r} is not a valid adapter name")
        return modules


class FilesConfig(_Strict):
    """Tenants' files for the Batch API (deployments/files_api.py): records in Redis, bytes in
    `store`, a directory (None: a folder in the service's cache) or a bucket URL."""

    store: str | None = None
    store_options: dict[str, Any] = Field(default_factory=dict)  # fsspec's, e.g. endpoint_url
    caps: FileCaps = FileCaps()  # a file's bytes; per tenant: files and bytes
    upload_timeout_s: float = Field(default=300.0, gt=0, le=3600)  # a slow upload: 408


class BatchesConfig(Backpressure):
    """The Batch API (deployments/batch_api.py, batch_runner.py; needs Redis): the runner's
    replicas, the lines each sends at once, and the caps per tenant."""

    concurrency: int = Field(default=16, ge=1, le=1024)
    lease_s: float = Field(default=30.0, ge=3, le=3600)  # a killed runner's batch waits this
    caps: BatchCaps = BatchCaps()


class ServiceConfig(_Strict):
    model: str | None = None  # a local HF folder; None: the default SmolLM2 package
    served_model_name: str = "SmolLM2-135M-Instruct"
    # other names the `model` field may use for it; any other name is a 404 model_not_found
    model_aliases: list[str] = Field(default_factory=list)
    redis_url: str | None = None  # None: an in-process cache, registrations not shared
    api_keys_file: str | None = None  # JSON {tenant: [sha256, ...]} (a mounted Secret)
    tenants: list[TenantConfig] = Field(default_factory=list)
    ingress: IngressConfig = IngressConfig()
    llm: LLMConfig = LLMConfig()
    grammar: GrammarServiceConfig = GrammarServiceConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    adapters: AdaptersConfig = AdaptersConfig()
    files: FilesConfig = FilesConfig()
    batches: BatchesConfig = BatchesConfig()
