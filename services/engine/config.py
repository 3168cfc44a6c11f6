"""Engine settings, grouped by concern and validated at start-up.

Each group is a frozen dataclass of its own (`RunnerConfig`: the model and the device it runs on;
`CacheConfig`: the KV pool, the prefix cache and the host tier; `SchedulingConfig`; `GrammarConfig`;
`SandboxConfig`: work tenants' input steers; `SpeculationConfig`), and the part of the engine that
reads a concern takes its group. `EngineConfig` is every group at once: the flat keyword form
`LLM(...)` and `ServiceConfig.llm.engine` take (`EngineConfig(max_num_seqs=8, page_size=16)`),
each field defined once, in its group; `config.scheduling` and the like are the group views.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from services import settings
from services.grammar.backend import MASK_BUDGET_MS, MASK_DEADLINE_MS
from services.grammar.structured import check_name

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECULATIVE_METHODS = ("ngram",)
ATTENTION_KERNELS = ("auto", "native", "triton")  # see RunnerConfig.attention_kernel
DECODE_GRAPHS = ("auto", "off", "uncaptured")  # see RunnerConfig.decode_graphs
DRAFT_LENGTHS = ("fixed", "adaptive")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (Linux's flags; elsewhere: no). Without
    it oneDNN emulates bf16 and a bf16 model runs slower than in float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """The model and the device it runs on, with the forward's fast paths."""

    model: str | None = None  # a local HF folder; None: the default SmolLM2 package
    device: str = "auto"  # "auto": cuda when present, else cpu
    # "auto": bfloat16 on cuda; on a cpu, bfloat16 for a model stored in 16 bits when the cpu
    # multiplies bfloat16 natively (AVX-512 BF16 or AMX, as vLLM's CPU build takes it), else
    # float32 (a float32 model stays float32: its outputs do not move)
    dtype: str = "auto"
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads; None: torch's default
    # On CPU, linear layers through oneDNN with their weights packed once into its blocked
    # layout (services/models/packed.py): faster products. False: the plain twin
    # (`F.linear`). No effect on CUDA.
    packed_weights: bool = True
    # With packed weights, products of one or two rows (one request's decode step) through a C
    # loop that streams the weights as stored (services/models/small_products.c): oneDNN reads
    # them at about half the memory's rate there. False: the plain twin, oneDNN at every size.
    small_products: bool = True
    # Attention reads the KV pages where they lie instead of gathering them into a workspace
    # for SDPA: on CPU (float32, bfloat16) decode rows through a C kernel
    # (kvcache/paged_attention.c, built on first use), on CUDA decode rows, prompt chunks over
    # a cached prefix and Quest's choice through Triton (kvcache/triton_attention.py). False,
    # or a machine without a C compiler or Triton: the plain twin (gather, then SDPA).
    inplace_attention: bool = True
    # Which kernel: "auto" (C on CPU, Triton on CUDA), "native" (C, CPU) or "triton"
    # (on a CPU through Triton's interpreter: slow, for tests of the GPU's kernel).
    attention_kernel: str = "auto"
    # Decode steps as CUDA graphs, padded to a few batch sizes (services/engine/decode_graphs.py):
    # "auto" captures them on CUDA when attention reads pages in place; "off": the plain twin
    # (every step launched eagerly); "uncaptured": the padded static-buffer forward without
    # capturing (any device: how a CPU tests what the graphs run).
    decode_graphs: str = "auto"
    # Llama-family models through a lean forward with their norms, RoPE and SiLU fused
    # (services/models/fused.py), checked against transformers' at load. False: the plain twin
    # (transformers' forward).
    fused_forward: bool = True
    # A serving process (the engine core, the replica, the ingress) freezes the objects alive
    # after start-up out of the garbage collector's reach (services/engine/gc_freeze.py): a full
    # collection then takes ~0 ms instead of ~200 ms that every step would wait for. False: the
    # plain twin. The offline `LLM` never does (the process is the caller's).
    freeze_gc: bool = True

    def __post_init__(self) -> None:
        self._check_runner()

    def _check_runner(self) -> None:
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device: {self.device!r} is not 'auto', 'cpu' or 'cuda[:N]'")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        if self.decode_graphs not in DECODE_GRAPHS:
            raise ValueError(
                f"decode_graphs: {self.decode_graphs!r} is not one of {', '.join(DECODE_GRAPHS)}"
            )
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"attention_kernel: {self.attention_kernel!r} is not one of "
                f"{', '.join(ATTENTION_KERNELS)}"
            )

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device, stored: torch.dtype | None = None) -> torch.dtype:
        """The dtype to run in; `stored`: the model's own (its config's), when known."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cuda":
            return torch.bfloat16
        half = stored in (torch.bfloat16, torch.float16)
        return torch.bfloat16 if half and cpu_has_native_bf16() else torch.float32


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The paged KV pool, the prefix cache and the KV host tier."""

    kv_cache_memory: int | None = None  # bytes for the KV pool; None: a share of free memory
    page_size: int = 16
    # Automatic prefix caching (services/engine/prefix_cache.py): full pages are kept, keyed by
    # their tokens and the tenant, and a request whose prompt starts the same way maps them
    # instead of computing them. False: the plain twin, every prompt computed whole.
    enable_prefix_caching: bool = True
    # KV host tier: pages of host memory that `quest` requests with offload=True park into;
    # 0: no tier (offload is refused). `kv_tier_tenant_pages` caps each tenant's share; None:
    # half the tier, so no one tenant can fill it.
    kv_tier_pages: int = 0
    kv_tier_tenant_pages: int | None = None
    # Quest keeps its key bounds per this many tokens (a power of two up to page_size) and
    # scores a page by its best part, whose bound mixes fewer keys' channels; it still reads
    # whole pages. None: one bound per page (the plain twin).
    quest_bound_tokens: int | None = None
    # The KV host tier's hot sets route each layer's Quest selection in C (kvcache/hot_set.c,
    # built on first use). False, or no C compiler: the plain twin (the same LRU in Python).
    native_hot_set: bool = True

    def __post_init__(self) -> None:
        self._check_cache()

    def _check_cache(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size: must be a power of two, got {self.page_size}")
        qb = self.quest_bound_tokens
        if qb is not None and (qb < 1 or qb & (qb - 1) or qb > self.page_size):
            raise ValueError(f"quest_bound_tokens: a power of two up to page_size, got {qb}")
        if self.kv_tier_pages < 0:
            raise ValueError("kv_tier_pages: must be >= 0")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory: must be a positive number of bytes")

    def tier_tenant_cap(self) -> int:
        if self.kv_tier_tenant_pages is not None:
            return self.kv_tier_tenant_pages
        return max(1, self.kv_tier_pages // 2)

    def kv_budget_bytes(self, device: torch.device) -> int:
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            return int(free * 0.8)
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return int(min(available * 0.25, 4 << 30))


@dataclass(frozen=True, kw_only=True)
class SchedulingConfig:
    """What each step admits and computes, and how tenants share it."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # None: the model's context, capped by the pool
    max_prompt_chars: int | None = None  # None: 32 characters per token of max_model_len
    # Weighted fair shares between tenants (services/engine/fairness.py); False: arrival order.
    # `tenant_weights`: tenant -> weight, 1 for any tenant not named.
    fair_scheduling: bool = True
    tenant_weights: dict[str, float] | None = None
    # With fair scheduling, a tenant with nothing running has its first chunk computed in a step
    # of its own (never two such steps in a row), so its first token does not wait on the other
    # tenants' whole batch. None: on for cpu, where a step's time grows with the batch; off for
    # cuda, where a decode batch costs about what one sequence does. False: the plain twin.
    newcomer_steps: bool | None = None
    # With fair scheduling, while any interactive request runs or waits, the batch class (Batch
    # API lines, fairness.BATCH_SUFFIX) computes at most this many of its running rows a step
    # (the oldest; the rest keep their pages and wait, nothing is recomputed) and admits no more:
    # interactive steps stay about as short as alone. None: 2 on cpu, where a step's time grows
    # with its rows; `max_num_seqs // 2` on cuda. `max_num_seqs`: no cap (the plain twin).
    batch_rows_beside: int | None = None
    # With fair scheduling, the batch class's prompt tokens a step, alone or not (chunked
    # prefill only), so the step an interactive request arriving at a busy engine waits out
    # stays short: a new wave of lines is taken in over several steps. None: no cap (the
    # default: on a CPU, 256 of 2048 cut the first such request's wait by a fifth and the
    # batch's throughput by a tenth; benchmarks/batch.py --batch-prefill).
    batch_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        self._check_scheduling()

    def _check_scheduling(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens: must be >= 1")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars: must be >= 1")
        if self.batch_rows_beside is not None and self.batch_rows_beside < 1:
            raise ValueError("batch_rows_beside: must be >= 1 (batch lines always advance)")
        if self.batch_prefill_tokens is not None and self.batch_prefill_tokens < 1:
            raise ValueError("batch_prefill_tokens: must be >= 1 (batch lines always advance)")
        for tenant, weight in (self.tenant_weights or {}).items():
            if not weight > 0:
                raise ValueError(f"tenant_weights: {tenant!r} must weigh > 0, got {weight}")

    def newcomer_steps_on(self, device: torch.device) -> bool:
        if self.newcomer_steps is None:
            return self.fair_scheduling and device.type == "cpu"
        return self.fair_scheduling and self.newcomer_steps

    def batch_rows_on(self, device: torch.device) -> int:
        if not self.fair_scheduling:
            return self.max_num_seqs
        if self.batch_rows_beside is None:
            return 2 if device.type == "cpu" else max(1, self.max_num_seqs // 2)
        return self.batch_rows_beside

    def batch_prefill_on(self) -> int | None:
        if not (self.fair_scheduling and self.enable_chunked_prefill):
            return None
        tokens = self.batch_prefill_tokens
        return None if tokens is None or tokens >= self.max_num_batched_tokens else tokens


@dataclass(frozen=True, kw_only=True)
class GrammarConfig:
    """Structured output: where grammars compile, which backend builds them, how masks are
    filled and held to their budget, how outputs are checked."""

    # Grammar compiles: in this many worker processes behind limits, a deadline and a mask probe
    # (the compile service); 0 compiles in-process with no guard (the plain twin, for tests).
    grammar_workers: int = 1
    grammar_redis_url: str | None = None  # the shared verdict cache; None: in-process only
    # xgrammar, llguidance, or auto: the backend per grammar (services/grammar/backends.py).
    # auto: a JSON schema's first mask in milliseconds (llguidance builds lazily) where xgrammar
    # compiles for up to seconds, every schema either backend serves, the fewest keywords
    # loosened; the README's "What auto picks" has the figures
    grammar_backend: str = "auto"
    overlap_masks: bool = True  # fill grammar masks while the forward runs (False: after it)
    jump_forward: bool = False  # append grammar-forced spans without a forward pass each
    # The mask budget (services/engine/structured/manager.py): a request whose masks slower than
    # `mask_budget_ms` add up to `mask_strikes` budgets fails (422) and its grammar is refused.
    mask_budget_ms: float = MASK_BUDGET_MS
    mask_strikes: float = 3.0
    # No step waits for one request's mask (or forced text) longer than this after the fills
    # started, nor before the forward ends: a late row leaves the step and samples once its mask
    # is in (services/engine/structured/late.py). None: every step waits (the plain twin).
    mask_deadline_ms: float | None = MASK_DEADLINE_MS
    mask_workers: int = 2  # threads filling masks (a straggler's is replaced)
    validation_timeout_s: float = 1.0  # JSON output validation; later: validated=False
    # A JSON output that fails its check goes back to the value that failed and samples it
    # again, this many times at most (services/engine/structured/checked.py); 0: it ends
    # `error` at once (the plain twin).
    check_retries: int = 4

    def __post_init__(self) -> None:
        self._check_grammar()

    def _check_grammar(self) -> None:
        if self.grammar_workers < 0:
            raise ValueError("grammar_workers: must be >= 0")
        if self.check_retries < 0:
            raise ValueError(f"check_retries: must be >= 0, got {self.check_retries}")
        if self.mask_workers < 1:
            raise ValueError(f"mask_workers: must be >= 1, got {self.mask_workers}")
        if self.mask_deadline_ms is not None and not self.mask_deadline_ms > 0:
            raise ValueError(f"mask_deadline_ms: must be > 0 or None, got {self.mask_deadline_ms}")
        check_name("grammar_backend", self.grammar_backend)
        for name in ("mask_budget_ms", "mask_strikes", "validation_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.grammar_redis_url and self.grammar_workers and not settings.verdict_secret():
            raise ValueError(
                "grammar_redis_url: verdicts in Redis are signed; set STRUCTSERVE_VERDICT_SECRET "
                "(the same in every process sharing that Redis)"
            )


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Work a tenant's input steers (validating outputs against its schema, rendering the chat
    template over its messages) runs in `sandbox_workers` killable worker processes per kind,
    each job under its deadline (services/sandbox). 0: in this process, no deadline (the plain
    twin)."""

    sandbox_workers: int = 2
    template_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        self._check_sandbox()

    def _check_sandbox(self) -> None:
        if self.sandbox_workers < 0:
            raise ValueError("sandbox_workers: must be >= 0")
        if not self.template_timeout_s > 0:
            raise ValueError(f"template_timeout_s: must be > 0, got {self.template_timeout_s}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`LLM(speculative={...})`, in vLLM's keys (services/engine/speculative.py)."""

    # unset keys (what `speculative={}` takes): measured on a 2-core CPU, SmolLM2 fp32. In-process
    # (benchmarks/vs_vllm.py, A B B A against speculation off): 32 mixed requests +21%, 22
    # JSON-schema requests +16%, one request about even; 4 draft tokens beat 8 at batch 1 (23 vs
    # 29 ms a token). Over HTTP (vs_vllm_http.py), chat-like text at 32 streams lost a fifth with
    # drafts on while JSON at 1 and 8 streams gained (0.52 -> 0.78, 1.42 -> 2.34 requests/s)
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # no drafts in a step with more running requests than this: a large batch already fills the
    # device, and the draft positions would cost more compute than the passes they save (8: the
    # largest batch that gained in every workload measured; None: never stops)
    disable_by_batch_size: int | None = 8
    # "adaptive": a request's next draft is twice its last when that was kept whole, else one
    # more than the tokens kept (a miss costs one position, a copied span grows to the cap);
    # "fixed" (the plain twin) always drafts up to num_speculative_tokens
    draft_length: str = "adaptive"

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative.method: {self.method!r} is not one of {SPECULATIVE_METHODS}"
            )
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("speculative.num_speculative_tokens: 1 to 32")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError(
                "speculative.prompt_lookup_min/max: need 1 <= prompt_lookup_min <= "
                "prompt_lookup_max <= 64"
            )
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(
                f"speculative.draft_length: {self.draft_length!r} is not one of {DRAFT_LENGTHS}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative.disable_by_batch_size: a positive count or None")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative: a dict of vLLM's keys or None, got {value!r}")
        unknown = sorted(set(value) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise ValueError(f"speculative: unknown keys {unknown}")
        return cls(**value)


@dataclass(frozen=True, kw_only=True)
class SpeculationConfig:
    # Speculative decoding (services/engine/speculative.py), vLLM's keys: {"method": "ngram",
    # "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M}; on by
    # default ({}: SpeculativeConfig's measured defaults). None: the plain twin, one token per
    # request per forward pass. Greedy tokens are the plain twin's by construction, sampled ones
    # follow the same distribution (sampler.accept_or_resample).
    speculative: dict[str, Any] | None = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.speculative_config()  # a bad key or value fails at start-up

    def speculative_config(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative)


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LoRA adapters on the base model (services/lora): vLLM's names and meanings."""

    enable_lora: bool = False
    max_loras: int = 1  # adapters in the slots at once (rows of that many in one step)
    max_lora_rank: int = 16  # slots are this wide: a higher-rank adapter is refused
    max_cpu_loras: int | None = None  # parked in host memory; None: max_loras
    max_lora_bytes: int = 256 << 20  # an adapter's weights file
    # every slot's deltas in two products a target (services/lora/layers.py); False: a loop
    # over the step's adapters (the plain twin)
    lora_stacked: bool = True

    def _check_lora(self) -> None:
        if self.max_loras < 1 or not 1 <= self.max_lora_rank <= 512:
            raise ValueError("max_loras: >= 1; max_lora_rank: 1 to 512")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras: at least max_loras")


@dataclass(frozen=True, kw_only=True)
class EngineConfig(
    RunnerConfig,
    CacheConfig,
    SchedulingConfig,
    GrammarConfig,
    SandboxConfig,
    SpeculationConfig,
    LoRAConfig,
):
    """Every group at once, in the flat keyword form (see the module's doc)."""

    def __post_init__(self) -> None:
        self._check_runner()
        self._check_cache()
        self._check_scheduling()
        self._check_grammar()
        self._check_sandbox()
        self._check_lora()
        self.speculative_config()

    # The groups, each a view of this one config (no copy: every field lives here once).
    @property
    def runner(self) -> RunnerConfig:
        return self

    @property
    def cache(self) -> CacheConfig:
        return self

    @property
    def scheduling(self) -> SchedulingConfig:
        return self

    @property
    def grammar(self) -> GrammarConfig:
        return self

    @property
    def sandbox(self) -> SandboxConfig:
        return self

    @property
    def speculation(self) -> SpeculationConfig:
        return self
