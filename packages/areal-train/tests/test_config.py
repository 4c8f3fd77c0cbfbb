"""areal_train.config: YAML + overrides -> dataclasses, one-line errors, redacted saves."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from areal_train.config import (
    REDACTED,
    ConfigError,
    GRPOConfig,
    SFTConfig,
    is_secret,
    load_expr_config,
    log_dir,
    redact,
    save_config,
    split_argv,
)

BASE = """\
experiment_name: exp
trial_name: t0
cluster:
  fileroot: {root}
actor:
  path: models/tiny-random
  optimizer:
    lr: 0.01
rollout:
  admin_api_key: sk-Admin1234567890
grpo:
  group_size: 4
"""


@pytest.fixture
def yaml_file(tmp_path: Path) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(BASE.format(root=tmp_path / "runs"))
    return p


def load(path: Path, *overrides: str, cls: type = GRPOConfig, save: bool = False):
    return load_expr_config(["--config", str(path), *overrides], cls, save=save)


def error(path: Path | None, *overrides: str, cls: type = GRPOConfig) -> str:
    argv = (["--config", str(path)] if path else []) + list(overrides)
    with pytest.raises(ConfigError) as e:
        load_expr_config(argv, cls, save=False)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------ precedence


def test_defaults_yaml_overrides_precedence(yaml_file: Path) -> None:
    cfg, extras = load(yaml_file)
    assert cfg.actor.optimizer.lr == 0.01  # YAML over default (1e-3)
    assert cfg.grpo.group_size == 4
    assert cfg.grpo.eps_clip == 0.2  # default
    assert cfg.seed == 1
    assert extras == []

    cfg, _ = load(yaml_file, "actor.optimizer.lr=5e-6", "grpo.group_size=8", "seed=3")
    assert cfg.actor.optimizer.lr == 5e-6
    assert isinstance(cfg.actor.optimizer.lr, float)
    assert cfg.grpo.group_size == 8
    assert cfg.seed == 3


def test_later_override_wins(yaml_file: Path) -> None:
    cfg, _ = load(yaml_file, "seed=3", "seed=4")
    assert cfg.seed == 4


def test_brief_examples(yaml_file: Path) -> None:
    cfg, _ = load(
        yaml_file,
        "experiment_name=my_run",
        "trial_name=t1",
        "cluster.n_nodes=4",
        "cluster.n_gpus_per_node=8",
        "actor.optimizer.lr=5e-6",
        "total_train_epochs=20",
        "rollout.backend=sglang:d2p1t2",
        "rollout.max_concurrent_rollouts=128",
        "train_dataset.batch_size=256",
    )
    assert (cfg.experiment_name, cfg.trial_name) == ("my_run", "t1")
    assert (cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node) == (4, 8)
    assert cfg.rollout.backend == "sglang:d2p1t2"
    assert cfg.rollout.max_concurrent_rollouts == 128
    assert cfg.train_dataset.batch_size == 256
    assert cfg.total_train_epochs == 20


def test_string_fields_keep_raw_text(yaml_file: Path) -> None:
    cfg, _ = load(yaml_file, "trial_name=001", "rollout.model_name=1e3")
    assert cfg.trial_name == "001"
    assert cfg.rollout.model_name == "1e3"


def test_values_parsed_like_hydra(yaml_file: Path) -> None:
    cfg, _ = load(
        yaml_file,
        "total_train_steps=null",
        "grpo.adv_norm_std=false",
        "+extra.items=[1, 2]",
        "+extra.name='quoted'",
        "+extra.nested={a: 1}",
    )
    assert cfg.total_train_steps is None
    assert cfg.grpo.adv_norm_std is False
    assert cfg.extra == {"items": [1, 2], "name": "quoted", "nested": {"a": 1}}


def test_section_override_merges(yaml_file: Path) -> None:
    cfg, _ = load(yaml_file, "actor.optimizer={lr: 0.5}", "valid_dataset={batch_size: 2}")
    assert cfg.actor.optimizer.lr == 0.5
    assert cfg.actor.optimizer.beta1 == 0.9
    assert cfg.valid_dataset is not None and cfg.valid_dataset.batch_size == 2


def test_extras_are_returned(yaml_file: Path) -> None:
    cfg, extras = load(yaml_file, "--dry-run", "seed=2", "--flag=x", "word")
    assert extras == ["--dry-run", "--flag=x", "word"]
    assert cfg.seed == 2


def test_split_argv() -> None:
    assert split_argv(["--config=a.yaml", "x=1", "~y", "+z=2", "-v"]) == (
        "a.yaml",
        ["x=1", "~y", "+z=2"],
        ["-v"],
    )
    with pytest.raises(ConfigError, match="--config needs a YAML path"):
        split_argv(["--config"])


def test_no_config_file_overrides_only() -> None:
    cfg, _ = load_expr_config(
        ["experiment_name=e", "trial_name=t", "actor.path=m"], SFTConfig, save=False
    )
    assert isinstance(cfg, SFTConfig)
    assert cfg.actor.path == "m"


def test_interpolation(yaml_file: Path) -> None:
    cfg, _ = load(yaml_file, "+extra.copy=${seed}", "seed=7")
    assert cfg.extra["copy"] == 7


# ------------------------------------------------------------------ + and ~


def test_plus_adds_only_under_free_mappings(yaml_file: Path) -> None:
    cfg, _ = load(yaml_file, "+extra.foo=1", "+rollout.extra.bar=x", "+train_dataset.extra.n=3")
    assert cfg.extra == {"foo": 1}
    assert cfg.rollout.extra == {"bar": "x"}
    assert cfg.train_dataset.extra == {"n": 3}

    msg = error(yaml_file, "+actor.foo=1")
    assert msg == (
        "cannot add 'actor.foo': 'actor' has a fixed set of keys (only free-form mappings "
        "such as 'extra' take new keys) (override '+actor.foo=1')"
    )
    assert error(yaml_file, "+seed=2") == (
        "'seed' already exists; set it with seed=... (override '+seed=2')"
    )
    assert error(yaml_file, "+extra.a=1", "+extra.a=2") == (
        "'extra.a' already exists; set it with extra.a=... or ++extra.a=... (override '+extra.a=2')"
    )
    assert error(yaml_file, "extra.a=1") == (
        "'extra.a' does not exist; add it with +extra.a=... (override 'extra.a=1')"
    )


def test_plus_plus_upserts(yaml_file: Path) -> None:
    cfg, _ = load(yaml_file, "++extra.a=1", "++extra.a=2", "++seed=9")
    assert cfg.extra == {"a": 2}
    assert cfg.seed == 9


def test_tilde_resets_schema_key_to_default(yaml_file: Path) -> None:
    cfg, _ = load(yaml_file, "~actor.optimizer.lr", "~grpo.group_size")
    assert cfg.actor.optimizer.lr == 1e-3
    assert cfg.grpo.group_size == 8


def test_tilde_removes_free_key(yaml_file: Path) -> None:
    cfg, _ = load(yaml_file, "+extra.a=1", "+extra.b=2", "~extra.a")
    assert cfg.extra == {"b": 2}
    cfg, _ = load(yaml_file, "+extra.a=1", "~extra.a=1")
    assert cfg.extra == {}
    assert error(yaml_file, "+extra.a=1", "~extra.a=2") == (
        "cannot drop 'extra.a': its value is 1, not 2 (override '~extra.a=2')"
    )
    assert error(yaml_file, "~extra.zzz") == (
        "cannot drop 'extra.zzz': it is not set (override '~extra.zzz')"
    )


def test_tilde_on_required_key_makes_it_missing(yaml_file: Path) -> None:
    assert error(yaml_file, "~experiment_name") == (
        "'experiment_name' is required: set it in the YAML or pass experiment_name=..."
    )


# ------------------------------------------------------------------ errors


def test_unknown_key_in_yaml_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("experiment_name: e\ntrial_name: t\nactor:\n  path: m\n  optimiser:\n    lr: 1\n")
    assert error(p) == (
        f"unknown key 'actor.optimiser' in {p}:5; did you mean 'actor.optimizer'? "
        "(known under 'actor': dtype, num_threads, optimizer, path, python)"
    )


def test_unknown_top_level_key_in_yaml(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("experiment_name: e\ntrial_name: t\ngrpo:\n  group_size: 4\n")
    msg = error(p, cls=SFTConfig)
    assert msg.startswith(f"unknown key 'grpo' in {p}:3 (known at the top level: actor, ")


def test_wrong_type_in_yaml(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(
        "experiment_name: e\ntrial_name: t\nactor:\n  path: m\n  optimizer:\n    lr: abc\n"
    )
    assert error(p) == f"'actor.optimizer.lr' expects a number, got 'abc' (str) (from {p}:6)"
    p.write_text("experiment_name: e\ntrial_name: t\nactor: {path: m}\ngrpo:\n  group_size: [1]\n")
    assert error(p) == f"'grpo.group_size' expects an integer, got a list (from {p}:5)"


def test_unknown_key_in_override(yaml_file: Path) -> None:
    assert error(yaml_file, "actor.optimizer.lrr=1") == (
        "unknown key 'actor.optimizer.lrr' in override 'actor.optimizer.lrr=1'; did you mean "
        "'actor.optimizer.lr'? (known under 'actor.optimizer': beta1, beta2, eps, "
        "gradient_clipping, lr, lr_scheduler_type, type, warmup_steps, "
        "warmup_steps_proportion, weight_decay)"
    )
    assert error(yaml_file, "nope.x=1").startswith(
        "unknown key 'nope' in override 'nope.x=1' (known at the top level: "
    )
    assert error(yaml_file, "valid_dataset={batch_sze: 2}").startswith(
        "unknown key 'valid_dataset.batch_sze' in override 'valid_dataset={batch_sze: 2}'; "
        "did you mean 'valid_dataset.batch_size'?"
    )


def test_wrong_type_in_override(yaml_file: Path) -> None:
    assert error(yaml_file, "actor.optimizer.lr=abc") == (
        "'actor.optimizer.lr' expects a number, got 'abc' (str) "
        "(from override 'actor.optimizer.lr=abc')"
    )
    assert error(yaml_file, "total_train_steps=1.5") == (
        "'total_train_steps' expects an integer or null, got 1.5 (float) "
        "(from override 'total_train_steps=1.5')"
    )
    assert error(yaml_file, "grpo.adv_norm_std=maybe") == (
        "'grpo.adv_norm_std' expects true/false, got 'maybe' (str) "
        "(from override 'grpo.adv_norm_std=maybe')"
    )
    assert error(yaml_file, "actor=1") == (
        "'actor' expects a mapping (section), got 1 (int) (from override 'actor=1')"
    )


def test_bad_value(yaml_file: Path) -> None:
    assert error(yaml_file, "grpo.group_size=1") == (
        "'grpo.group_size' must be >= 2 (group-normalised advantages need two samples) "
        "(from override 'grpo.group_size=1')"
    )
    assert error(yaml_file, "rollout.backend=foo").startswith(
        "'rollout.backend' must be sglang|vllm ':' then d<N>, t<N>, p<N>"
    )
    assert error(yaml_file, "trial_name=a/b").startswith("'trial_name' must be a plain name")
    assert error(yaml_file, "~actor.path") == (
        "'actor.path' is required (a model folder) (from override '~actor.path')"
    )


def test_bad_value_from_yaml_names_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("experiment_name: e\ntrial_name: t\nactor: {path: m}\ngrpo:\n  temperature: 0\n")
    assert error(p) == f"'grpo.temperature' must be > 0 (GRPO samples) (from {p}:5)"


def test_missing_required(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("actor: {path: m}\n")
    assert error(p) == (
        "'experiment_name' is required: set it in the YAML or pass experiment_name=... "
        "(also missing: trial_name)"
    )


def test_yaml_problems(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("experiment_name: e\nseed: 1\nseed: 2\n")
    assert error(p) == f"duplicate key 'seed' in {p}:3"
    p.write_text("experiment_name: e\nactor: {path: m\n")
    assert error(p).startswith(f"cannot parse {p}:")
    p.write_text("- 1\n- 2\n")
    assert error(p) == f"{p} must hold a mapping of config keys, not a list"
    assert error(tmp_path / "nope.yaml") == (
        f"cannot read config file {tmp_path / 'nope.yaml'}: No such file or directory"
    )


def test_interpolation_error(yaml_file: Path) -> None:
    assert error(yaml_file, "actor.path=${nope}") == (
        "'actor.path' cannot be resolved: Interpolation key 'nope' not found "
        "(from override 'actor.path=${nope}')"
    )


def test_config_error_is_one_line() -> None:
    assert str(ConfigError("a\n  b\tc")) == "a b c"


@dataclass
class Task:
    max_operand: int = 9


@dataclass
class MyConfig(GRPOConfig):
    task: Task = field(default_factory=Task)


def test_custom_schema_subclass() -> None:
    cfg, _ = load_expr_config(
        ["experiment_name=e", "trial_name=t", "actor.path=m", "task.max_operand=4"],
        MyConfig,
        save=False,
    )
    assert cfg.task.max_operand == 4
    with pytest.raises(ConfigError, match=r"'task\.max_operand' expects an integer"):
        load_expr_config(
            ["experiment_name=e", "trial_name=t", "actor.path=m", "task.max_operand=x"],
            MyConfig,
            save=False,
        )


# ------------------------------------------------------------------ warmup


def test_warmup_both_set_warns_and_steps_win(yaml_file: Path) -> None:
    with pytest.warns(UserWarning, match="warmup_steps wins"):
        cfg, _ = load(
            yaml_file,
            "actor.optimizer.warmup_steps=5",
            "actor.optimizer.warmup_steps_proportion=0.5",
        )
    assert cfg.actor.optimizer.resolved_warmup_steps(100) == 5


def test_warmup_one_setting_no_warning(yaml_file: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg, _ = load(yaml_file, "actor.optimizer.warmup_steps_proportion=0.1")
    assert cfg.actor.optimizer.resolved_warmup_steps(50) == 5
    cfg, _ = load(yaml_file)
    assert cfg.actor.optimizer.resolved_warmup_steps(50) == 0


# ------------------------------------------------------------------ saving


def test_saved_where_and_how(yaml_file: Path, tmp_path: Path) -> None:
    cfg, _ = load(yaml_file, "trial_name=t9", save=True)
    out = tmp_path / "runs" / "exp" / "t9" / "config.yaml"
    assert log_dir(cfg) == out.parent
    assert out.is_file()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    saved = yaml.safe_load(out.read_text())
    assert saved["trial_name"] == "t9"
    assert saved["grpo"]["group_size"] == 4
    assert saved["rollout"]["admin_api_key"] == REDACTED
    assert "sk-Admin1234567890" not in out.read_text()
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]  # no temp file left


def test_default_fileroot_is_runs_in_cwd(
    yaml_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg, _ = load(yaml_file, "cluster.fileroot=", save=True)
    assert log_dir(cfg) == tmp_path / "runs" / "exp" / "t0"
    assert (tmp_path / "runs" / "exp" / "t0" / "config.yaml").is_file()


def test_save_overwrites_with_0600(yaml_file: Path, tmp_path: Path) -> None:
    cfg, _ = load(yaml_file)
    out = tmp_path / "x" / "c.yaml"
    out.parent.mkdir()
    out.write_text("old")
    os.chmod(out, 0o644)
    save_config(cfg, out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert "old" not in out.read_text()


@pytest.mark.parametrize(
    ("key", "value", "secret"),
    [
        ("api_key", "anything", True),
        ("admin_api_key", "areal-admin-key", True),
        ("hf_token", "hf_xyz", True),
        ("client_secret", "abc", True),
        ("password", "hunter2", True),
        ("Authorization", "Bearer x", True),
        ("private_key", "-----BEGIN", True),
        ("wandb_key", "a1b2c3d4e5f6", True),
        ("sort_key", "created_at", False),
        ("cache_key", "prompt", False),
        ("api_key", "", False),
        ("max_new_tokens", 16, False),
        ("model_name", "sk-Abc123456", False),
    ],
)
def test_is_secret(key: str, value: object, secret: bool) -> None:
    assert is_secret(key, value) is secret


def test_redact_nested_and_urls() -> None:
    data = {
        "rollout": {"admin_api_key": "k", "extra": {"db_password": "p", "n": 1}},
        "list": [{"token": "t"}],
        "url": "http://user:pw@127.0.0.1:80/x",
        "plain": "value",
    }
    assert redact(data) == {
        "rollout": {"admin_api_key": REDACTED, "extra": {"db_password": REDACTED, "n": 1}},
        "list": [{"token": REDACTED}],
        "url": f"http://user:{REDACTED}@127.0.0.1:80/x",
        "plain": "value",
    }


def test_redacted_extra_keys_saved(yaml_file: Path, tmp_path: Path) -> None:
    cfg, _ = load(yaml_file, "+extra.wandb_api_key=Secret123", save=True)
    text = (log_dir(cfg) / "config.yaml").read_text()
    assert "Secret123" not in text
    assert cfg.extra["wandb_api_key"] == "Secret123"  # only the saved copy is redacted


# ------------------------------------------------------------------ no torch


def test_import_does_not_pull_torch() -> None:
    code = (
        "import sys, areal_train.config as c; "
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ""


def test_importtime_lists_no_torch() -> None:
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import areal_train.config"],
        capture_output=True,
        text=True,
        check=True,
    )
    modules = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines()}
    assert "areal_train.config" in modules
    assert not {m for m in modules if m.split(".")[0] in ("torch", "transformers")}
