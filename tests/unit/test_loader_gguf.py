"""A `.gguf` model path is converted once into the cache and loaded from there; anything else that
is not a model folder is refused naming both accepted forms."""

from __future__ import annotations

import pytest

from services.models import loader


def test_a_gguf_file_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STRUCTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny-model.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def convert(src, out_dir):
        calls.append(src)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "_convert_gguf", convert)
    name, folder = loader.resolve_model_dir(str(gguf))
    assert name == "tiny-model" and (folder / "config.json").is_file()
    assert folder.is_relative_to(tmp_path / "cache")
    assert loader.resolve_model_dir(str(gguf)) == (name, folder) and calls == [gguf]


def test_a_path_that_is_no_model_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"folder or a \.gguf file"):
        loader.resolve_model_dir(str(tmp_path / "nothing"))
