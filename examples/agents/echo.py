"""The smallest agent: answers with what it was told, word by word as it goes."""

from __future__ import annotations

import asyncio


class EchoAgent:
    async def run(self, request, *, emitter):
        words = request.message_text.split(" ")
        for i, word in enumerate(words):
            await emitter.delta(word if i == 0 else " " + word)
            await asyncio.sleep(float(request.metadata.get("delay", 0)))
        return None
