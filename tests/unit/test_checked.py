"""Checked decoding's pieces: where a failing value starts in the output, and the token a
return excludes (services/engine/structured/checked.py)."""

from __future__ import annotations

import pytest
import torch

from services.engine.structured.checked import exclude, rollback_point, value_start

TEXT = '{"a": {"b": [1, {"c": "x"}, 3]}, "d": "e", "a2": null}'


@pytest.mark.parametrize(
    ("at", "expected"),
    [
        ([], "{"),
        (["a"], '{"b"'),
        (["a", "b", 1], '{"c"'),
        (["a", "b", 1, "c"], '"x"'),
        (["a", "b", 2], "3]"),
        (["d"], '"e"'),
        (["a2"], "null"),
        (["missing"], None),
        (["a", "b", 3], None),
        (["d", 0], None),
    ],
)
def test_the_start_of_the_value_a_path_names(at, expected):
    start = value_start(TEXT, at)
    assert (None if start is None else TEXT[start : start + len(expected)]) == expected


def test_the_last_of_duplicate_keys_is_the_one_json_loads_keeps():
    text = '{"k": 1, "k": 2}'
    assert text[value_start(text, ["k"])] == "2"


def test_a_return_excludes_the_first_token_that_chose_something(tokenizer):
    prompt = tokenizer.encode("JSON: ", add_special_tokens=False)
    text = '{"name": "Alice", "age": 25}'
    output = tokenizer.encode(text, add_special_tokens=False)
    back = rollback_point(tokenizer, prompt, output, text, value_start(text, ["name"]))
    assert back is not None
    assert tokenizer.decode(output[: back.keep]) in ('{"name": "', '{"name":')
    assert "Alice"[:2] in tokenizer.decode([back.token])


def test_excluding_every_allowed_token_leaves_nothing_to_sample():
    row = torch.full((8,), float("-inf"))
    row[[2, 5]] = 0.0
    assert exclude({3: {2}}, 3, row) and row[2] == float("-inf") and row[5] == 0.0
    assert exclude({}, 3, row)
    assert not exclude({4: {5}}, 4, row)
