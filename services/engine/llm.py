"""`LLM`: the offline facade. `LLM().generate(prompts, params)` runs a batch to completion."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine, Prompt
from services.engine.params import RequestOutput, SamplingParams
from services.grammar.provider import GrammarProvider, ProviderFactory
from services.models import LoadedModel


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        loaded: LoadedModel | None = None,
        grammar_provider: GrammarProvider | ProviderFactory | None = None,
        **engine_kwargs: Any,
    ):
        config = EngineConfig(model=model, **engine_kwargs)
        self.engine = LLMEngine(config, loaded, grammar_provider)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. `prompts`: strings or token-id lists (a single one is fine)."""
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
        engine = self.engine
        reqs = [engine.add_request(p, sp) for p, sp in zip(batch, params, strict=True)]
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
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        convs = (
            [conversations]
            if conversations and isinstance(conversations[0], dict)
            else conversations
        )
        prompts = [self.engine.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params)
