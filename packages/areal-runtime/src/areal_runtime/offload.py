"""CPU-heavy work on a child process, so that it never holds this process's GIL.

A service's event loop serves streams, health and stats; a thread pool does not protect it
from work that holds the GIL (parsing a JSON body of megabytes, building a token list of
millions). `Offload` runs such work in one child process of its own, started on first use:

    screen = Offload("areal_proxy.prompt.fit_screen:make", {"tokenizer": path}, name="proxy-screen")
    answer = await screen.call(b"c", body)      # bytes in (joined), bytes out
    await screen.close()

`target` names a factory (`module:function`) that the child calls once with `args` (JSON);
it returns the function each call runs, bytes to bytes. Calls run one at a time, in order:
the child is a place for rare, large requests, and one at a time also bounds the CPU they
can take. It runs at a lower scheduling priority (`nice`, and Linux's SCHED_IDLE class), so on
a busy machine the small requests of the parent come first. It dies with its parent (PR_SET_PDEATHSIG). A child that
dies fails the calls in flight with `OffloadFailed` and is started again by the next call;
one unused for `idle_s` is stopped, so its memory goes back to the machine.

Frames on its stdin/stdout: an 8-byte big-endian length, then that many bytes. A call that
raises in the child answers status 1 and the error's text; the parent raises `OffloadFailed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import importlib
import json
import logging
import os
import signal
import struct
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_LEN = struct.Struct(">Q")
_SLICE = 256 * 1024
# The pipe to the child holds this much (Linux's default is 64 KiB): fewer wake-ups per frame.
_PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = 1031
_OK, _FAILED = 0, 1
# The only environment a child gets: what Python, the tokenizers library and a locale need.
# An allow-list, never a deny-list: a child parses untrusted bodies, and a secret added to
# the service's environment later (a signing key, a token) must not reach it by default.
_CHILD_ENV = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LANG",
        "LANGUAGE",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONHASHSEED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONUNBUFFERED",
        "PYTHONMALLOC",
        "VIRTUAL_ENV",
        "TOKENIZERS_PARALLELISM",
        "RAYON_NUM_THREADS",
        "OMP_NUM_THREADS",
        "MALLOC_ARENA_MAX",
        "HF_HOME",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
    }
)


def child_env(parent: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: the allow-listed names of `parent` (os.environ)."""
    env = os.environ if parent is None else parent
    return {k: v for k, v in env.items() if k in _CHILD_ENV}


_PR_SET_PDEATHSIG = 1


class OffloadFailed(Exception):
    """The child could not answer: it raised, died, or could not start."""


class Offload:
    def __init__(
        self,
        target: str,
        args: dict[str, Any],
        *,
        name: str,
        nice: int = 10,
        idle_s: float = 300.0,
    ) -> None:
        self.target = target
        self.args = args
        self.name = name
        self.nice = nice
        # A child unused this long is stopped (its memory back to the machine); the next call
        # starts another.
        self.idle_s = idle_s
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self._idle: asyncio.TimerHandle | None = None
        # The task that stops an idle child (held so that it is not collected mid-run).
        self._idle_stop: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def _start(self) -> asyncio.subprocess.Process:
        env = child_env()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "areal_runtime.offload",
            self.target,
            json.dumps(self.args),
            str(self.nice),
            str(os.getpid()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            # Frames of megabytes: a larger read buffer means fewer wake-ups per frame.
            limit=1 << 20,
        )
        log.info("%s: started child process %d", self.name, proc.pid)
        # (uvloop's pipe transports give no "pipe" object: the default size stays.)
        assert proc.stdin is not None
        pipe = proc.stdin.transport.get_extra_info("pipe")
        if pipe is not None:
            with contextlib.suppress(OSError, ValueError):
                fcntl.fcntl(pipe.fileno(), _F_SETPIPE_SZ, _PIPE_SIZE)
        return proc

    async def call(self, *parts: bytes) -> bytes:
        """The parts, joined, through the child's function; OffloadFailed if it could not
        answer. (Parts, so that a caller never copies a body of megabytes to prefix it.)"""
        async with self._lock:
            if self._closed:
                raise OffloadFailed(f"{self.name} is closed")
            proc = self._proc
            if proc is None or proc.returncode is not None:
                try:
                    proc = self._proc = await self._start()
                except Exception as exc:  # the caller does the work itself: say why, once
                    log.exception("%s: cannot start its child", self.name)
                    raise OffloadFailed(f"{self.name}: cannot start its child: {exc!r}") from exc
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(_LEN.pack(sum(map(len, parts))))
                for part in parts:
                    # In slices: the transport copies what the pipe does not take at once into
                    # its buffer, and one copy of megabytes would hold the GIL for milliseconds.
                    view = memoryview(part)
                    for at in range(0, len(view), _SLICE):
                        proc.stdin.write(view[at : at + _SLICE])
                        await proc.stdin.drain()
                await proc.stdin.drain()
                (size,) = _LEN.unpack(await proc.stdout.readexactly(_LEN.size))
                frame = await proc.stdout.readexactly(size)
            except (OSError, asyncio.IncompleteReadError, RuntimeError) as exc:
                # Dead (or killed mid-call): the next call starts a new one. (uvloop raises
                # RuntimeError, not OSError, for a write to the pipe of a child that is gone.)
                await self._reap(proc)
                log.warning(
                    "%s: child process %d gone mid-call (exit status %s): %r",
                    self.name,
                    proc.pid,
                    proc.returncode,
                    exc,
                )
                raise OffloadFailed(f"{self.name}: its child process died") from exc
            except asyncio.CancelledError:
                # The frame may be half written or half read: this child's stream is lost.
                await self._reap(proc)
                raise
            finally:
                self._arm_idle()
            if frame[:1] != bytes([_OK]):
                raise OffloadFailed(f"{self.name}: {frame[1:].decode(errors='replace')}")
            return frame[1:]

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        loop = asyncio.get_running_loop()
        self._idle = loop.call_later(self.idle_s, self._on_idle)

    def _on_idle(self) -> None:
        self._idle = None
        self._idle_stop = asyncio.ensure_future(self._stop_idle())

    async def _stop_idle(self) -> None:
        async with self._lock:
            proc = self._proc
            if self._idle is None and proc is not None and proc.returncode is None:
                log.info(
                    "%s: child process %d idle for %gs, stopped", self.name, proc.pid, self.idle_s
                )
                await self._end(proc)

    async def _reap(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await proc.wait()
        if self._proc is proc:
            self._proc = None

    async def close(self) -> None:
        """Stop the child: end its input, then kill it if it has not gone in a second."""
        self._closed = True
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        proc = self._proc
        if proc is not None and proc.returncode is None:
            await self._end(proc)

    async def _end(self, proc: asyncio.subprocess.Process) -> None:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 1.0)
        except TimeoutError:
            pass
        await self._reap(proc)


# --- the child ------------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)


def _read_exactly(stream: Any, n: int) -> bytes | None:
    parts = []
    while n:
        part = stream.read(n)
        if not part:
            return None
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def _serve(fn: Callable[[bytes], bytes], inp: Any, out: Any) -> None:
    while True:
        head = _read_exactly(inp, _LEN.size)
        if head is None:  # the parent closed its end
            return
        frame = _read_exactly(inp, _LEN.unpack(head)[0])
        if frame is None:
            return
        try:
            answer = bytes([_OK]) + fn(frame)
        except Exception as exc:  # a bug in the function: the parent reports it
            answer = bytes([_FAILED]) + f"{type(exc).__name__}: {exc}".encode()
        out.write(_LEN.pack(len(answer)))
        out.write(answer)
        out.flush()


def main(argv: list[str]) -> int:
    target, args, nice, parent = argv[0], json.loads(argv[1]), int(argv[2]), int(argv[3])
    _die_with_parent(parent)
    if nice:
        os.nice(nice)
        # Linux's idle class as well: the child runs only on a CPU nothing else wants, so on a
        # saturated machine the service's own requests never wait behind a huge one.
        if hasattr(os, "SCHED_IDLE"):
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's to handle
    # Frames go out on a copy of stdout; fd 1 itself becomes stderr, so a stray print in
    # the function lands in the service's log instead of corrupting a frame.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    module, _, factory = target.partition(":")
    fn = getattr(importlib.import_module(module), factory)(**args)
    _serve(fn, sys.stdin.buffer, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
