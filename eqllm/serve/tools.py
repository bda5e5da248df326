"""Structured output and tool calls: `response_format` (both routes), `tools`, `tool_choice` and
`parallel_tool_calls` (the chat route).

`format_grammar` turns a `response_format` into a grammar (`eqllm.generation.constrain`), for
/v1/completions (as vLLM takes it there) and /v1/chat/completions alike. `Shape.of(body, ...)`
checks a chat request's fields (400 for a bad schema, an unknown tool name, a choice without
tools) and decides three things: the `tools` the chat template is rendered with
(transformers' convention: a list of `{"type": "function", "function": {...}}`), the grammar the
output is held to, and how the output is read (`Reader`):

- `response_format` `json_object` / `json_schema`: the output is JSON (valid against the
  schema), returned as the message's content.
- `tool_choice` "required": the output is one or more calls in the Hermes / Qwen form,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the arguments valid
  against the function's `parameters`; exactly one with `parallel_tool_calls` false. A named
  function: one call of it. They are returned as `tool_calls` (finish_reason "tool_calls").
  The blocks are the form the Hermes, Qwen 2.5 / 3 and SmolLM3 templates ask for in their
  system turn and write earlier calls in, one block per call; so a constrained answer is one
  such a model would write, and "auto" reads it the same way.
- `tool_choice` "auto" (the default with tools): the model writes freely; calls it writes in
  that form become `tool_calls` (only the first with `parallel_tool_calls` false), the text
  before them the content. "none": the text is the content.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets

from eqllm.errors import EqllmError
from eqllm.serve.protocol import ApiError, ChatRequest, ResponseFormat

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.S)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclasses.dataclass
class Shape:
    """What a chat request's structure fields ask for (see the module docstring)."""

    tools: list[dict] | None = None  # for the chat template
    grammar: str | None = None  # the output's grammar (None: free text)
    mode: str = "text"  # "text", "auto" (calls in the text) or "call" (the output is calls)
    names: tuple[str, ...] = ()
    most: int | None = None  # calls kept (None: all)

    @classmethod
    def of(cls, body: ChatRequest, grammars) -> Shape:
        """The request's shape; `grammars` (`eqllm.generation.constrain.Grammars`, or a
        function returning one) compiles the schemas. ApiError 400 for bad input."""
        choice = body.tool_choice
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        names = tuple(t.function.name for t in body.tools or [])
        if len(set(names)) != len(names):
            raise ApiError(400, "tools: two functions share a name; name each once", param="tools")
        if choice not in (None, "none", "auto") and not names:
            raise ApiError(
                400, "tool_choice needs tools; give tools or leave it out", param="tool_choice"
            )
        fmt = body.response_format
        wants_json = fmt is not None and fmt.type != "text"
        forced = choice == "required" or (choice is not None and not isinstance(choice, str))
        if wants_json and forced:
            raise ApiError(
                400,
                "response_format and a required tool_choice both shape the output; give one",
                param="response_format",
            )
        single = body.parallel_tool_calls is False
        shape = cls(tools=tools or None, names=names, most=1 if single else None)
        try:
            if wants_json:
                shape.grammar = format_grammar(fmt, grammars)
            elif forced:
                chosen = names if isinstance(choice, str) else (choice.function.name,)
                if chosen[0] not in names:
                    raise ApiError(
                        400,
                        f"tool_choice names {chosen[0]!r}, which is not in tools {list(names)}",
                        param="tool_choice",
                    )
                many = choice == "required" and not single  # a named function: one call
                shape.grammar = _grammars(grammars).tool_calls(call_schema(body, chosen), many=many)
                shape.mode = "call"
            elif names and choice != "none":
                shape.mode = "auto"
        except ApiError:
            raise
        except EqllmError as e:
            raise ApiError(400, str(e), param="tools") from None
        return shape


def format_grammar(fmt: ResponseFormat | None, grammars) -> str | None:
    """The grammar a `response_format` holds the output to (None: free text); `grammars` as in
    `Shape.of`. ApiError 400 naming `response_format` for a schema that does not compile."""
    if fmt is None or fmt.type == "text":
        return None
    schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
    try:
        return _grammars(grammars).json_schema(schema)
    except ApiError:
        raise
    except EqllmError as e:
        raise ApiError(400, str(e), param="response_format") from None


def _grammars(grammars):
    return grammars() if callable(grammars) else grammars


def call_schema(body: ChatRequest, names: tuple[str, ...]) -> dict:
    """The JSON schema of one call to any of the functions `names`."""
    options = []
    for tool in body.tools or []:
        f = tool.function
        if f.name in names:
            arguments = f.parameters if f.parameters is not None else NO_ARGUMENTS
            options.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": f.name}, "arguments": arguments},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
    return options[0] if len(options) == 1 else {"anyOf": options}


def template_messages(body: ChatRequest) -> list[dict]:
    """The messages as a chat template reads them: text content, and each earlier call's
    arguments as an object (templates write them with `tojson`), as transformers expects."""
    out = []
    for m in body.messages:
        message = {**m.model_dump(exclude={"content", "tool_calls"}), "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _object(c.function)},
                }
                for c in m.tool_calls
            ]
        out.append(message)
    return out


def _object(function) -> dict | str:
    try:
        return json.loads(function.arguments)
    except json.JSONDecodeError:
        return function.arguments


def _call(text: str, names: tuple[str, ...]) -> dict | None:
    """A tool call of OpenAI's shape from `{"name": ..., "arguments": {...}}` text, or None."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": data["name"], "arguments": json.dumps(arguments)},
    }


def parse_calls(text: str, names: tuple[str, ...]) -> tuple[str, list[dict]]:
    """(content, calls) of text that may hold `<tool_call>` blocks: the content is the text
    before the first block; a block that is not a call of a known function stays text."""
    calls = [_call(m.group(1), names) for m in _CALL.finditer(text)]
    if not calls or any(c is None for c in calls):
        return text, []
    return text[: text.find(OPEN)], calls


class Reader:
    """Reads a chat answer of a `Shape`: `feed` the text as it comes (returns the content that
    is final), then `finish` for the content and the calls."""

    def __init__(self, shape: Shape):
        self.shape, self.text, self.sent = shape, "", 0

    def feed(self, piece: str) -> str:
        """Content that can be sent now: in "auto", text that may start a call is held back;
        in "call", nothing (the output is the call)."""
        self.text += piece
        mode = self.shape.mode
        if mode == "call":
            return ""
        upto = len(self.text)
        if mode == "auto":
            at = self.text.find(OPEN)
            upto = at if at >= 0 else upto - _held(self.text)
        out = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out

    def finish(self) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of the whole answer (content None when only calls)."""
        if self.shape.mode == "text":
            return self.text, []
        content, calls = parse_calls(self.text, self.shape.names)
        if not calls:  # (held to the grammar, only an answer cut by max_tokens)
            return self.text, []
        return content if content.strip() else None, calls[: self.shape.most]

    def rest(self) -> str:
        """Content not sent yet (at the end of a stream)."""
        return (self.finish()[0] or "")[self.sent :]


def _held(text: str) -> int:
    """Characters at the end of `text` that may be the start of OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def stream_calls(calls: list[dict]) -> list[dict]:
    """`delta.tool_calls` entries of whole calls (each with its index)."""
    return [{"index": i, **c} for i, c in enumerate(calls)]
