"""Experiment configs: one YAML file + hydra-style overrides -> typed dataclasses.

    config, extras = load_expr_config(argv, GRPOConfig)

`argv` is what `areal train run` hands a driver: `["--config", <yaml>, *rest]`.
Each item of `rest` is one of

- `a.b=1`      set an existing key (the YAML's value, or the default, is replaced);
- `+a.b=1`     add a key that does not exist yet -- only under a free-form mapping
               (a `dict` field such as `extra` or `rollout.extra`); a fixed
               section refuses it, an existing key refuses it (use `a.b=1`);
- `++a.b=1`    set the key, adding it if needed (same places as `+`);
- `~a.b`       drop a key: a schema field goes back to its default, a free-form
               key is removed (`~a.b=1` does so only if the value is 1);
- anything else (`--flags`, bare words) is returned in `extras` for the driver.

Precedence: defaults < YAML < overrides, left to right (a later override wins).
Values are parsed like hydra's: `null`, `true`/`false`, numbers, `[..]`/`{..}`
(YAML flow), quotes for literal strings; a `str` field keeps the raw text, so
`trial_name=001` stays "001".

Every problem -- an unknown key, a wrong type, a bad value, a YAML syntax
error -- is one `ConfigError` whose str() is a single line naming the key and
where the value came from (`file.yaml:12`, `override 'a=1'`).

The resolved config is saved (secrets redacted, mode 0600) to
`<cluster.fileroot or ./runs>/<experiment_name>/<trial_name>/config.yaml`.

Nothing here imports torch: drivers run in the CLI's Python.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tempfile
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import (
    InterpolationResolutionError,
    OmegaConfBaseException,
    ValidationError,
)

from areal_train import overrides as overrides_grammar

__all__ = [
    "ActorConfig",
    "BaseExperimentConfig",
    "ClusterConfig",
    "ConfigError",
    "DatasetConfig",
    "GRPOConfig",
    "GRPOHyperparameters",
    "OptimizerConfig",
    "RolloutConfig",
    "SFTConfig",
    "SFTHyperparameters",
    "load_expr_config",
    "log_dir",
    "redact",
    "save_config",
    "to_dict",
]

REDACTED = "***"


class ConfigError(ValueError):
    """A config problem, as one line naming the key and its source."""

    def __init__(self, message: str) -> None:
        # One line, whatever went in.
        super().__init__(" ".join(str(message).split()))


# --------------------------------------------------------------------------- schema


@dataclass
class ClusterConfig:
    n_nodes: int = 1
    n_gpus_per_node: int = 0
    # Root of every experiment's folder; "" = ./runs (relative to the working directory).
    fileroot: str = ""

    def validate(self, check: _Checker) -> None:
        check("cluster.n_nodes", self.n_nodes >= 1, "must be >= 1")
        check("cluster.n_gpus_per_node", self.n_gpus_per_node >= 0, "must be >= 0")


@dataclass
class OptimizerConfig:
    type: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    # Clip the global gradient norm to this (0 = no clipping).
    gradient_clipping: float = 1.0
    lr_scheduler_type: str = "constant"
    # Warm-up as a share of all steps, or as a number of steps. When both are
    # set, warmup_steps wins (with a warning).
    warmup_steps_proportion: float | None = None
    warmup_steps: int | None = None

    def resolved_warmup_steps(self, total_steps: int) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_steps_proportion is not None:
            return int(self.warmup_steps_proportion * total_steps)
        return 0

    def validate(self, check: _Checker) -> None:
        p = "actor.optimizer"
        check(f"{p}.type", self.type in ("adamw", "adam", "sgd"), "must be adamw, adam or sgd")
        check(f"{p}.lr", self.lr > 0 and math.isfinite(self.lr), "must be a positive number")
        check(f"{p}.weight_decay", self.weight_decay >= 0, "must be >= 0")
        check(f"{p}.gradient_clipping", self.gradient_clipping >= 0, "must be >= 0")
        check(
            f"{p}.lr_scheduler_type",
            self.lr_scheduler_type in ("constant", "linear", "cosine"),
            "must be constant, linear or cosine",
        )
        if self.warmup_steps is not None:
            check(f"{p}.warmup_steps", self.warmup_steps >= 0, "must be >= 0")
        if self.warmup_steps_proportion is not None:
            check(
                f"{p}.warmup_steps_proportion",
                0.0 <= self.warmup_steps_proportion <= 1.0,
                "must be between 0 and 1",
            )
        if self.warmup_steps is not None and self.warmup_steps_proportion is not None:
            warnings.warn(
                f"both {p}.warmup_steps ({self.warmup_steps}) and "
                f"{p}.warmup_steps_proportion ({self.warmup_steps_proportion}) are set: "
                "warmup_steps wins",
                UserWarning,
                stacklevel=2,
            )


@dataclass
class ActorConfig:
    # Model folder (HF layout), relative to the working directory or absolute.
    path: str = ""
    dtype: str = "float32"
    # Python that runs the trainer process (needs torch + transformers);
    # "" = the SGLang engine's interpreter (areal_cli.engines.resolve_python).
    python: str = ""
    # torch threads in the trainer process (0 = torch's default).
    num_threads: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    def validate(self, check: _Checker) -> None:
        check("actor.path", bool(self.path), "is required (a model folder)")
        check("actor.dtype", self.dtype in ("float32", "bfloat16", "float16"), "unknown dtype")
        check("actor.num_threads", self.num_threads >= 0, "must be >= 0")


_BACKEND = re.compile(r"^(sglang|vllm):(?:[dtp][1-9][0-9]*)+$")


@dataclass
class RolloutConfig:
    # Engine and parallelism, e.g. sglang:d1, vllm:d2t2.
    backend: str = "sglang:d1"
    max_concurrent_rollouts: int = 16
    # Inference service: "" = the driver starts one (and stops it at the end).
    gateway_url: str = ""
    # Admin key of the service ("" = a random one when the driver starts the service,
    # else $AREAL_ADMIN_API_KEY).
    admin_api_key: str = ""
    model_name: str = "actor"
    # Name of the service the driver starts ("" = areal-<experiment>-<trial>).
    service_name: str = ""
    # Extra engine flags for a service the driver starts (shell-style string).
    engine_args: str = ""
    request_timeout: float = 120.0
    setup_timeout: float = 300.0
    # Free-form settings for custom drivers (+rollout.extra.key=value).
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self, check: _Checker) -> None:
        check(
            "rollout.backend",
            bool(_BACKEND.match(self.backend)),
            "must be sglang|vllm ':' then d<N>, t<N>, p<N> (e.g. sglang:d1)",
        )
        check("rollout.max_concurrent_rollouts", self.max_concurrent_rollouts >= 1, "must be >= 1")
        check(
            "rollout.gateway_url",
            not self.gateway_url or self.gateway_url.startswith(("http://", "https://")),
            "must be an http(s) URL or empty",
        )
        check("rollout.model_name", bool(self.model_name), "must not be empty")
        check("rollout.request_timeout", self.request_timeout > 0, "must be > 0")


@dataclass
class DatasetConfig:
    # A JSONL file, or "" for a dataset the driver generates.
    path: str = ""
    type: str = ""
    batch_size: int = 8
    shuffle: bool = True
    max_length: int = 512
    # Free-form settings for the dataset (+train_dataset.extra.key=value).
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self, check: _Checker, prefix: str) -> None:
        check(f"{prefix}.batch_size", self.batch_size >= 1, "must be >= 1")
        check(f"{prefix}.max_length", self.max_length >= 1, "must be >= 1")


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass
class BaseExperimentConfig:
    experiment_name: str = MISSING
    trial_name: str = MISSING
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    valid_dataset: DatasetConfig | None = None
    total_train_epochs: int = 1
    # Stop after this many steps (None = run every epoch).
    total_train_steps: int | None = None
    seed: int = 1
    # Free-form settings for custom drivers (+extra.key=value).
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self, check: _Checker) -> None:
        for key in ("experiment_name", "trial_name"):
            value = getattr(self, key)
            check(
                key,
                bool(_PLAIN_NAME.match(value)) and ".." not in value,
                "must be a plain name (letters, digits, '_', '-', '.'; no '/')",
            )
        check("total_train_epochs", self.total_train_epochs >= 1, "must be >= 1")
        if self.total_train_steps is not None:
            check("total_train_steps", self.total_train_steps >= 1, "must be >= 1")
        self.cluster.validate(check)
        self.actor.validate(check)
        self.actor.optimizer.validate(check)
        self.rollout.validate(check)
        self.train_dataset.validate(check, "train_dataset")
        if self.valid_dataset is not None:
            self.valid_dataset.validate(check, "valid_dataset")


@dataclass
class GRPOHyperparameters:
    # Samples per prompt; advantages are normalised within each group.
    group_size: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # PPO clip range for the importance ratio new/behaviour policy.
    eps_clip: float = 0.2
    # Weight of the KL penalty to the initial policy (k3 estimator; 0 = none).
    kl_coef: float = 0.0
    # Divide the group-centred reward by the group's std.
    adv_norm_std: bool = True
    ppo_epochs: int = 1
    n_minibatches: int = 1
    # Export options of the RL API: "concat" (one row per chain of turns, the service's
    # default) or "individual" (one per interaction); a single-turn task's rows are the same.
    export_style: str = "concat"
    discount: float = 1.0
    # Checkpoints kept on disk (the newest ones; 0 = keep all).
    keep_checkpoints: int = 2

    def validate(self, check: _Checker) -> None:
        check(
            "grpo.group_size",
            self.group_size >= 2,
            "must be >= 2 (group-normalised advantages need two samples)",
        )
        check("grpo.max_new_tokens", self.max_new_tokens >= 1, "must be >= 1")
        check("grpo.temperature", self.temperature > 0, "must be > 0 (GRPO samples)")
        check("grpo.top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        check("grpo.eps_clip", self.eps_clip > 0, "must be > 0")
        check("grpo.kl_coef", self.kl_coef >= 0, "must be >= 0")
        check("grpo.ppo_epochs", self.ppo_epochs >= 1, "must be >= 1")
        check("grpo.n_minibatches", self.n_minibatches >= 1, "must be >= 1")
        check(
            "grpo.export_style",
            self.export_style in ("concat", "individual"),
            "must be concat or individual",
        )
        check("grpo.discount", 0 <= self.discount <= 1, "must be in [0, 1]")
        check("grpo.keep_checkpoints", self.keep_checkpoints >= 0, "must be >= 0")


@dataclass
class GRPOConfig(BaseExperimentConfig):
    grpo: GRPOHyperparameters = field(default_factory=GRPOHyperparameters)

    def validate(self, check: _Checker) -> None:
        super().validate(check)
        self.grpo.validate(check)


@dataclass
class SFTHyperparameters:
    # Micro-batches per optimizer step (gradient accumulation).
    n_minibatches: int = 1
    # Save a checkpoint every this many steps (0 = only at the end).
    save_freq_steps: int = 0
    keep_checkpoints: int = 2

    def validate(self, check: _Checker) -> None:
        check("sft.n_minibatches", self.n_minibatches >= 1, "must be >= 1")
        check("sft.save_freq_steps", self.save_freq_steps >= 0, "must be >= 0")
        check("sft.keep_checkpoints", self.keep_checkpoints >= 0, "must be >= 0")


@dataclass
class SFTConfig(BaseExperimentConfig):
    sft: SFTHyperparameters = field(default_factory=SFTHyperparameters)

    def validate(self, check: _Checker) -> None:
        super().validate(check)
        self.sft.validate(check)


# --------------------------------------------------------------------------- loading

C = TypeVar("C")
Path_ = tuple[str, ...]


class _Checker:
    """Turns a failed rule into a ConfigError naming the key and its source."""

    def __init__(self, sources: dict[Path_, str]) -> None:
        self.sources = sources

    def __call__(self, key: str, ok: bool, problem: str) -> None:
        if ok:
            return
        path = tuple(key.split("."))
        raise ConfigError(f"'{key}' {problem}{_from(self.sources, path)}")


def _from(sources: dict[Path_, str], path: Path_) -> str:
    # The most specific recorded source of this key or a key above it.
    for n in range(len(path), 0, -1):
        if path[:n] in sources:
            return f" (from {sources[path[:n]]})"
    return " (default)"


def _dotted(path: Path_) -> str:
    return ".".join(path)


def split_argv(argv: list[str]) -> tuple[str | None, list[str], list[str]]:
    """(config path, overrides, extras) from a driver's argv."""
    config_path: str | None = None
    overrides: list[str] = []
    extras: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a YAML path")
            config_path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            extras.append(arg)
        else:
            if overrides_grammar.parse(arg) is not None:
                overrides.append(arg)
            else:
                extras.append(arg)
        i += 1
    return config_path, overrides, extras


def _yaml_marks(node: yaml.Node, file: str, prefix: Path_, out: dict[Path_, str]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            path = (*prefix, key)
            where = f"{file}:{key_node.start_mark.line + 1}"
            if key in seen:
                raise ConfigError(f"duplicate key '{_dotted(path)}' in {where}")
            seen.add(key)
            out[path] = where
            _yaml_marks(value_node, file, path, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = (*prefix, str(i))
            out.setdefault(path, f"{file}:{item.start_mark.line + 1}")
            _yaml_marks(item, file, path, out)


def _read_yaml(path: str, sources: dict[Path_, str]) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"cannot parse {where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, not {_kind(data)}")
    if node is not None:
        _yaml_marks(node, path, (), sources)
    return data


def _kind(value: Any) -> str:
    if isinstance(value, dict | DictConfig):
        return "a mapping"
    if isinstance(value, list | ListConfig):
        return "a list"
    if value is None:
        return "null"
    return f"{value!r} ({type(value).__name__})"


def _is_free(node: Any) -> bool:
    """A mapping that takes new keys (a dict field), as opposed to a dataclass section."""
    return isinstance(node, DictConfig) and OmegaConf.get_type(node) in (dict, None)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " or ".join(_type_name(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(tp)) else inner
    if origin is not None:
        return {dict: "a mapping", list: "a list"}.get(origin, str(origin))
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return {
        int: "an integer",
        float: "a number",
        bool: "true/false",
        str: "a string",
        dict: "a mapping",
        list: "a list",
    }.get(tp, getattr(tp, "__name__", str(tp)))


def _field_type(cls: Any, path: Path_) -> Any:
    """The annotated type at `path` in the dataclass `cls` (Any when unknown)."""
    tp: Any = cls
    for part in path:
        tp = _strip_optional(tp)
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                return Any
            tp = hints[part]
        elif typing.get_origin(tp) is dict:
            args = typing.get_args(tp)
            tp = args[1] if len(args) == 2 else Any
        elif typing.get_origin(tp) is list:
            args = typing.get_args(tp)
            tp = args[0] if args else Any
        else:
            return Any
    return tp


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _unknown(path: Path_, known: list[str], src: str) -> ConfigError:
    parent = _dotted(path[:-1])
    hint = difflib.get_close_matches(path[-1], known, n=1)
    did = f"; did you mean '{_dotted((*path[:-1], hint[0]))}'?" if hint else ""
    under = f"under '{parent}'" if parent else "at the top level"
    return ConfigError(
        f"unknown key '{_dotted(path)}' {src}{did} (known {under}: {', '.join(sorted(known))})"
    )


def _check_keys(
    data: Any, node: Any, path: Path_, sources: dict[Path_, str], cls: type, src: str = ""
) -> None:
    """Every key of `data` must exist in the schema node (free mappings take any key)."""
    if not isinstance(data, dict) or not isinstance(node, DictConfig):
        return
    if node._is_none() or node._is_missing():
        # An optional section that is unset: check against its type's fields.
        tp = _strip_optional(_field_type(cls, path))
        if dataclasses.is_dataclass(tp):
            node = OmegaConf.structured(tp)
        else:
            return
    if _is_free(node):
        return
    known = [str(k) for k in node.keys()]
    for key, value in data.items():
        sub = (*path, str(key))
        if str(key) not in known:
            where = sources.get(sub, src)
            raise _unknown(sub, known, f"in {where}" if where else "")
        _check_keys(value, node._get_node(str(key)), sub, sources, cls, src)


def _merge_error(
    e: OmegaConfBaseException, cls: type, sources: dict[Path_, str], prefix: Path_ = ()
) -> ConfigError:
    key = _dotted((*prefix, *filter(None, str(getattr(e, "full_key", "") or "").split("."))))
    path = tuple(key.split(".")) if key else ()
    value = getattr(e, "value", None)
    expected = _type_name(_field_type(cls, path)) if path else ""
    got = f", got {_kind(value)}" if value is not None else ""
    reason = (getattr(e, "msg", None) or str(e)).splitlines()[0]
    if isinstance(e, InterpolationResolutionError):
        return ConfigError(f"'{key}' cannot be resolved: {reason}{_from(sources, path)}")
    if key and expected and isinstance(e, ValidationError):
        return ConfigError(f"'{key}' expects {expected}{got}{_from(sources, path)}")
    return ConfigError(f"'{key}': {reason}{_from(sources, path)}" if key else reason)


def _parse_value(text: str, target: Any) -> Any:
    """Hydra's reading of an override's value (overrides.py); a `str` field keeps the raw text."""
    try:
        return overrides_grammar.value(text, keep_text=_strip_optional(target) is str)
    except overrides_grammar.BadValue as e:
        raise ConfigError(str(e)) from None


def _locate(cfg: DictConfig, path: Path_, src: str, must_exist: bool) -> tuple[Any, bool]:
    """(parent node of `path`, whether the key exists); unknown parents are errors."""
    node: Any = cfg
    for i, part in enumerate(path[:-1]):
        sub = path[: i + 1]
        if isinstance(node, DictConfig):
            if part not in node.keys():
                if _is_free(node):
                    raise ConfigError(f"'{_dotted(sub)}' does not exist ({src})")
                raise _unknown(sub, [str(k) for k in node.keys()], f"in {src}")
            child = node._get_node(part)
            if isinstance(child, DictConfig) and child._is_none():
                raise ConfigError(
                    f"'{_dotted(sub)}' is null; set the whole section first, "
                    f"e.g. {_dotted(sub)}={{...}} ({src})"
                )
            node = node[part]
        elif isinstance(node, ListConfig):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"no item '{_dotted(sub)}' ({src})")
            node = node[int(part)]
        else:
            raise ConfigError(
                f"'{_dotted(path[:i])}' is not a section, cannot set '{part}' ({src})"
            )
    last = path[-1]
    if isinstance(node, DictConfig):
        exists = last in node.keys()
        if must_exist and not exists and not _is_free(node):
            raise _unknown(path, [str(k) for k in node.keys()], f"in {src}")
    elif isinstance(node, ListConfig):
        exists = last.isdigit() and int(last) < len(node)
    else:
        raise ConfigError(f"'{_dotted(path[:-1])}' is not a section ({src})")
    return node, exists


def _apply_override(
    cfg: DictConfig, arg: str, cls: type, defaults: DictConfig, sources: dict[Path_, str]
) -> None:
    parsed = overrides_grammar.parse(arg)
    assert parsed is not None
    prefix, key, raw = parsed.prefix, parsed.key, parsed.raw or ""
    has_value = parsed.raw is not None
    path = tuple(key.split("."))
    src = f"override '{arg}'"
    target = _field_type(cls, path)

    if prefix == "~":
        parent, exists = _locate(cfg, path, src, must_exist=True)
        if not exists:
            raise ConfigError(f"cannot drop '{key}': it is not set ({src})")
        if has_value:
            want = _parse_value(raw, target)
            have = OmegaConf.to_container(parent, resolve=False)[path[-1]]  # type: ignore[index,call-overload]
            if have != want:
                raise ConfigError(
                    f"cannot drop '{key}': its value is {have!r}, not {want!r} ({src})"
                )
        if _is_free(parent) or isinstance(parent, ListConfig):
            with open_dict(parent):
                del parent[path[-1] if isinstance(parent, DictConfig) else int(path[-1])]
        else:
            default = OmegaConf.select(defaults, key, throw_on_missing=False)
            dnode = defaults
            for part in path[:-1]:
                dnode = dnode._get_node(part)  # type: ignore[assignment]
            default_node = dnode._get_node(path[-1]) if isinstance(dnode, DictConfig) else None
            with open_dict(parent):
                if default_node is not None and default_node._is_missing():
                    parent[path[-1]] = MISSING
                else:
                    parent[path[-1]] = default
        for p in [p for p in sources if p[: len(path)] == path]:
            del sources[p]
        sources[path] = src
        return

    value = _parse_value(raw, target)
    parent, exists = _locate(cfg, path, src, must_exist=not prefix)
    if prefix:
        if not _is_free(parent):
            section = _dotted(path[:-1]) or "the top level"
            if prefix == "+" or not exists:
                if exists:
                    raise ConfigError(f"'{key}' already exists; set it with {key}=... ({src})")
                raise ConfigError(
                    f"cannot add '{key}': '{section}' has a fixed set of keys "
                    f"(only free-form mappings such as 'extra' take new keys) ({src})"
                )
        elif prefix == "+" and exists:
            raise ConfigError(
                f"'{key}' already exists; set it with {key}=... or ++{key}=... ({src})"
            )
    elif not exists and _is_free(parent):
        raise ConfigError(f"'{key}' does not exist; add it with +{key}=... ({src})")
    for p in [p for p in sources if p[: len(path)] == path]:
        del sources[p]
    sources[path] = src
    section = _strip_optional(target)
    if isinstance(value, dict) and dataclasses.is_dataclass(section):
        # A whole section: its keys must exist too; it is merged over the
        # current section (or the section's defaults when it was null).
        node = parent._get_node(path[-1]) if isinstance(parent, DictConfig) and exists else None
        _check_keys(value, node, path, sources, cls, src)
        if not isinstance(node, DictConfig) or node._is_none():
            node = OmegaConf.structured(section)
        try:
            value = OmegaConf.merge(node, value)
        except OmegaConfBaseException as e:
            raise _merge_error(e, cls, sources, prefix=path) from None
    try:
        if isinstance(parent, ListConfig):
            parent[int(path[-1])] = value
        elif prefix:
            with open_dict(parent):
                parent[path[-1]] = value
        else:
            OmegaConf.update(cfg, key, value, merge=False)
    except OmegaConfBaseException as e:
        raise _merge_error(e, cls, sources) from None


def _resolve(cfg: DictConfig) -> None:
    """OmegaConf.resolve, with the failing key named: omegaconf 2.3 (the series hydra-core 1.3
    allows) leaves `full_key` empty on resolve()'s error, while to_object() fills it in."""
    try:
        OmegaConf.resolve(cfg)
    except InterpolationResolutionError as e:
        if getattr(e, "full_key", ""):
            raise
        OmegaConf.to_object(cfg)  # raises the same error, naming the key
        raise


def load_expr_config(
    argv: list[str], config_cls: type[C], *, save: bool = True
) -> tuple[C, list[str]]:
    """Parse a driver's argv into a `config_cls` instance and the unused `extras`.

    Raises ConfigError (one line) on any problem. Saves the resolved, redacted
    config to the experiment's folder unless `save` is false.
    """
    if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
        raise TypeError(f"config_cls must be a dataclass type, not {config_cls!r}")
    config_path, overrides, extras = split_argv(list(argv))
    sources: dict[Path_, str] = {}
    defaults = OmegaConf.structured(config_cls)
    cfg = OmegaConf.structured(config_cls)
    if config_path is not None:
        data = _read_yaml(config_path, sources)
        _check_keys(data, cfg, (), sources, config_cls)
        try:
            cfg = typing.cast(DictConfig, OmegaConf.merge(cfg, data))
        except OmegaConfBaseException as e:
            raise _merge_error(e, config_cls, sources) from None
    for arg in overrides:
        _apply_override(cfg, arg, config_cls, defaults, sources)
    try:
        _resolve(cfg)
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ConfigError(
                f"'{missing[0]}' is required: set it in the YAML or pass {missing[0]}=..."
                + (f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else "")
            )
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _merge_error(e, config_cls, sources) from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate(_Checker(sources))
    if save:
        save_config(obj)
    return typing.cast(C, obj), extras


# --------------------------------------------------------------------------- saving

_ALWAYS_SECRET = re.compile(
    r"(^|_)(api_key|apikey|password|passwd|passphrase|authorization|private_key|secret|token)$",
    re.I,
)
_MAYBE_SECRET = re.compile(r"(^|_)key$", re.I)


def _looks_secret(value: str) -> bool:
    """A token-like string: long, no spaces, mixing character classes."""
    if len(value) < 8 or any(c.isspace() for c in value) or "/" in value:
        return False
    classes = sum(
        (
            any(c.islower() for c in value),
            any(c.isupper() for c in value),
            any(c.isdigit() for c in value),
        )
    )
    return classes >= 2 or len(value) >= 32


def is_secret(key: str, value: Any) -> bool:
    """Whether a config value must not be written to disk as is."""
    if not isinstance(value, str) or not value:
        return False
    k = key.lower().replace("-", "_")
    if _ALWAYS_SECRET.search(k):
        return True
    return bool(_MAYBE_SECRET.search(k)) and _looks_secret(value)


_URL_CREDENTIALS = re.compile(r"^([a-z][a-z0-9+.\-]*://)([^/@\s:]+):([^/@\s]+)@", re.I)


def redact(data: Any, key: str = "") -> Any:
    """A copy of `data` with secret values replaced by '***'."""
    if isinstance(data, dict):
        return {k: redact(v, str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [redact(v, key) for v in data]
    if is_secret(key, data):
        return REDACTED
    if isinstance(data, str):
        # Credentials inside a URL (scheme://user:password@host).
        return _URL_CREDENTIALS.sub(lambda m: f"{m.group(1)}{m.group(2)}:{REDACTED}@", data)
    return data


def to_dict(config: Any) -> dict[str, Any]:
    return typing.cast(dict[str, Any], dataclasses.asdict(config))


def log_dir(config: Any) -> Path:
    """`<cluster.fileroot or ./runs>/<experiment_name>/<trial_name>` (absolute)."""
    root = Path(config.cluster.fileroot or "runs")
    return (root / config.experiment_name / config.trial_name).resolve()


def save_config(config: Any, path: str | os.PathLike[str] | None = None) -> Path:
    """Write the config as YAML (secrets redacted, mode 0600), atomically."""
    out = Path(path) if path is not None else log_dir(config) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(redact(to_dict(config)), sort_keys=False, default_flow_style=False)
    fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".yaml", dir=out.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
