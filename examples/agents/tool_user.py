"""An agent that calls a tool and an LLM through areal's inference gateway.

When the agent service is linked to an inference service, `request.inference`
carries the gateway URL and this session's own RL session key, so the LLM
call below is recorded on the session (token ids, logprobs, versions) and can
be rewarded and exported for training.
"""

from __future__ import annotations

import openai


def calculator(expression: str) -> str:
    allowed = set("0123456789+-*/() .")
    if not set(expression) <= allowed:
        return "error: only arithmetic is allowed"
    return str(eval(expression, {"__builtins__": {}}, {}))  # only digits and operators reach eval


class ToolUsingAgent:
    async def run(self, request, *, emitter):
        expr = request.metadata.get("expression", "2+3")
        call_id = await emitter.tool_call("calculator", {"expression": expr})
        result = calculator(expr)
        await emitter.tool_result(call_id, result)
        link = request.inference
        if link is None:
            await emitter.delta(f"{expr} = {result}")
            return None
        client = openai.AsyncOpenAI(base_url=link.base_url, api_key=link.api_key, max_retries=0)
        try:
            stream = await client.chat.completions.create(
                model=link.model,
                messages=[
                    *request.history,
                    {"role": "user", "content": f"{request.message_text} ({expr} = {result})"},
                ],
                max_tokens=int(request.metadata.get("max_tokens", 8)),
                temperature=0,
                stream=True,
            )
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        await emitter.delta(choice.delta.content)
        finally:
            await client.close()
        return None
