"""Serving processes freeze their start-up objects out of the collector's reach
(services/engine/gc_freeze.py): a full collection then no longer walks the model's and the
libraries' objects; the plain twin (`freeze_gc=False`) leaves the collector alone."""

from __future__ import annotations

import gc

from services.engine.config import EngineConfig
from services.engine.gc_freeze import freeze_startup_objects


def test_freezing_takes_the_start_up_objects_out_of_a_full_collection():
    assert EngineConfig().freeze_gc is True  # on by default
    before = gc.get_freeze_count()
    assert freeze_startup_objects(False) == 0 and gc.get_freeze_count() == before  # the twin
    ballast = [{"n": [i]} for i in range(300_000)]  # a process's long-lived objects
    try:
        assert any(o is ballast[0] for o in gc.get_objects())  # walked by a full collection
        frozen = freeze_startup_objects(True)
        assert frozen >= len(ballast)
        assert not any(o is ballast[0] for o in gc.get_objects())  # no longer walked
        gc.collect()
        assert ballast[-1] == {"n": [299_999]}  # nothing alive was touched
    finally:
        gc.unfreeze()
