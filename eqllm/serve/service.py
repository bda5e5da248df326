"""What the routes of the HTTP app share (`Service`): the engine, the tokenizer, the served
model's names, the grammar library, and how a request's settings and structure reach the engine.

Structured output has one home here: both routes hold a choice to a grammar with
`Service.constrain` (the grammar itself comes from `eqllm.serve.tools`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

from eqllm.data import Tokenizer
from eqllm.data.instruct import ChatFormat
from eqllm.errors import EqllmError
from eqllm.generation import Engine, Finished, Params, QueueFull
from eqllm.generation.constrain import Grammars, refuse_speculation
from eqllm.serve.protocol import ApiError, ChatRequest
from eqllm.serve.text import Choice


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

    def constrain(self, choice: Choice, params: Params, grammar: str | None) -> None:
        """Hold `choice`'s output to `grammar` (None: leave it free): a fresh grammar state that
        ends at the request's stop tokens, which then end the output without text. 400 where
        the server cannot (no tokenizer, --speculate)."""
        if grammar is None:
            return
        try:
            refuse_speculation(grammar, self.engine.speculator)
            stops = params.stop_tokens or self.default_stops()  # where the grammar ends
            choice.constraint = self.grammars().constraint(grammar, stops)
            choice.hidden |= set(stops)
        except ApiError:
            raise
        except EqllmError as e:
            raise ApiError(400, str(e)) from None

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
