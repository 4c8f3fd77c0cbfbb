"""The agent worker over real gRPC: streaming events, errors, cancellation, the binary."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import orjson
import pytest

from areal_agent_worker.loader import AgentLoadError, load_agent
from areal_agent_worker.server import create_worker
from areal_agent_worker.settings import Settings
from areal_proto.agent.v1 import agent_worker_pb2, agent_worker_pb2_grpc

HERE = Path(__file__).parent


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("nodots", "must look like package.module.Class"),
        ("no_such_module_xyz.Agent", "cannot import module 'no_such_module_xyz'"),
        ("sample_agents.Missing", "has no attribute 'Missing'"),
        ("sample_agents.NoRun", "has no run method"),
        ("sample_agents.NotAsync", "must be an async def"),
    ],
)
def test_load_errors_say_what_to_fix(path, message):
    with pytest.raises(AgentLoadError, match=message):
        load_agent(path)


@pytest.fixture
async def stub():
    worker = create_worker(
        Settings(agent="sample_agents.Slow", metrics_port=-1), load_agent("sample_agents.Slow")
    )
    await worker.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
    yield agent_worker_pb2_grpc.AgentWorkerServiceStub(channel), worker
    await channel.close()
    await worker.shutdown()


def _turn(message="hi", sleep=0.5, session="s1"):
    return agent_worker_pb2.RunTurnRequest(
        session_id=session, message=orjson.dumps(message), metadata=orjson.dumps({"sleep": sleep})
    )


async def test_events_stream_as_they_happen(stub):
    client, _ = stub
    t0 = time.monotonic()
    events = []
    async for ev in client.RunTurn(_turn(sleep=0.6)):
        events.append((ev.type, orjson.loads(ev.data), time.monotonic() - t0))
    types = [e[0] for e in events]
    assert types == ["delta", "tool_call", "tool_result", "delta", "done"]
    assert events[0][2] < 0.3, "first event must arrive before the agent finishes"
    assert events[-1][2] >= 0.6
    assert events[1][1]["name"] == "lookup" and events[1][1]["arguments"] == {"q": "hi"}
    assert events[2][1] == {"id": events[1][1]["id"], "output": {"answer": 42}}


async def test_cancel_stops_the_turn(stub):
    client, worker = stub
    call = client.RunTurn(_turn(sleep=30))
    async for ev in call:
        if ev.type == "delta":
            break
    call.cancel()
    for _ in range(100):
        if not worker.servicer.running:
            break
        await asyncio.sleep(0.02)
    assert not worker.servicer.running, "the agent task must be cancelled with the call"


async def test_close_session_hook(stub):
    import sample_agents

    client, _ = stub
    await client.CloseSession(agent_worker_pb2.CloseSessionRequest(session_id="bye"))
    assert "bye" in sample_agents.CLOSED


async def test_agent_error_is_an_event_and_worker_keeps_serving():
    worker = create_worker(Settings(metrics_port=-1), load_agent("sample_agents.Broken"))
    await worker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as ch:
            client = agent_worker_pb2_grpc.AgentWorkerServiceStub(ch)
            for _ in range(2):
                events = [(e.type, orjson.loads(e.data)) async for e in client.RunTurn(_turn())]
                assert events[0] == ("delta", {"text": "partial"})
                assert events[-1][0] == "error"
                assert "RuntimeError: tool backend down" in events[-1][1]["message"]
    finally:
        await worker.shutdown()


async def test_returned_text_becomes_a_delta():
    worker = create_worker(Settings(metrics_port=-1), load_agent("sample_agents.Echo"))
    await worker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as ch:
            client = agent_worker_pb2_grpc.AgentWorkerServiceStub(ch)
            events = [(e.type, orjson.loads(e.data)) async for e in client.RunTurn(_turn("yo"))]
    finally:
        await worker.shutdown()
    assert events == [("delta", {"text": "echo: yo"}), ("done", {"text": "echo: yo"})]


def _binary(*args, **kw):
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    return subprocess.Popen(
        [sys.executable, "-m", "areal_agent_worker", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def test_binary_version_and_bad_agent():
    p = _binary("--version")
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0 and "areal-agent-worker 0.1.0" in out
    p = _binary("--agent", "sample_agents.NoRun")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 2
    assert "has no run method" in err and "Traceback" not in err
    p = _binary()
    _, err = p.communicate(timeout=30)
    assert p.returncode == 2 and "--agent is required" in err


def test_binary_ready_file_and_sigterm(tmp_path):
    ready = tmp_path / "ready.json"
    p = _binary("--agent", "sample_agents.Echo", "--ready-file", str(ready))
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert p.poll() is None, p.stderr.read() if p.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert info["pid"] == p.pid and info["port"] > 0 and info["metrics_port"] > 0
        import urllib.request

        body = urllib.request.urlopen(
            f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=5
        ).read()
        assert b"areal_agent_turns_running" in body
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
