"""Weighted fair shares between tenants inside one engine: whose request is admitted next, how
many batch slots and prefill tokens a tenant may hold while others wait, and whom to preempt.

Virtual-time fair queuing: each tenant's virtual time is the tokens the engine computed for it
divided by its weight; the backlogged tenant with the least virtual time goes next. A tenant
that comes back from idle starts at the least virtual time of those with work, so idling earns
no credit to burst with later. Shares are over the tenants that have work, so an idle tenant's
share goes to the others (work-conserving):
- batch slots: `max_num_seqs * weight / sum of weights`; a tenant below its share while the
  batch is full gets a slot from the tenant furthest over its own (preempted, recomputed later);
- prefill tokens per step: the step's token budget split the same way between the tenants with
  prompt tokens to compute (decode tokens are one per request and never capped);
- preemption for pages picks the newest request of the tenant furthest over its slot share.

A tenant's batch lines (the Batch API) run as the tenant name plus `BATCH_SUFFIX`, a class of its
own at `BATCH_WEIGHT`: its virtual time runs a thousand times faster, so it is admitted only when
no interactive tenant has work waiting, and is the first preempted when one needs a slot; alone,
it has the whole engine (work-conserving). Beside interactive work it computes only a few rows a
step (fair_policy.py, `batch_rows_beside`), so its lines cannot lengthen interactive steps. Its
prefixes are cached among its own lines.

Work done for a tenant outside its tokens (an adapter copied into a slot for its request: the
step waits for it) is charged as the tokens the engine computes in that time (`charge_time`, at
the rate between its last steps), so cycling through adapters is not free compute.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

BATCH_SUFFIX = "/batch"  # no tenant name holds a '/' (service_config.TENANT_NAME)
BATCH_WEIGHT = 1e-3


def is_batch(tenant: str) -> bool:
    """Whether `tenant` is a tenant's batch class."""
    return tenant.endswith(BATCH_SUFFIX)


@dataclass
class FairShares:
    weights: Mapping[str, float] = field(default_factory=dict)  # tenant -> weight (default 1)
    _vtime: dict[str, float] = field(default_factory=dict)

    def weight(self, tenant: str) -> float:
        if is_batch(tenant):
            return BATCH_WEIGHT
        return float(self.weights.get(tenant, 1.0))

    def vtime(self, tenant: str) -> float:
        return self._vtime.get(tenant, 0.0)

    _rate: float = 0.0  # tokens a second the engine computed lately
    _last: tuple[float, int] | None = None  # (when, tokens) of the last step scheduled

    def charge(self, tenant: str, tokens: float) -> None:
        self._vtime[tenant] = self.vtime(tenant) + tokens / self.weight(tenant)

    def stepped(self, tokens: int) -> None:
        """A step of `tokens` is scheduled: the last one's tokens over the time since it was."""
        now = time.perf_counter()
        if self._last is not None and self._last[1] and now > self._last[0]:
            rate = self._last[1] / (now - self._last[0])
            self._rate = rate if not self._rate else 0.8 * self._rate + 0.2 * rate
        self._last = (now, tokens)

    def charge_time(self, tenant: str, seconds: float) -> None:
        """`seconds` of the engine spent for `tenant` on something other than its tokens."""
        self.charge(tenant, seconds * self._rate)

    def wake(self, tenant: str, busy: Iterable[str]) -> None:
        """`tenant` has work again: no credit for the time it had none."""
        floor = min((self.vtime(t) for t in busy if t != tenant), default=None)
        if floor is not None and self.vtime(tenant) < floor:
            self._vtime[tenant] = floor

    def next_tenant(self, candidates: Iterable[str]) -> str:
        """The candidate with the least virtual time (ties: the first given)."""
        return min(candidates, key=self.vtime)

    def split(self, total: int, demand: Mapping[str, int | None]) -> dict[str, int]:
        """`total` (slots, tokens) shared by weight, never more than a tenant asks for (None:
        no limit), what one leaves going to the others (weighted max-min fairness); rounding
        favours the least virtual time."""
        shares = dict.fromkeys(demand, 0)
        wanting = {t: d for t, d in demand.items() if d is None or d > 0}
        left = total
        while left > 0 and wanting:
            weights = sum(self.weight(t) for t in wanting)
            round_left = left
            for t in sorted(wanting, key=self.vtime):
                want = wanting[t]
                give = max(1, int(round_left * self.weight(t) / weights))
                give = min(give, left) if want is None else min(give, left, want)
                shares[t] += give
                left -= give
                if want is not None:
                    wanting[t] = want - give
                if left == 0:
                    break
            wanting = {t: d for t, d in wanting.items() if d is None or d > 0}
        return shares

    def most_over(self, held: Mapping[str, int], shares: Mapping[str, int]) -> str | None:
        """The tenant holding the most beyond its share (None: nobody is over)."""
        over = {t: n - shares.get(t, 0) for t, n in held.items() if n > shares.get(t, 0)}
        if not over:
            return None
        return max(over, key=lambda t: (over[t] / max(shares.get(t, 0), 1), -self.vtime(t)))
