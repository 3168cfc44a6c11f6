"""The application builder: `deployments.app:build_app` (the import path in the Helm chart's
`serveConfigV2`, and what `structserve serve` runs).

Ingress → (LLMReplica, GrammarService, BatchRunner); LLMReplica → GrammarService; BatchRunner →
Ingress (by name, for each batch line); every replica pushes its
metrics to one `TelemetryHub` (when telemetry is enabled). Every deployment gets
`max_ongoing_requests` and `max_queued_requests` from the config, and queue overflow answers 429
with `Retry-After` instead of Ray's default 503.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from deployments.batch_runner import BatchRunner
from deployments.grammar_service import GrammarService
from deployments.ingress import Ingress
from deployments.replica import LLMReplica
from deployments.service_config import Backpressure, RoutingConfig, ServiceConfig
from deployments.telemetry_hub import TelemetryHub
from services import settings


def _options(b: Backpressure, **actor: Any) -> dict[str, Any]:
    return {
        "num_replicas": b.num_replicas,
        "max_ongoing_requests": b.max_ongoing_requests,
        "max_queued_requests": b.max_queued_requests,
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=1),
        "ray_actor_options": {"num_cpus": b.num_cpus, **actor},
        "graceful_shutdown_timeout_s": 30,
    }


def _router(routing: RoutingConfig, replicas: int) -> dict[str, Any]:
    if routing.policy == "power_of_two" or replicas < 2:  # one replica: nothing to choose
        return {}
    router = RequestRouterConfig.model_validate(
        {
            "request_router_class": "deployments.routing:PrefixAffinityRouter",
            "request_router_kwargs": {
                "prefix_chars": routing.prefix_chars,
                "max_load_gap": routing.max_load_gap,
            },
        }
    )
    return {"request_router_config": router}


def build_app(args: dict[str, Any] | ServiceConfig) -> Application:
    cfg = args if isinstance(args, ServiceConfig) else ServiceConfig.model_validate(args or {})
    plain = cfg.model_dump(mode="json")
    grammar = serve.deployment(name="GrammarService", **_options(cfg.grammar))(GrammarService)
    llm_options = _options(cfg.llm, num_gpus=cfg.llm.num_gpus) | _router(
        cfg.llm.routing, cfg.llm.num_replicas
    )
    llm = serve.deployment(name="LLMReplica", **llm_options)(LLMReplica)
    ingress = serve.deployment(name="Ingress", **_options(cfg.ingress))(Ingress)
    hub = None
    if cfg.telemetry.enabled:  # one replica: it only adds up small snapshots
        plumbing = Backpressure(max_ongoing_requests=256, max_queued_requests=1024)
        quiet = {"enable_access_log": False}  # a push a second from every replica
        hub_deployment = serve.deployment(
            name="TelemetryHub", logging_config=quiet, **_options(plumbing)
        )
        hub = hub_deployment(TelemetryHub).bind()
    grammar_app = grammar.bind(plain, hub)
    llm_app = llm.bind(plain, grammar_app, hub)
    runner = serve.deployment(name="BatchRunner", **_options(cfg.batches))(BatchRunner)
    runner_app = runner.bind(plain)  # it calls the ingress back by name, with each line
    return ingress.bind(plain, llm_app, grammar_app, settings.api_key(), hub, runner_app)
