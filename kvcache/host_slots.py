"""Who holds which slot of the KV host tier: reservations, allocation, frees and tenant caps.

Plain Python, no tensors: the copy arena (`kvcache.host_tier`) builds on this, and the accounting
is tested without a device.

Slots belong to an owner `(tenant, request_id)`. `free` by a non-owner or a double free raises
`HostSlotError`, whose message never names the real holder, so nothing an owner of tenant A holds
can be freed or learnt through tenant B (reads go through a request's page table, which only ever
names the slots `park` gave that request).
`release(owner)` frees everything (request finished or cancelled): counts return to zero. Caps:
total capacity and per-tenant caps; `reserve` at admission sets pages aside so a later `park`
cannot fail mid-decode; exceeding a cap raises `HostTierFull` with the numbers, never a drop.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any

Owner = tuple[str, str]  # (tenant, request_id)


class HostTierFull(RuntimeError):
    """A reservation or allocation would exceed a tenant's host cap or the store's capacity."""

    def __init__(self, tenant: str, asked: int, held: int, cap: int, scope: str) -> None:
        self.tenant, self.asked, self.held, self.cap, self.scope = tenant, asked, held, cap, scope
        if scope == "capacity":  # the numbers are everyone's: the message keeps them
            message = f"KV host tier at capacity: no room for {asked} pages now; try again later"
        else:
            message = f"KV host tier full ({scope}): tenant {tenant!r} asked for {asked} pages, "
            message += f"{held} held of {cap}"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:  # survives pickling (errors crossing processes)
        return type(self), (self.tenant, self.asked, self.held, self.cap, self.scope)


class HostSlotError(RuntimeError):
    """A slot freed twice, freed by an owner that does not hold it, or out of range."""


class HostSlots:
    """`capacity_pages` host slots (one full page, every layer, each) and who holds them."""

    def __init__(
        self,
        capacity_pages: int,
        *,
        tenant_caps: Mapping[str, int] | None = None,
        default_tenant_cap: int | None = None,
    ) -> None:
        if capacity_pages < 1:
            raise ValueError(f"capacity_pages: must be >= 1, got {capacity_pages}")
        caps = dict(tenant_caps or {})
        for name, cap in [*caps.items(), ("default_tenant_cap", default_tenant_cap)]:
            if cap is not None and cap < 0:
                raise ValueError(f"host page cap for {name!r}: must be >= 0, got {cap}")
        self.capacity_pages = capacity_pages
        self.tenant_caps, self.default_tenant_cap = caps, default_tenant_cap
        self._free: deque[int] = deque(range(capacity_pages))
        self._holder: list[Owner | None] = [None] * capacity_pages
        self._slots: dict[Owner, set[int]] = {}
        self._reserved: dict[Owner, int] = {}
        self._tenant_pages: Counter[str] = Counter()  # held + reserved, what caps apply to
        self._reserved_total = 0

    @property
    def pages_in_use(self) -> int:
        return self.capacity_pages - len(self._free)

    def owner_pages(self, owner: Owner) -> int:
        return len(self._slots.get(owner, ()))

    def tenant_pages(self, tenant: str) -> int:
        """Pages a tenant holds plus pages reserved for it: the figure its cap applies to."""
        return self._tenant_pages[tenant]

    def tenant_cap(self, tenant: str) -> int | None:
        return self.tenant_caps.get(tenant, self.default_tenant_cap)

    def can_allocate(self, tenant: str, n: int) -> bool:
        return self._shortfall(tenant, n) is None

    def _shortfall(self, tenant: str, n: int) -> HostTierFull | None:
        held, cap = self._tenant_pages[tenant], self.tenant_cap(tenant)
        if cap is not None and held + n > cap:
            return HostTierFull(tenant, n, held, cap, "tenant cap")
        if n > len(self._free) - self._reserved_total:
            committed = self.pages_in_use + self._reserved_total
            return HostTierFull(tenant, n, committed, self.capacity_pages, "capacity")
        return None

    def reserve(self, owner: Owner, n: int) -> None:
        """Sets `n` pages aside for `owner` (admission), so its later allocations cannot fail."""
        if error := self._shortfall(owner[0], n):
            raise error
        self._reserved[owner] = self._reserved.get(owner, 0) + n
        self._reserved_total += n
        self._tenant_pages[owner[0]] += n

    def allocate(self, owner: Owner, n: int) -> list[int]:
        """`n` slots for `owner`, taken from its reservation first; raises `HostTierFull`."""
        if n < 0:
            raise ValueError(f"n: must be >= 0, got {n}")
        from_reserve = min(n, self._reserved.get(owner, 0))
        if error := self._shortfall(owner[0], n - from_reserve):
            raise error
        self._reserved[owner] = self._reserved.get(owner, 0) - from_reserve
        self._reserved_total -= from_reserve
        self._tenant_pages[owner[0]] += n - from_reserve
        slots = [self._free.popleft() for _ in range(n)]
        for s in slots:
            self._holder[s] = owner
        self._slots.setdefault(owner, set()).update(slots)
        return slots

    def free(self, owner: Owner, slots: Sequence[int]) -> None:
        """Returns slots to the store; all-or-nothing: a bad slot raises before any is freed."""
        self._check_owned(owner, slots)
        held = self._slots[owner] if slots else set()
        for s in slots:
            self._holder[s] = None
            held.discard(s)
        self._free.extend(slots)
        self._tenant_pages[owner[0]] -= len(slots)

    def release(self, owner: Owner) -> int:
        """Frees every slot and reservation of `owner` (finish, cancel); returns slots freed."""
        slots = sorted(self._slots.get(owner, ()))
        self.free(owner, slots)
        self._slots.pop(owner, None)
        reserved = self._reserved.pop(owner, 0)
        self._reserved_total -= reserved
        self._tenant_pages[owner[0]] -= reserved
        if not self._tenant_pages[owner[0]]:
            del self._tenant_pages[owner[0]]
        return len(slots)

    def _check_owned(self, owner: Owner, slots: Sequence[int]) -> None:
        if len(set(slots)) != len(slots):
            raise HostSlotError(f"host slots repeated in one call: {sorted(slots)}")
        for s in slots:
            if not 0 <= s < self.capacity_pages:
                raise HostSlotError(f"host slot {s} out of range [0, {self.capacity_pages})")
            if self._holder[s] != owner:
                # Never name the real holder: it may be another tenant's request.
                state = "free" if self._holder[s] is None else "held by another owner"
                raise HostSlotError(f"host slot {s} is not held by {owner!r} ({state})")
