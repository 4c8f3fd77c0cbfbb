"""Short model names (`--model-path smollm2`) resolve to the folder scripts/setup-model.sh wrote."""

from __future__ import annotations

import pytest

from areal_cli import models
from areal_cli.config import Config
from areal_cli.errors import CLIError
from areal_cli.inf.launch import ModelOptions, resolve_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "models"


def _set_up(cache):
    folder = cache / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / models.MARKER).write_text("stamp\n")
    return folder


def test_short_name_is_the_cached_folder(cache):
    folder = _set_up(cache)
    assert models.resolve_short_name("smollm2") == str(folder)


def test_short_name_not_set_up_names_the_command(cache):
    (cache / "SmolLM2-135M-Instruct").mkdir(parents=True)  # no marker: set-up unfinished
    with pytest.raises(CLIError, match=r"scripts/setup-model.sh smollm2") as e:
        models.resolve_short_name("smollm2")
    assert e.value.code == 2


def test_other_paths_are_left_alone(cache):
    _set_up(cache)
    assert models.resolve_short_name("models/tiny-parrot") is None
    assert models.resolve_short_name("SmolLM2") is None  # names are exact


def test_an_existing_local_folder_wins(cache, tmp_path):
    _set_up(cache)
    (tmp_path / "smollm2").mkdir()  # ./smollm2 in the working directory
    assert models.resolve_short_name("smollm2") is None


def test_default_cache_is_under_xdg_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("AREAL_MODELS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert models.models_dir() == tmp_path / "areal" / "models"


def test_inf_run_model_path_takes_the_short_name(cache, tmp_path, monkeypatch):
    folder = _set_up(cache)
    py = tmp_path / "py"
    py.write_text("")
    monkeypatch.setenv("AREAL_SGLANG_PYTHON", str(py))
    spec = resolve_model(
        Config("inf", {}, []), ModelOptions(name="smol", model_path="smollm2"), "--model"
    )
    assert spec.model_path == str(folder)
    assert spec.tokenizer_path == str(folder)
