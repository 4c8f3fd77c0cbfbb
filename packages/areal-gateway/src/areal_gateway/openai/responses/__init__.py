"""The Responses API: one implementation of its objects and events (`events.py`, used by
the inference gateway and the agent gateway), and the inference gateway's endpoint, a
translation to and from chat completions (`request.py`, `chat.py`, `endpoint.py`) with the
conversations `previous_response_id` continues (`store.py`)."""
