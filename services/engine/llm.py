"""`LLM`: the offline facade. `LLM().generate(prompts, params)` runs a batch to completion."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.engine import chat
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine, Prompt
from services.engine.params import RequestOutput, SamplingParams
from services.grammar.provider import GrammarProvider, ProviderFactory
from services.lora.manager import LoRARequest
from services.models import LoadedModel


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        loaded: LoadedModel | None = None,
        grammar_provider: GrammarProvider | ProviderFactory | None = None,
        tool_call_format: str = "auto",
        reasoning_format: str = "auto",
        **engine_kwargs: Any,
    ):
        """`tool_call_format`/`reasoning_format`: the model's dialect for `chat` (auto: its
        chat template's; services/dialects lists them)."""
        config = EngineConfig(model=model, **engine_kwargs)
        chat.check_names(tool_call_format, reasoning_format)  # before any worker starts
        self.engine = LLMEngine(config, loaded, grammar_provider)
        self.dialect = chat.resolve(self.engine.tokenizer, tool_call_format, reasoning_format)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. `prompts`: strings or token-id lists (a single one is fine).
        `lora_request`: one adapter for every prompt, or a list with one per prompt (None: the
        base model); the engine needs `enable_lora=True`."""
        batch: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"params: got {len(params)} for {len(batch)} prompts")
        loras = _per_prompt(lora_request, len(batch))
        engine = self.engine
        reqs = [
            engine.add_request(p, sp, lora=lr)
            for p, sp, lr in zip(batch, params, loras, strict=True)
        ]
        while engine.has_unfinished():
            engine.step()
        outputs = [engine.make_output(r) for r in reqs]
        for r in reqs:
            engine.release(r.request_id)
        return outputs

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = "auto",
        parallel_tool_calls: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates. Each output
        carries its answer split in the model's dialect: `reasoning_text`, `content` and
        `tool_calls` (OpenAI's `tools` and `tool_choice`: auto, required, none, or
        {"type": "function", "function": {"name": ...}})."""
        convs = (
            [conversations]
            if conversations and isinstance(conversations[0], dict)
            else conversations
        )
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(convs)
        turns = [
            chat.plan(
                self.engine,
                self.dialect,
                conv,  # type: ignore[arg-type]
                sp,
                tools,
                tool_choice,
                parallel_tool_calls,
                chat_template_kwargs,
            )
            for conv, sp in zip(convs, params, strict=True)
        ]
        outs = self.generate([t.prompt for t in turns], [t.params for t in turns], lora_request)
        return [chat.read(t, o) for t, o in zip(turns, outs, strict=True)]


def _per_prompt(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if len(lora) != n:
        raise ValueError(f"lora_request: got {len(lora)} for {n} prompts")
    return list(lora)
