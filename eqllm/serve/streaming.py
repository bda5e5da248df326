"""Server-sent events of both routes: `data: {json}` chunks ending in `data: [DONE]`, in OpenAI's
chunk shapes (`text_completion` choices; `chat.completion.chunk` deltas, tool calls one
`delta.tool_calls` entry each with its index)."""

from __future__ import annotations

import json

from fastapi.responses import StreamingResponse

from eqllm.generation import Finished
from eqllm.serve.text import Choice, usage
from eqllm.serve.tools import Reader, stream_calls


def sse(data) -> bytes:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()


def stream_completions(service, runs, head, body) -> StreamingResponse:
    """The choices of `runs` ((prompt, params, choice) each), one after the other."""

    async def chunks():
        for prompt, params, choice in runs:
            if choice.echo:
                yield sse({**head, "choices": [_piece(choice, choice.prefix, None)]})
            async for event in service.events(prompt, params, choice.constraint):
                text = choice.on(event)
                done = isinstance(event, Finished) or choice.stopped
                if text or done:
                    reason = choice.finish_reason or "stop" if done else None
                    yield sse({**head, "choices": [_piece(choice, text, reason)]})
                if done:
                    break
        if (body.stream_options or {}).get("include_usage"):
            yield sse({**head, "choices": [], "usage": usage([c for _, _, c in runs])})
        yield sse("[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream")


def _piece(choice: Choice, text: str, reason: str | None) -> dict:
    return {"index": choice.index, "text": text, "logprobs": None, "finish_reason": reason}


def stream_chat(service, runs, head, body, reader: Reader) -> StreamingResponse:
    """The one choice of `runs` as chat deltas: content as it becomes final, then each tool
    call (in its own chunk, indices 0, 1, ...), then the finish reason."""
    head = {**head, "object": "chat.completion.chunk"}
    prompt, params, choice = runs[0]

    def chunk(delta, reason=None):
        return sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]})

    async def chunks():
        yield chunk({"role": "assistant", "content": ""})
        async for event in service.events(prompt, params, choice.constraint):
            text = reader.feed(choice.on(event))
            done = isinstance(event, Finished) or choice.stopped
            if text:
                yield chunk({"content": text})
            if done:
                break
        rest, calls = reader.rest(), reader.finish()[1]
        if rest:
            yield chunk({"content": rest})
        for call in stream_calls(calls):
            yield chunk({"tool_calls": [call]})
        yield chunk({}, "tool_calls" if calls else choice.finish_reason or "stop")
        if (body.stream_options or {}).get("include_usage"):
            yield sse({**head, "choices": [], "usage": usage([choice])})
        yield sse("[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream")
