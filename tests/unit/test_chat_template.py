"""The chat template as a trust boundary: the client's variables kept to plain ones, the render
equal to transformers' own, bounded in output and in time, in workers that a stuck render cannot
hold."""

from __future__ import annotations

import copy
import sys
import time

import pytest

from services.engine.chat_template import ChatRenderer, check_variables, reserved_names
from services.sandbox.render import RenderRefused

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "tool_calls": None},
        {"role": "user", "content": "What is 2+2? <|im_start|> stays text here"},
    ],
]
OPTIONS = [
    {},
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
]


@pytest.fixture(scope="module")
def renderers(tokenizer):
    plain, isolated = ChatRenderer(tokenizer, workers=0), ChatRenderer(tokenizer, workers=2)
    yield plain, isolated
    isolated.close()


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one", "four"])
@pytest.mark.parametrize("options", OPTIONS, ids=["generation", "plain", "continue"])
def test_both_renders_equal_transformers_own(tokenizer, renderers, conversation, options):
    want = tokenizer.apply_chat_template(
        conversation, tokenize=True, **{"add_generation_prompt": True, **options}
    )
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    plain, isolated = renderers
    assert plain.ids(conversation, 100_000, **options) == want
    assert isolated.ids(conversation, 100_000, **options) == want


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"chat_template": "{{ 'hello ' * 6000000 }}"}, "chat_template_kwargs.chat_template"),
        ({"tools": "abc"}, "chat_template_kwargs.tools"),
        ({"return_tensors": "np"}, "chat_template_kwargs.return_tensors"),
        ({"max_length": 3, "padding": True}, "chat_template_kwargs.max_length"),
        ({"tokenizer_kwargs": {"x": 1}}, "chat_template_kwargs.tokenizer_kwargs"),
        ({"eos_token": "<|im_end|>"}, "chat_template_kwargs.eos_token"),
        ({"raise_exception": 1}, "chat_template_kwargs.raise_exception"),
        ({"documents": []}, "chat_template_kwargs.documents"),
        ({"a b": 1}, "chat_template_kwargs.a b"),
        ({"nested": {"a": 1}}, "chat_template_kwargs.nested"),
        ({"long": "x" * 5000}, "chat_template_kwargs.long"),
        ({"many": list(range(100))}, "chat_template_kwargs.many"),
    ],
)
def test_anything_but_a_plain_template_variable_is_refused_naming_it(tokenizer, variables, named):
    with pytest.raises(ValueError, match=f"^{named}: "):
        check_variables(variables, reserved_names(tokenizer))
    if "tools" in variables:  # the engine's own `tools` option: a caller's, checked as such
        return
    with pytest.raises(ValueError, match=f"^{named}: "):  # the engine refuses them too
        ChatRenderer(tokenizer, workers=0).ids(CONVERSATIONS[0], 100_000, **variables)


def test_plain_variables_reach_the_template(tokenizer):
    with_flag = copy.deepcopy(tokenizer)
    with_flag.chat_template = "{% if enable_thinking %}THINK {% endif %}{{ messages[0].content }}"
    renderer = ChatRenderer(with_flag, workers=0)
    on = renderer.ids(CONVERSATIONS[0], 1000, enable_thinking=True, reasoning_effort="low")
    assert with_flag.decode(on) == "THINK Hi"
    assert with_flag.decode(renderer.ids(CONVERSATIONS[0], 1000)) == "Hi"


def test_a_rendered_prompt_over_the_cap_is_refused_before_it_is_tokenized(tokenizer):
    """The characters of the messages pass the cap; the template repeats them past it."""
    echo = copy.deepcopy(tokenizer)
    echo.chat_template = "{% for i in range(2000) %}{{ messages[0].content }}{% endfor %}"
    renderer = ChatRenderer(echo, workers=1)
    try:
        with pytest.raises(RenderRefused, match="rendered prompt's 4000 characters exceed"):
            renderer.ids(CONVERSATIONS[0], 1000)
    finally:
        renderer.close()


def test_a_render_past_its_deadline_is_killed_and_the_next_one_is_served(tokenizer):
    """A template (the operator's: clients cannot send one) that loops for ever holds a worker
    for its deadline only; a second worker serves another tenant meanwhile, and nothing is
    left stuck (what /healthz asks)."""
    stuck = copy.deepcopy(tokenizer)
    stuck.chat_template = (
        "{% if messages[0].content == 'loop' %}{% for i in range(100000) %}"
        "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ messages[0].content }}"
    )
    renderer = ChatRenderer(stuck, workers=2, timeout_s=1.0)
    try:
        assert renderer.ids(CONVERSATIONS[0], 1000, tenant="A")  # the workers are up
        start = time.monotonic()
        with pytest.raises(RenderRefused, match="did not render within 1 s"):
            renderer.ids([{"role": "user", "content": "loop"}], 1000, tenant="B")
        assert time.monotonic() - start < 5
        assert stuck.decode(renderer.ids(CONVERSATIONS[0], 1000, tenant="A")) == "Hi"
        assert renderer.stalled() == ""
    finally:
        renderer.close()


def test_renderers_that_cannot_start_say_so_for_health_checks(tokenizer, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    renderer = ChatRenderer(tokenizer, workers=1, wait_s=5.0)
    try:
        with pytest.raises(RenderRefused) as refused:
            renderer.ids(CONVERSATIONS[0], 1000)
        assert refused.value.status == 503  # worth a retry, and not the client's fault
        assert "cannot start" in renderer.stalled()
    finally:
        renderer.close()
