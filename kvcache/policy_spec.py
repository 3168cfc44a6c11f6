"""What a request asks of its KV cache: `KVPolicy`, checked against the registered policies.

The legal kinds are the registry's (`kvcache.policies.POLICIES`, one small class per method), so a
policy class once registered is a legal `kind` everywhere: here, in the HTTP body
(`deployments/protocol.py`) and in the tests' policy table. `services.engine.params` re-exports
`KVPolicy`, and `from services import KVPolicy` stays its public name.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.policies import POLICIES

KV_KINDS: tuple[str, ...] = tuple(POLICIES)
DEFAULT_BUDGET_TOKENS = 1024
# Quest under GQA: "max" ranks a KV head's pages by the largest bound of its query heads; "union"
# lets each query head rank them and takes, round by round, every head's next best page, so a
# page one head needs is not crowded out by pages another head bounds high.
QUEST_HEADS = ("max", "union")


@dataclass(frozen=True)
class KVPolicy:
    """Which keys and values attention reads for one request (`full` reads every page).

    `budget_tokens` is what each KV head keeps (`window`, `sinks`, `h2o`, `snapkv`: the rest is
    evicted and its pages freed) or reads per decode step (`quest`: every page is kept). Unset, it
    is the window (+ sinks) where one is given, else `DEFAULT_BUDGET_TOKENS`.
    - `window`: the last `window` tokens (defaults to the budget).
    - `sinks`: the first `n_sink` tokens plus the last `window`; `rerotate=True` assigns positions
      within the cache, so a stream can run past the model's trained context.
    - `h2o`: `heavy_ratio` of the budget to the keys with the most accumulated attention, the rest
      to the most recent tokens.
    - `snapkv`: after prefill, keep per head the prompt positions the last `window` queries
      (default 32) attend to most, pooled with `kernel_size`, plus that window itself.
    - `quest`: per decode step, the pages whose key bounds promise the most attention, up to the
      budget, plus the last page; the first `dense_layers` layers and prefill read every page.
      `quest_heads` (`QUEST_HEADS`) says how the query heads sharing a KV head choose.
    `page_size`, when given, must equal the engine's page size (Quest's pages are the pool's).
    `offload=True` (quest, with a host tier configured) parks every page but the first and the
    last two in host memory; `hot_pages` (default: the budget's pages) pool pages hold, per layer
    and KV head, the parked pages selected most recently (`kvcache.hot_set`).
    """

    kind: str = "full"  # a registered policy: KV_KINDS
    budget_tokens: int | None = None
    page_size: int | None = None
    offload: bool = False
    window: int | None = None
    n_sink: int = 4
    rerotate: bool = False
    heavy_ratio: float = 0.5
    kernel_size: int = 5
    dense_layers: int = 2
    hot_pages: int | None = None  # offload: pool pages of the hot set (see `kvcache.hot_set`)
    quest_heads: str = "max"  # quest, GQA: how the query heads of a KV head choose its pages

    def __post_init__(self) -> None:
        if self.kind not in KV_KINDS:
            raise ValueError(f"kv.kind: {self.kind!r} is not one of {', '.join(KV_KINDS)}")
        for name in ("budget_tokens", "page_size", "window"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"kv.{name}: must be >= 1, got {value}")
        if self.offload and self.kind != "quest":
            raise ValueError("kv.offload: only the 'quest' policy can park pages in the host tier")
        if self.n_sink < 0:
            raise ValueError(f"kv.n_sink: must be >= 0, got {self.n_sink}")
        if self.rerotate and self.kind not in ("sinks", "window"):
            raise ValueError("kv.rerotate: only 'sinks' and 'window' can re-assign positions")
        if not 0.0 <= self.heavy_ratio <= 1.0:
            raise ValueError(f"kv.heavy_ratio: must be in [0, 1], got {self.heavy_ratio}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kv.kernel_size: must be odd and >= 1, got {self.kernel_size}")
        if self.hot_pages is not None and (self.hot_pages < 0 or not self.offload):
            raise ValueError("kv.hot_pages: must be >= 0, and only with offload=True")
        if self.quest_heads not in QUEST_HEADS:
            raise ValueError(f"kv.quest_heads: {self.quest_heads!r} is not one of {QUEST_HEADS}")
        if self.dense_layers < 0:
            raise ValueError(f"kv.dense_layers: must be >= 0, got {self.dense_layers}")
        budget = self.budget
        if self.kind == "sinks" and budget <= self.n_sink:
            raise ValueError(f"kv.budget_tokens: {budget} leaves no room after {self.n_sink} sinks")
        if self.kind == "snapkv" and budget < self.observe_window:
            raise ValueError(
                f"kv.budget_tokens: {budget} is smaller than the observation window "
                f"({self.observe_window})"
            )

    @property
    def budget(self) -> int:
        """Tokens kept (bounded policies) or read (quest) per KV head."""
        if self.budget_tokens is not None:
            return self.budget_tokens
        if self.window is not None and self.kind in ("window", "sinks"):
            return self.window + (self.n_sink if self.kind == "sinks" else 0)
        return DEFAULT_BUDGET_TOKENS

    @property
    def hot_budget_pages(self) -> int:
        """Offload: how many recently selected pages stay on the device (default: the budget)."""
        if self.hot_pages is not None:
            return self.hot_pages
        return self.budget // (self.page_size or 16)

    @property
    def observe_window(self) -> int:
        """SnapKV: how many of the prompt's last queries vote for the positions kept."""
        return self.window if self.window is not None else 32

    @property
    def bounded(self) -> bool:
        """True when the policy evicts: the request's KV stays within its budget."""
        return POLICIES[self.kind].bounded
