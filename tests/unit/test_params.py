import pytest
from pydantic import ValidationError

from kvcache.policy_spec import KV_KINDS
from services import KVPolicy, SamplingParams, StructuredOutput


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ["x" * 1025]}, "stop"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
        ({"min_p": 1.5}, "min_p"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_is_normalised_to_a_tuple():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[5]).stop_token_ids == (5,)
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-39).greedy and not SamplingParams(temperature=1e-4).greedy


def test_structured_output_needs_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a+", choice=["x"])
    assert StructuredOutput(choice=["yes", "no"]).kind == "choice"


def test_kv_policy_validation():
    with pytest.raises(ValueError, match="kind"):
        KVPolicy(kind="lru")
    with pytest.raises(ValueError, match="offload"):
        KVPolicy(kind="window", offload=True)
    assert KVPolicy(kind="quest", offload=True, budget_tokens=256).offload


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "sinks", "budget_tokens": 4, "n_sink": 4}, "kv.budget_tokens"),
        ({"kind": "snapkv", "budget_tokens": 16, "window": 32}, "kv.budget_tokens"),
        ({"kind": "h2o", "heavy_ratio": 1.5}, "kv.heavy_ratio"),
        ({"kind": "snapkv", "kernel_size": 4}, "kv.kernel_size"),
        ({"kind": "quest", "rerotate": True}, "kv.rerotate"),
        ({"kind": "quest", "dense_layers": -1}, "kv.dense_layers"),
        ({"kind": "window", "window": 0}, "kv.window"),
    ],
)
def test_bad_kv_policies_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KVPolicy(**kwargs)


def test_kinds_are_the_registered_policies_and_the_policy_table_covers_them():
    from kvcache.policies import POLICIES
    from tests.integration.test_kv_policies import POLICIES as TABLE

    assert tuple(POLICIES) == KV_KINDS
    # `full` is the reference every row of the table is compared with
    assert {p.kind for p in TABLE.values()} | {"full"} == set(KV_KINDS)
    assert all(KVPolicy(kind=k).bounded == POLICIES[k].bounded for k in KV_KINDS)


def test_kv_policy_budgets_default_from_the_window():
    assert KVPolicy(kind="window", window=100).budget == 100
    assert KVPolicy(kind="sinks", window=100, n_sink=4).budget == 104
    assert KVPolicy(kind="snapkv", budget_tokens=64).observe_window == 32
    assert KVPolicy(kind="quest").budget == 1024 and not KVPolicy(kind="quest").bounded
    assert KVPolicy(kind="h2o").bounded


def test_http_kv_policy_reaches_the_engine_or_names_the_field():
    from deployments.protocol import BadRequest, CompletionRequest
    from deployments.translate import sampling_from

    body = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": "x",
            "kv_policy": {"kind": "sinks", "window": 60, "rerotate": True},
        }
    )
    kv = sampling_from(body, 100).kv
    assert kv is not None and kv.kind == "sinks" and kv.budget == 64 and kv.rerotate
    bad = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": "x",
            "kv_policy": {
                "kind": "window",
                "rerotate": False,
                "n_sink": 0,
                "budget_tokens": 8,
                "kernel_size": 2,
            },
        }
    )
    with pytest.raises(BadRequest) as err:
        sampling_from(bad, 100)
    assert err.value.param == "kv_policy.kernel_size"
    assert str(err.value).startswith("kv_policy.kernel_size: must be odd")
    unknown = {"model": "m", "prompt": "x", "kv_policy": {"kind": "lru"}}
    with pytest.raises(ValidationError, match=", ".join(KV_KINDS)):  # the legal values, listed
        CompletionRequest.model_validate(unknown)


@pytest.mark.parametrize("status", [400, 429])
def test_a_replicas_kv_refusal_names_the_body_field(status):
    """The engine names `kv.*` (SamplingParams.kv); over HTTP the field is `kv_policy.*`."""
    from deployments.answers import engine_refusal
    from deployments.wire import Delta

    err = engine_refusal(Delta.refusal("kv.offload: no host room", status))
    assert (err.status, err.param, str(err)) == (
        status,
        "kv_policy.offload",
        "kv_policy.offload: no host room",
    )
    assert err.reason == ("kv_tier_full" if status == 429 else None)
    other = engine_refusal(Delta.refusal("max_tokens: too many", 400))
    assert other.param == "max_tokens"
