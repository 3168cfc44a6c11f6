from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

from services.models import LoadedModel, load_model


@pytest.fixture(scope="session")
def loaded_model() -> LoadedModel:
    """The real default model (SmolLM2-135M-Instruct), loaded once for the whole run."""
    return load_model()


@pytest.fixture(scope="session")
def tokenizer(loaded_model: LoadedModel):  # type: ignore[no-untyped-def]
    return loaded_model.tokenizer
