"""areal_runtime.offload: a child process for work that must not hold the caller's GIL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from areal_runtime.offload import Offload, OffloadFailed

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    # The child imports the target module by name.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for this purpose.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


async def test_calls_go_through_the_child_in_order_and_big_frames_arrive_whole():
    off = Offload("offload_targets:make", {"prefix": "> "}, name="test")
    try:
        assert off.pid is None  # started on first use
        assert await off.call(b"a", b"b") == b"> ab"
        big = os.urandom(5_000_000)
        answers = await asyncio.gather(*(off.call(b"x", big) for _ in range(3)))
        assert answers == [b"> x" + big] * 3
        child = int(await off.call(b"pid"))
        assert child == off.pid and child != os.getpid()
        assert int(await off.call(b"nice")) >= 10
        assert await off.call(b"print") == b"printed"
        assert await off.call(b"after") == b"> after"
    finally:
        await off.close()
    assert off.pid is None and not _alive(child)


async def test_the_child_gets_no_secrets(monkeypatch: pytest.MonkeyPatch):
    # An allow-list: the gateway's session-key signing secret reached the body screen (which
    # parses untrusted bodies) under the old deny-list, and any secret named later would.
    monkeypatch.setenv("AREAL_INTERNAL_TOKEN", "t0ken")
    monkeypatch.setenv("AREAL_ADMIN_API_KEY", "k3y")
    monkeypatch.setenv("AREAL_SESSION_KEY_SECRET", "s1gning-secret-0123456789abcdef")
    monkeypatch.setenv("AREAL_SERVICE", "svc")
    monkeypatch.setenv("SOME_FUTURE_TOKEN", "x")
    off = Offload("offload_targets:make", {"prefix": ""}, name="test")
    try:
        assert await off.call(b"env") == b""
        got = set((await off.call(b"allenv")).decode().split(","))
        assert "SOME_FUTURE_TOKEN" not in got
        assert "PYTHONPATH" in got  # what Python needs still gets there
    finally:
        await off.close()


async def test_a_raising_function_fails_the_call_and_the_child_keeps_serving():
    off = Offload("offload_targets:make", {"prefix": ""}, name="test")
    try:
        with pytest.raises(OffloadFailed, match="ValueError: asked to"):
            await off.call(b"raise")
        assert await off.call(b"ok") == b"ok"
    finally:
        await off.close()


async def test_a_dead_child_fails_the_call_and_the_next_call_starts_another():
    off = Offload("offload_targets:make", {"prefix": ""}, name="test")
    try:
        first = int(await off.call(b"pid"))
        os.kill(first, signal.SIGKILL)
        with pytest.raises(OffloadFailed, match="died"):
            for _ in range(3):  # the first write may still land in the pipe's buffer
                await off.call(b"x" * 1_000_000)
        second = int(await off.call(b"pid"))
        assert second != first
    finally:
        await off.close()


async def test_a_child_that_cannot_start_its_function_fails_the_call():
    off = Offload("offload_targets:no_such_factory", {}, name="test")
    try:
        with pytest.raises(OffloadFailed):
            await off.call(b"x")
    finally:
        await off.close()
    with pytest.raises(OffloadFailed, match="closed"):
        await off.call(b"x")


def test_the_child_dies_with_its_parent():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import asyncio, time
                from areal_runtime.offload import Offload
                async def main():
                    off = Offload("offload_targets:make", {"prefix": ""}, name="t")
                    print(int(await off.call(b"pid")), flush=True)
                    await asyncio.sleep(60)
                asyncio.run(main())
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait()
        end = time.monotonic() + 5
        while _alive(child) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()


async def test_an_idle_child_is_stopped_and_the_next_call_starts_another():
    off = Offload("offload_targets:make", {"prefix": ""}, name="test", idle_s=0.3)
    try:
        first = int(await off.call(b"pid"))
        end = time.monotonic() + 5
        while off.pid is not None and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert off.pid is None and not _alive(first)
        assert int(await off.call(b"pid")) not in (first, os.getpid())
    finally:
        await off.close()
