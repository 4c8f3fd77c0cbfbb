"""Engine location: explicit > AREAL_<ENGINE>_PYTHON > installer cache."""

from __future__ import annotations

import pytest

from areal_cli import engines
from areal_cli.errors import CLIError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_ENGINES_DIR", str(tmp_path))
    monkeypatch.delenv("AREAL_SGLANG_PYTHON", raising=False)
    return tmp_path


def _python(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return str(path)


def test_cache_venv_is_found_with_no_configuration(cache):
    py = _python(cache / "sglang-0.5.23" / "bin" / "python")
    assert engines.resolve_python("sglang") == py


def test_env_beats_cache_and_explicit_beats_env(cache, monkeypatch):
    _python(cache / "sglang-0.5.23" / "bin" / "python")
    env_py = _python(cache / "env" / "python")
    monkeypatch.setenv("AREAL_SGLANG_PYTHON", env_py)
    assert engines.resolve_python("sglang") == env_py
    explicit = _python(cache / "explicit" / "python")
    assert engines.resolve_python("sglang", explicit) == explicit


def test_missing_engine_names_the_fix(cache):
    with pytest.raises(CLIError, match=r"install-engine.sh sglang.*AREAL_SGLANG_PYTHON"):
        engines.resolve_python("sglang")


def test_configured_path_that_does_not_exist(cache):
    with pytest.raises(CLIError, match="does not exist"):
        engines.resolve_python("sglang", str(cache / "nope" / "python"))


def test_unknown_engine():
    with pytest.raises(CLIError, match="unknown engine 'tgi'"):
        engines.resolve_python("tgi")


def test_sglang_launch_line():
    launch = engines.engine_launch(
        "sglang",
        python="/py",
        model_path="/m",
        served_name="tiny",
        host="127.0.0.1",
        port=9,
        extra_args=["--device", "cpu"],
        tensor_parallel=2,
        gpus=[2, 3],
    )
    assert launch.argv[:3] == ["/py", "-m", "sglang.launch_server"]
    assert launch.argv[-2:] == ["--device", "cpu"]
    assert "--tp-size" in launch.argv
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert launch.env["HF_HUB_OFFLINE"] == "1"
    # On a GPU too (extra_args there are not the CPU flags): the proxy reads stream deltas.
    assert "--incremental-streaming-output" in launch.argv


def test_user_engine_args_replace_defaults_of_the_same_name():
    defaults = engines.SGLANG_CPU_ARGS.split()
    user = ["--mem-fraction-static", "0.8", "--max-total-tokens=2048", "--disable-overlap-schedule"]
    merged = engines.merge_engine_args(defaults, user)
    # The user's string comes last, verbatim; every other default stays.
    assert merged[-len(user) :] == user
    kept = ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle"]
    assert merged[: -len(user)] == kept
    # `--flag=value` given by the user replaces `--flag value` of the defaults and back.
    assert engines.merge_engine_args(["--x=1", "--y", "2"], ["--x", "3"]) == [
        "--y",
        "2",
        "--x",
        "3",
    ]
    # Values that look like flags (negative numbers) stay with their flag.
    assert engines.merge_engine_args(["--seed", "-1", "--z"], ["--z"]) == ["--seed", "-1", "--z"]
    assert engines.merge_engine_args(defaults, []) == defaults


def test_launch_line_has_each_flag_once_with_the_users_value():
    launch = engines.engine_launch(
        "sglang",
        python="/py",
        model_path="/m",
        served_name="tiny",
        host="127.0.0.1",
        port=9,
        extra_args=engines.SGLANG_CPU_ARGS.split(),
        user_args=["--mem-fraction-static=0.8", "--incremental-streaming-output"],
    )
    names = [t.split("=", 1)[0] for t in launch.argv if t.startswith("--")]
    assert len(names) == len(set(names)), launch.argv
    assert "--mem-fraction-static=0.8" in launch.argv and "0.05" not in launch.argv
    assert "--device" in launch.argv and "--disable-overlap-schedule" in launch.argv


def test_flags_areal_sets_are_refused_in_engine_args():
    for engine, flag in (("sglang", "--model-path"), ("vllm", "--model"), ("vllm", "-tp")):
        with pytest.raises(CLIError) as info:
            engines.check_engine_args(engine, [flag, "x"])
        assert info.value.code == 2 and flag in str(info.value)
    engines.check_engine_args("sglang", ["--mem-fraction-static", "0.3", "--model-impl=x"])
    engines.check_engine_args("sglang", ["--host-ip-unrelated=1"])
