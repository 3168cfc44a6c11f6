"""How a served model writes its thinking and its tool calls: its dialect, one list of them.

A dialect names one of xgrammar's builtin model styles (`get_model_structural_tag`: the
reasoning block, free text and the family's call format as one structural tag), or `hermes`
(Qwen2.5/Hermes `<tool_call>` JSON without thinking, which is `qwen_3`'s calls alone), or
`none`. `auto` detects it from the chat template (`detect`). A request's answer is constrained
by the dialect's tag (`tag_for`) and read back by walking the same tag (split.py), whole or as
it streams (`Splitter`), so both give the same message.
"""

from __future__ import annotations

# Styles whose arguments split.py reads back (JSON, Qwen XML, GLM XML); others are refused at
# start-up by name rather than served with calls we could not parse
BUILTIN = (
    "llama",
    "qwen_3",
    "qwen_3_5",
    "qwen_3_coder",
    "deepseek_r1",
    "deepseek_v3_1",
    "harmony",
    "kimi",
    "glm_4_7",
    "exaone",
    "mimo",
)
DIALECTS = ("auto", "hermes", "none", *BUILTIN)

# What a chat template writes, in the order tried: the first found names the dialect
_SIGNS = (
    ("<|channel|>", "harmony", "writes harmony channels (<|channel|>)"),
    ("function<｜tool▁sep｜>", "deepseek_r1", "writes DeepSeek-R1 calls (function<｜tool▁sep｜>)"),
    (
        "<｜tool▁calls▁begin｜>",
        "deepseek_v3_1",
        "writes DeepSeek-V3.1 calls (<｜tool▁calls▁begin｜>)",
    ),
    ("<|tool_calls_section_begin|>", "kimi", "writes Kimi calls (<|tool_calls_section_begin|>)"),
    ("<arg_key>", "glm_4_7", "writes GLM XML arguments (<arg_key>)"),
    ("<parameter=", "qwen_3_coder", "writes Qwen XML arguments (<parameter=)"),
    ("<|python_tag|>", "llama", "writes Llama 3 calls (<|python_tag|>)"),
)


def check(name: str, field_name: str = "tool_call_format") -> str:
    """`name` when it is a dialect; else ValueError listing them (at start-up)."""
    if name not in DIALECTS:
        raise ValueError(f"{field_name}: unknown dialect {name!r}; one of {', '.join(DIALECTS)}")
    return name


def detect(template: str | None) -> tuple[str, str]:
    """The dialect a chat template teaches, and why (for the start-up log)."""
    text = template or ""
    for sign, name, why in _SIGNS:
        if sign in text:
            return name, f"the chat template {why}"
    if "<tool_call>" in text:
        if "<think>" in text:
            return "qwen_3", "the chat template writes <tool_call> and <think>"
        return "hermes", "the chat template writes <tool_call>"
    return "hermes", "the chat template writes no call format we know: ours, in the system prompt"


def thinks(template: str | None) -> bool:
    """Whether the template has a thinking block (its answers may open with one)."""
    text = template or ""
    # harmony always may: its analysis channel is one of the channels every answer has
    return any(m in text for m in ("<think>", "<|channel|>", "◁think▷", "thought\n"))


from services.dialects.answer import Answer, Call, Splitter, split  # noqa: E402
from services.dialects.tags import answer_tag, markers, reasoning_mode, tag_for  # noqa: E402

__all__ = [
    "BUILTIN",
    "DIALECTS",
    "Answer",
    "Call",
    "Splitter",
    "answer_tag",
    "check",
    "detect",
    "markers",
    "reasoning_mode",
    "split",
    "tag_for",
    "thinks",
]
