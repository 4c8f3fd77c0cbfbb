"""Anthropic's Messages API on the inference gateway (`POST /v1/messages`), as a translation
onto the chat path, the way `openai/responses/` serves the Responses API: the Messages body
becomes a chat-completions body (`request.py`), goes down the chat generation path unchanged
(`endpoint.py`; with a session key the proxy records it exactly like a chat), and the chat
answer comes back as a Message or its event stream (`response.py`); every error in
Anthropic's shape and status codes (`errors.py`). docs/services.md, "Anthropic Messages API".
"""
