import pytest

from services import KVPolicy, SamplingParams, StructuredOutput


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_is_normalised_to_a_tuple():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[5]).stop_token_ids == (5,)
    assert SamplingParams(temperature=0).greedy


def test_structured_output_needs_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a+", choice=["x"])
    assert StructuredOutput(choice=["yes", "no"]).kind == "choice"


def test_kv_policy_validation():
    with pytest.raises(ValueError, match="kind"):
        KVPolicy(kind="lru")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="offload"):
        KVPolicy(kind="window", offload=True)
    assert KVPolicy(kind="quest", offload=True, budget_tokens=256).offload
