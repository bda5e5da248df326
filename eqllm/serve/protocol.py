"""OpenAI's request bodies as pydantic models, and its error shape.

Unknown fields are refused (a misspelt `max_token` would otherwise be ignored silently). Fields
OpenAI defines that eqllm does not implement (`n` > 1, penalties other than 0, `logit_bias`)
are accepted only at their neutral values. `top_k`, `min_p` and `repetition_penalty` are the
usual extensions (vLLM's names).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eqllm.errors import EqllmError

MAX_STOPS = 16


class ApiError(EqllmError):
    """A request refused with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status,
            message,
            param,
            kind,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class _Common(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False  # the end-of-text token does not stop the output
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        # OpenAI takes 4; vLLM any number, and lm_eval's local-completions sends a task's
        # `until` list plus the end-of-text string (humaneval: 6).
        if len(stops) > MAX_STOPS or any(s == "" for s in stops):
            raise ValueError(f"give at most {MAX_STOPS} non-empty stop strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported; leave it out")
        return value


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`text`, `json_object` (any JSON object) or `json_schema` (JSON valid against it)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("give json_schema exactly when type is 'json_schema'")
        return self


class CompletionRequest(_Common):
    """POST /v1/completions. `prompt` is text, token ids, or a list of either (one choice each)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None
    # Not in OpenAI's legacy route; vLLM and SGLang take it there as on chat.
    response_format: ResponseFormat | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported; leave it out")
        return value


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id ... pass to the template

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[Part] | None = None  # None: an assistant turn of tool calls only
    tool_calls: list[ToolCall] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class Function(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (None: no arguments)
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: Function


class ChosenFunction(BaseModel):
    name: str


class ChosenTool(BaseModel):
    """`tool_choice` naming one function."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: ChosenFunction


class ChatRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=5)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChosenTool | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call (None, True: several)
