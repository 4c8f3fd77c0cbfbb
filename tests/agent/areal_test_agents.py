"""Agents only the tests use (the workers import them with this folder on PYTHONPATH)."""

from __future__ import annotations

import asyncio
import os


class FlakyAgent:
    """Answers `<worker pid>:<message>`; raises when the message says "boom";
    `metadata.delay` seconds before answering."""

    async def run(self, request, *, emitter):
        text = request.message_text
        await asyncio.sleep(float(request.metadata.get("delay", 0)))
        if "boom" in text:
            raise RuntimeError(f"asked to fail: {text}")
        await emitter.delta(f"{os.getpid()}:")
        await emitter.delta(text)
        return None
