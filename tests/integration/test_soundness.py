"""The soundness counts (benchmarks/soundness.py) may only fall: every labelled instance of the
JSON-Schema-Test-Suite and of the maskbench dev set walked through each backend's grammar and the
default pipeline, and compared with `benchmarks/soundness_ratchet.json`.

When a change lowers a count, `benchmarks/soundness.py --update-ratchet` writes the new floor."""

from __future__ import annotations

import json

import pytest

from benchmarks import soundness


@pytest.fixture(scope="module")
def measured() -> dict:
    corpora = ["suite"] + (["maskbench"] if soundness.MASKBENCH.is_dir() else [])
    return soundness.run(corpora, list(soundness.PIPELINES), None)


def test_counts_never_rise_over_the_ratchet(measured):
    ratchet = json.loads(soundness.RATCHET.read_text())
    assert soundness.over_ratchet(measured, ratchet) == []
    assert set(soundness.ratchet_of(measured)) == set(ratchet)  # no pipeline left unmeasured


def test_the_default_pipeline_accepts_no_invalid_instance(measured):
    for corpus, tally in measured["totals"]["default"].items():
        assert tally["invalid"] > 100, corpus  # the corpus was read
        assert tally["invalid_accepted"] == 0, (corpus, measured["examples"]["default"][:3])


def test_a_backend_alone_is_measured_unsound_where_it_loosens():
    """The walk can fail: xgrammar alone takes `uniqueItems` violations (it loosens the keyword),
    and a check-free pipeline's counts are not zero by construction."""
    case = soundness.Case(
        "suite",
        "made",
        "uniqueItems",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        [1, 1],
        False,
    )
    walker = soundness.Walker(soundness.served_backends())
    texts = soundness.serializations(case)
    xgrammar = walker.compiled("xgrammar", case.schema)
    default = walker.compiled("default", case.schema)
    assert xgrammar is not None and default is not None
    assert walker.accepts("xgrammar", xgrammar, texts)
    assert not walker.accepts("default", default, texts)
    assert walker.accepts("default", default, ["[1, 2]"])
