"""The OpenAI-compatible HTTP app (FastAPI) on an `Engine`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat template), both
streamed as server-sent events ending in `data: [DONE]` when asked; `GET /v1/models`;
`GET /health`; vLLM's tokenizer routes (`eqllm.serve.tokenize`). Bad input gets OpenAI's error
body with a 4xx status and one log line; a full queue gets 429, a server shutting down 503. A
client that goes away cancels its requests, which frees their slots at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from eqllm.data import Tokenizer
from eqllm.data.instruct import ChatFormat
from eqllm.errors import EqllmError
from eqllm.generation import Engine, Finished, Params, QueueFull
from eqllm.generation.constrain import Grammars, refuse_speculation
from eqllm.serve.protocol import ApiError, ChatRequest, CompletionRequest
from eqllm.serve.text import Choice, usage
from eqllm.serve.tokenize import tokenizer_routes
from eqllm.serve.tools import Reader, Shape, stream_calls, template_messages

log = logging.getLogger("eqllm.serve")


class Service:
    """What the routes share: the engine, the tokenizer (None: prompts and text are token
    ids), the served model name, the chat format, the API key, the names of the engine's LoRA
    adapters (a request's `model` picks one; `eqllm.serve.adapters`)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer | None,
        *,
        model_name: str,
        chat_format: ChatFormat | None = None,
        api_key: str | None = None,
        adapters: Sequence[str] = (),
    ):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.chat_format, self.api_key = chat_format, api_key
        self.adapters = list(adapters)
        self.closing = False
        self.created = int(time.time())
        self._grammars: Grammars | None = None

    def grammars(self) -> Grammars:
        """The grammar library over this tokenizer (made on first use)."""
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so no structured output")
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.engine.config.vocab_size)
        return self._grammars

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return "".join(f" {i}" for i in ids)
        return self.tokenizer.decode(ids)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            try:
                return [int(t) for t in text.split()]
            except ValueError:
                raise ApiError(
                    400, "this model has no tokenizer: send the prompt as token ids", param="prompt"
                ) from None
        # special-token strings (a rendered chat template's) are those tokens, as in vLLM and
        # transformers, and as /tokenize gives them
        return self.tokenizer.encode_with_specials(text)

    def default_stops(self) -> tuple[int, ...]:
        t = self.tokenizer
        if t is not None and t.eot_id < self.engine.config.vocab_size:
            return (t.eot_id,)
        return ()

    def check_model(self, name: str) -> int:
        """The adapter index the model id `name` picks (0: the base model)."""
        ids = [self.model_name, *self.adapters]
        if name not in ids:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves "
                + ", ".join(repr(i) for i in ids),
                param="model",
                code="model_not_found",
            )
        return ids.index(name)

    def params(
        self, body, prompt: list[int], max_tokens: int | None, prompt_logprobs=False, adapter=0
    ):
        stops = tuple(body.stop_token_ids or ())
        if not body.ignore_eos:
            stops += self.default_stops()
        if max_tokens is None:
            max_tokens = max(self.engine.max_len - len(prompt), 0)
        return Params(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_k=body.top_k or None,
            top_p=None if body.top_p == 1 else body.top_p,
            min_p=body.min_p or None,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
            logprobs=_wants_alternatives(body),
            stop_tokens=stops,
            prompt_logprobs=prompt_logprobs,
            adapter=adapter,
        )

    async def events(
        self, prompt: list[int], params: Params, constraint=None
    ) -> AsyncIterator[object]:
        """The engine's events for one request, ending with Finished; cancels it when the
        consumer stops early (a disconnect cancels the consuming task)."""
        if self.closing:
            raise ApiError(503, "the server is shutting down", kind="server_error")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(event):
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                loop.call_soon_threadsafe(queue.put_nowait, event)

        try:
            request = self.engine.submit(prompt, params, sink, constraint=constraint)
        except QueueFull as e:
            raise ApiError(429, str(e), kind="rate_limit_error") from None
        except EqllmError as e:
            raise ApiError(400, str(e)) from None
        try:
            while True:
                event = await queue.get()
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            request.cancel()


def _wants_alternatives(body) -> bool:
    """Whether generated tokens carry their most likely alternatives (`top_logprobs`)."""
    if isinstance(body, ChatRequest):
        return bool(body.logprobs and body.top_logprobs)
    return bool(body.logprobs)


def _sse(data) -> bytes:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()


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
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time())}
        head |= {"object": "text_completion", "model": body.model}
        if body.stream:
            return _stream_completions(http, service, runs, head, body)
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
        if shape.grammar is not None:
            try:
                refuse_speculation(shape.grammar, service.engine.speculator)
                stops = params.stop_tokens or service.default_stops()  # where the grammar ends
                choice.constraint = service.grammars().constraint(shape.grammar, stops)
                choice.hidden |= set(stops)
            except EqllmError as e:
                raise ApiError(400, str(e)) from None
        head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time())}
        head["model"] = body.model
        if body.stream:
            return _stream_chat(http, service, runs, head, body, Reader(shape))
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


def _stream_completions(http, service, runs, head, body) -> StreamingResponse:
    async def chunks():
        for prompt, params, choice in runs:  # one choice after the other
            if choice.echo:
                yield _sse({**head, "choices": [_piece(choice, choice.prefix, None)]})
            async for event in service.events(prompt, params):
                text = choice.on(event)
                done = isinstance(event, Finished) or choice.stopped
                if text or done:
                    reason = choice.finish_reason or "stop" if done else None
                    yield _sse({**head, "choices": [_piece(choice, text, reason)]})
                if done:
                    break
        if (body.stream_options or {}).get("include_usage"):
            yield _sse({**head, "choices": [], "usage": usage([c for _, _, c in runs])})
        yield _sse("[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream")


def _piece(choice: Choice, text: str, reason: str | None) -> dict:
    return {"index": choice.index, "text": text, "logprobs": None, "finish_reason": reason}


def _stream_chat(http, service, runs, head, body, reader: Reader) -> StreamingResponse:
    head = {**head, "object": "chat.completion.chunk"}
    prompt, params, choice = runs[0]

    def chunk(delta, reason=None):
        return _sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]})

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
        if calls:
            yield chunk({"tool_calls": stream_calls(calls)})
        yield chunk({}, "tool_calls" if calls else choice.finish_reason or "stop")
        if (body.stream_options or {}).get("include_usage"):
            yield _sse({**head, "choices": [], "usage": usage([choice])})
        yield _sse("[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream")
