"""The client libraries platform teams already use, unchanged, against the real server:
instructor (TOOLS and JSON_SCHEMA modes), LangChain's `with_structured_output` (function calling
and JSON schema) and a pydantic-ai agent that calls a tool and answers."""

from __future__ import annotations

import asyncio

import instructor
import openai
import pytest
from e2e_support import KEY_A
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

MODEL = "SmolLM2-135M-Instruct"
ASK = "Paris is in France. Give the city and its country."


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"{server}/v1"


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(base_url, mode):
    raw = openai.OpenAI(base_url=base_url, api_key=KEY_A, max_retries=0, timeout=120)
    client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    city = client.chat.completions.create(
        model=MODEL,
        response_model=City,
        messages=[{"role": "user", "content": ASK}],
        max_tokens=80,
        temperature=0,
        max_retries=0,  # the first answer must already validate
    )
    assert isinstance(city, City) and city.name


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(base_url, method):
    llm = ChatOpenAI(
        model=MODEL, base_url=base_url, api_key=KEY_A, temperature=0, max_tokens=80, max_retries=0
    )
    city = llm.with_structured_output(City, method=method).invoke(ASK)
    assert isinstance(city, City) and city.name


def test_pydantic_ai_agent_calls_a_tool_and_answers(base_url):
    class CallFirst(AbstractCapability):
        """The documented way to force a tool on the first step only (a 135M model left to
        itself rarely calls); then the agent must answer in text."""

        def get_model_settings(self):
            return lambda ctx: {"tool_choice": ["population"] if ctx.run_step <= 1 else "none"}

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key=KEY_A))
    agent = Agent(
        model,
        capabilities=[CallFirst()],
        model_settings={"temperature": 0, "max_tokens": 40},
    )
    seen = []

    @agent.tool
    def population(ctx: RunContext[None], city: str) -> int:
        """The population of a city."""
        seen.append(city)
        return 2_100_000

    result = asyncio.run(agent.run("How many people live in Paris?"))
    parts = [p for m in result.all_messages() for p in m.parts]
    assert seen and any(isinstance(p, ToolCallPart) and p.tool_name == "population" for p in parts)
    assert any(isinstance(p, ToolReturnPart) for p in parts)
    assert isinstance(result.output, str) and result.output


def test_the_readmes_parse_example_as_pasted(base_url):
    """The README's `parse` example, run as a newcomer pastes it (no max_tokens, the default
    temperature): it must come back parsed."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if ".parse(" in b]
    assert "max_tokens" not in code
    code = code.replace("http://127.0.0.1:8000/v1", base_url)
    code = code.replace("the key serve printed", KEY_A)
    scope: dict = {"__name__": "readme"}
    exec(compile(code, "README.md", "exec"), scope)
    parsed = scope["out"].choices[0].message.parsed
    assert isinstance(parsed, scope["City"]) and isinstance(parsed.population, int)
