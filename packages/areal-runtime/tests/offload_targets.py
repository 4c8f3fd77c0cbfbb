"""Functions for areal_runtime.offload's tests, imported by the child process."""

from __future__ import annotations

import os
from collections.abc import Callable


def make(prefix: str) -> Callable[[bytes], bytes]:
    def fn(data: bytes) -> bytes:
        if data == b"raise":
            raise ValueError("asked to")
        if data == b"pid":
            return str(os.getpid()).encode()
        if data == b"nice":
            return str(os.nice(0)).encode()
        if data == b"env":
            return ",".join(sorted(k for k in os.environ if k.startswith("AREAL_"))).encode()
        if data == b"allenv":
            return ",".join(sorted(os.environ)).encode()
        if data == b"print":
            print("a stray line")  # must not corrupt the frames
            return b"printed"
        return prefix.encode() + data

    return fn
