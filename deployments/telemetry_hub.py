"""`TelemetryHub`: where the metrics of every replica meet, so `/metrics` covers them all.

Each replica process (ingress, LLM, grammar service) keeps its own OpenTelemetry metrics and a
`Pusher` thread sends their cumulative snapshot to the hub through a deployment handle once a
second; the ingress's `/metrics` asks the hub for the sum, written in the Prometheus text format.
`services/telemetry` explains the choice over Ray's metrics agent and over handle pulls. A
replica that stops pushing keeps its counters in the sum (retired) and drops its gauges after
`STALE_S`; `structserve_telemetry_sources{component}` says how many processes report.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from deployments.service_config import ServiceConfig, TelemetryConfig
from services import telemetry
from services.telemetry.snapshot import Aggregator, Family

log = logging.getLogger(__name__)

PUSH_INTERVAL_S = 1.0
STALE_S = 15.0
_PUSH_TIMEOUT_S = 5.0


class TelemetryHub:
    def __init__(self) -> None:
        self.aggregator = Aggregator(stale_s=STALE_S)

    async def push(self, source: str, component: str, snapshot: list[Family]) -> None:
        self.aggregator.push(source, component, snapshot)

    async def render(self) -> str:
        return self.aggregator.render()


def settings_from(cfg: TelemetryConfig) -> telemetry.TelemetrySettings:
    return telemetry.TelemetrySettings(**cfg.model_dump())


class Pusher:
    """Sends this process's snapshot to the hub every `interval_s`, on a daemon thread."""

    def __init__(
        self,
        hub: Any,
        component: str,
        interval_s: float = PUSH_INTERVAL_S,
        snapshot: Callable[[], list[Family]] | None = None,
    ) -> None:
        """`snapshot`: whose metrics to push (default this process's; an LLM replica pushes its
        engine core's too, which has no handle of its own)."""
        self.hub = hub
        self.component = component
        self.snapshot = snapshot or (lambda: telemetry.get().snapshot())
        self.source = f"{component}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name="telemetry-push", daemon=True)
        self._thread.start()

    def push(self) -> None:
        snapshot = self.snapshot()
        self.hub.push.remote(self.source, self.component, snapshot).result(
            timeout_s=_PUSH_TIMEOUT_S
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.push()
                self._failures = 0
            except Exception as exc:  # the hub restarting: metrics wait, requests never do
                self._failures += 1
                if self._failures in (1, 60):
                    log.warning("telemetry: pushing metrics failed (%s)", exc)

    def stop(self) -> None:
        self._stop.set()


_pusher: Pusher | None = None
_lock = threading.Lock()


def setup(config: ServiceConfig, component: str, hub: Any | None) -> telemetry.Telemetry:
    """This process's telemetry from the config, and its pusher when a hub is given."""
    global _pusher
    # the ingress takes trace context from clients: it decides their sampling itself
    settings = replace(settings_from(config.telemetry), edge=component == "Ingress")
    tel = telemetry.configure(settings, component)
    with _lock:
        if hub is not None and tel.enabled and _pusher is None:
            _pusher = Pusher(hub, component)
    return tel


def pusher() -> Pusher | None:
    return _pusher


async def scraped(hub: Any | None) -> str:
    """`/metrics`: every replica's metrics, summed by the hub (this process's pushed first, so
    what it just counted is in); the hub unreachable: this process's alone."""
    import asyncio

    from services.telemetry.snapshot import render

    tel = telemetry.get()
    if not tel.enabled:
        return "# telemetry is disabled\n"
    own = tel.snapshot()
    push = pusher()
    try:
        if hub is None or push is None:
            raise LookupError("no telemetry hub")
        await asyncio.wait_for(hub.push.remote(push.source, "Ingress", own), timeout=5)
        text: str = await asyncio.wait_for(hub.render.remote(), timeout=5)
        return text
    except Exception as exc:
        log.warning("metrics: the telemetry hub did not answer (%s); this replica only", exc)
        return render(own)
