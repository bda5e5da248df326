"""vLLM's tokenizer routes: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

lm-evaluation-harness's `local-completions` looks for them (`tokenizer_backend=auto`, its
default) and, when they answer, tokenizes through the server: no tokenizer is needed on the
client, and the client counts context tokens with the tokenizer the model was served with.
Text is encoded as transformers' tokenizer does (special-token strings are those tokens; with
`add_special_tokens` the tokenizer's post-processor adds its BOS), ids decode with special
tokens kept. Like vLLM, these routes sit outside `/v1` and so outside the API key.
"""

from __future__ import annotations

import tokenizers
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from eqllm.serve.protocol import ApiError, ChatRequest, Message
from eqllm.serve.tools import template_messages


class TokenizeRequest(BaseModel):
    """Text (`prompt`) or a conversation (`messages`, rendered by the chat template)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's defaults: True for text, False for chat
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def tokenizer_routes(service) -> APIRouter:
    """The three routes over `service` (an `eqllm.serve.app.Service`)."""
    router = APIRouter()
    with_specials: list[tokenizers.Tokenizer] = []  # made on first use

    def hf() -> tokenizers.Tokenizer:
        if service.tokenizer is None:
            raise ApiError(
                400, "this model has no tokenizer: send token ids, and tokenize on the client"
            )
        if not with_specials:
            with_specials.append(tokenizers.Tokenizer.from_str(service.tokenizer.to_str()))
        return with_specials[0]

    def check(name: str | None) -> None:
        if name is not None:
            service.check_model(name)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        hf()  # refuses a model without a tokenizer
        text, special = body.prompt, body.add_special_tokens
        if body.messages is not None:
            if service.chat_format is None:
                raise ApiError(400, "this model has no chat template", param="messages")
            text = service.chat_format.render(
                template_messages(ChatRequest(model=service.model_name, messages=body.messages)),
                add_generation_prompt=body.add_generation_prompt,
            )
            special = bool(special)
        if service.tokenizer.kind == "bytes":  # eqllm's byte ids; no post-processor to run
            ids = service.tokenizer.encode_with_specials(text)
        else:
            ids = hf().encode(text, add_special_tokens=special is not False).ids
        out = {"count": len(ids), "max_model_len": service.engine.max_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [hf().id_to_token(i) for i in ids]
        return out

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check(body.model)
        vocab = service.engine.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside [0, {vocab})", param="tokens")
        return {"prompt": service.decode(body.tokens)}

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        hf()  # refuses a model without a tokenizer
        tok = service.tokenizer
        info: dict = {"tokenizer_class": "PreTrainedTokenizerFast", **tok.special_tokens}
        info["model_max_length"] = service.engine.max_len
        if service.chat_format is not None:  # the template the chat route applies
            info["chat_template"] = service.chat_format.template
        return info

    return router
