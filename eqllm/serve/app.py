"""The OpenAI-compatible HTTP app (FastAPI) on an `Engine`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat template), both
streamed as server-sent events ending in `data: [DONE]` when asked; `GET /v1/models`;
`GET /health`; vLLM's tokenizer routes (`eqllm.serve.tokenize`). Bad input gets OpenAI's error
body with a 4xx status and one log line; a full queue gets 429, a server shutting down 503. A
client that goes away cancels its requests, which frees their slots at the engine's next step.
`response_format` holds either route's output to JSON, `tools` / `tool_choice` the chat
route's to tool calls (`eqllm.serve.tools`). What the routes share is `eqllm.serve.service`;
the streamed chunks are written by `eqllm.serve.streaming`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from eqllm.errors import EqllmError
from eqllm.serve.protocol import ApiError, ChatRequest, CompletionRequest
from eqllm.serve.service import Service
from eqllm.serve.streaming import stream_chat, stream_completions
from eqllm.serve.text import Choice, usage
from eqllm.serve.tokenize import tokenizer_routes
from eqllm.serve.tools import Reader, Shape, format_grammar, template_messages

__all__ = ["Service", "create_app"]

log = logging.getLogger("eqllm.serve")


async def _until_disconnect(http: HttpRequest, task: asyncio.Task) -> None:
    while not task.done():
        if await http.is_disconnected():
            task.cancel()
            return
        await asyncio.sleep(0.1)


async def _collect(http: HttpRequest, service: Service, runs) -> None:
    """Run every (prompt, params, choice) to its end; a client that leaves cancels them."""

    async def one(prompt, params, choice):
        async for event in service.events(prompt, params, choice.constraint):
            choice.on(event)
            if choice.stopped:
                return  # leaving the stream cancels the request

    task = asyncio.ensure_future(asyncio.gather(*(one(*r) for r in runs)))
    watcher = asyncio.ensure_future(_until_disconnect(http, task))
    try:
        await task
    finally:
        watcher.cancel()


def create_app(service: Service) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine and, at shutdown, drains it."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.engine.start()
        log.info("serving %s", service.model_name)
        yield
        service.closing = True
        await asyncio.to_thread(service.engine.stop, drain=True)

    app = FastAPI(title="eqllm", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(http: HttpRequest, e: ApiError):
        log.warning("%d %s: %s", e.status, http.url.path, e.message)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(http: HttpRequest, e: RequestValidationError):
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return await api_error(
            http, ApiError(400, f"{where or 'body'}: {first.get('msg')}", param=where or None)
        )

    @app.exception_handler(HTTPException)
    async def http_error(http: HttpRequest, e: HTTPException):
        return await api_error(http, ApiError(e.status_code, str(e.detail)))

    @app.middleware("http")
    async def authorize(http: HttpRequest, call_next):
        key = service.api_key
        if key and http.url.path.startswith("/v1"):
            given = http.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(given.encode(), key.encode()):
                e = ApiError(401, "missing or wrong API key", kind="authentication_error")
                return await api_error(http, e)
        return await call_next(http)

    app.include_router(tokenizer_routes(service))  # vLLM's /tokenize, /detokenize, ...

    @app.get("/health")
    async def health():
        return {"status": "closing" if service.closing else "ok", "busy": service.engine.busy()}

    @app.get("/v1/models")
    async def models():
        base = service.model_name
        entry = {"object": "model", "created": service.created, "owned_by": "eqllm"}
        entry["max_model_len"] = service.engine.max_len
        data = [{"id": base, **entry}]
        data += [{"id": name, **entry, "parent": base} for name in service.adapters]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        adapter = service.check_model(body.model)
        grammar = format_grammar(body.response_format, service.grammars)
        prompts = _prompts(service, body.prompt)
        wants_scores = body.echo and body.logprobs is not None
        runs = []
        for i, prompt in enumerate(prompts):
            params = service.params(body, prompt, body.max_tokens, wants_scores, adapter)
            choice = Choice(
                i,
                prompt,
                service.decode,
                stops=body.stop,
                hidden=params.stop_tokens,
                echo=body.echo,
                logprobs=body.logprobs,
            )
            runs.append((prompt, params, choice))
        _check_all(service, runs)
        for _, params, choice in runs:  # each choice with its own grammar state
            service.constrain(choice, params, grammar)
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time())}
        head |= {"object": "text_completion", "model": body.model}
        if body.stream:
            return stream_completions(service, runs, head, body)
        await _collect(http, service, runs)
        choices = [
            {
                "index": c.index,
                "text": c.full_text(),
                "logprobs": c.completion_logprobs(),
                "finish_reason": c.finish_reason,
            }
            for _, _, c in runs
        ]
        return {**head, "choices": choices, "usage": usage([c for _, _, c in runs])}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HttpRequest):
        adapter = service.check_model(body.model)
        if service.chat_format is None:
            raise ApiError(400, "this model has no tokenizer, so no chat template; use completions")
        shape = Shape.of(body, service.grammars)
        fmt = service.chat_format
        text = fmt.render(template_messages(body), add_generation_prompt=True, tools=shape.tools)
        prompt = fmt.encode_text(text)
        limit = body.max_completion_tokens or body.max_tokens
        params = service.params(body, prompt, limit, adapter=adapter)
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        choice = Choice(
            0, prompt, service.decode, stops=body.stop, hidden=params.stop_tokens, logprobs=top_n
        )
        runs = [(prompt, params, choice)]
        _check_all(service, runs)
        service.constrain(choice, params, shape.grammar)
        head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time())}
        head["model"] = body.model
        if body.stream:
            return stream_chat(service, runs, head, body, Reader(shape))
        await _collect(http, service, runs)
        reader = Reader(shape)
        reader.feed(choice.text)
        content, calls = reader.finish()
        message = {"role": "assistant", "content": content} | (
            {"tool_calls": calls} if calls else {}
        )
        logprobs = {"content": choice.chat_logprobs} if top_n is not None else None
        out = {"index": 0, "message": message, "logprobs": logprobs}
        out["finish_reason"] = "tool_calls" if calls else choice.finish_reason
        return {**head, "object": "chat.completion", "choices": [out], "usage": usage([choice])}

    return app


def _prompts(service: Service, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [service.encode(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if not prompt:
        raise ApiError(400, "prompt is empty; give text or token ids", param="prompt")
    return [service.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def _check_all(service: Service, runs) -> None:
    for prompt, params, _ in runs:
        try:
            service.engine.check(prompt, params)
        except EqllmError as e:
            raise ApiError(400, str(e), param="prompt" if "prompt" in str(e) else None) from None
