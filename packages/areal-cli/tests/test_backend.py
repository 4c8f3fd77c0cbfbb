"""--backend grammar and GPU allocation with fake device lists."""

from __future__ import annotations

import pytest

from areal_cli import backend as bk
from areal_cli import supervisor
from areal_cli.errors import CLIError


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("sglang:d1", ("sglang", 1, 1, 1)),
        ("sglang:d2", ("sglang", 2, 1, 1)),
        ("sglang:d1t2", ("sglang", 1, 2, 1)),
        ("vllm:t2d2p1", ("vllm", 2, 2, 1)),
        ("sglang:p1t4d3", ("sglang", 3, 4, 1)),
        ("sglang:", ("sglang", 1, 1, 1)),
        ("SGLang:D2", ("sglang", 2, 1, 1)),
    ],
)
def test_grammar(spec, want):
    b = bk.parse(spec)
    assert (b.engine, b.dp, b.tp, b.pp) == want


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("sglang", "missing ':'"),
        ("tgi:d1", "unknown engine 'tgi'"),
        ("sglang:d0", "d0 must be at least 1"),
        ("sglang:d1d2", "'d' given twice"),
        ("sglang:x2", "cannot parse 'x2'"),
        ("sglang:d", "cannot parse 'd'"),
        ("sglang:d2 t1", "cannot parse"),
    ],
)
def test_bad_specs(spec, needle):
    with pytest.raises(CLIError, match=needle) as info:
        bk.parse(spec)
    assert info.value.code == 2


def test_pipeline_parallel_is_refused_locally():
    with pytest.raises(CLIError, match="pipeline parallelism is not supported"):
        bk.allocate(bk.parse("sglang:d1p2"), [0, 1, 2, 3], [])


def test_allocation_first_free_first_t_per_replica():
    assert bk.allocate(bk.parse("sglang:d2t2"), [0, 1, 2, 3], []) == [[0, 1], [2, 3]]
    assert bk.allocate(bk.parse("sglang:d2"), [4, 5, 6], used=[4]) == [[5], [6]]
    assert bk.allocate(bk.parse("vllm:d1t2"), [3, 1, 2], used=[1]) == [[3, 2]]


def test_too_few_gpus():
    with pytest.raises(CLIError, match=r"needs 4 GPUs .* only 3 of 4 visible are free .*\[1\]"):
        bk.allocate(bk.parse("sglang:d2t2"), [0, 1, 2, 3], used=[1])


def test_no_gpu_means_cpu_replicas():
    assert bk.allocate(bk.parse("sglang:d2"), [], []) == [[], []]


@pytest.mark.parametrize(
    ("cvd", "want"),
    [("0,1,3", [0, 1, 3]), ("", []), ("-1", []), (" 2 , 5 ", [2, 5]), ("1,-1,2", [1])],
)
def test_visible_gpus_from_cuda_visible_devices(cvd, want):
    assert bk.visible_gpus({"CUDA_VISIBLE_DEVICES": cvd}) == want


def test_visible_gpus_uuid_is_refused():
    with pytest.raises(CLIError, match="indices"):
        bk.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-1234"})


def test_visible_gpus_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert bk.visible_gpus({}) == []


def test_used_gpus_counts_only_live_engines(tmp_path):
    proc, comp = supervisor.spawn("w", ["sleep", "30"], tmp_path / "w.log")
    try:
        dead = {**comp.to_dict(), "name": "d", "start_time": comp.start_time + 1}
        state = {
            "components": {"w": comp.to_dict(), "d": dead},
            "models": {
                "m": {"replicas": [{"worker": "w", "gpus": [0, 1]}, {"worker": "d", "gpus": [2]}]}
            },
        }
        assert bk.used_gpus([state]) == {0, 1}
    finally:
        proc.kill()
        proc.wait()
    assert bk.used_gpus([state]) == set()
