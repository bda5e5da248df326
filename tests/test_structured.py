"""Structured output and tool calls in `eqllm serve`, through the official `openai` client.

A tiny random Llama with a BPE tokenizer and a Hermes-style chat template (tools in the system
turn, calls as `<tool_call>{...}</tool_call>`) is served once for the module on 127.0.0.1 and a
free port. Every schema-constrained answer must parse and validate against its schema with
`jsonschema` (the reference) even though the model's weights are random; the token mask is
checked against llguidance's own numpy implementation.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from llguidance.numpy import apply_token_bitmask_inplace  # noqa: E402

from eqllm.generation.constrain import Grammars, masked_logits  # noqa: E402
from eqllm.serve import Engine, Params, ServeError  # noqa: E402
from eqllm.serve.protocol import ChatRequest  # noqa: E402
from eqllm.serve.tools import Reader, Shape, parse_calls, template_messages  # noqa: E402
from tests.serve_helpers import post  # noqa: E402
from tests.structured_helpers import (  # noqa: E402
    CLOCK,
    HI,
    NAME,
    WEATHER,
    schema_format,
    tools_server,
)

# Bounded schemas (strict, as OpenAI's strict mode asks): a random model's strings and numbers
# would otherwise run past any max_tokens.
SCHEMAS = {
    "required fields": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "ok": {"type": "boolean"},
            "note": {"type": "null"},
        },
        "required": ["name", "ok", "note"],
        "additionalProperties": False,
    },
    "enum": {"enum": ["red", "green", "blue", 7]},
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -3, "maximum": 3},
        "minItems": 1,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {
                    "status": {"enum": ["open", "paid"]},
                    "items": {
                        "type": "array",
                        "maxItems": 2,
                        "items": {
                            "type": "object",
                            "properties": {"sku": {"type": "string", "maxLength": 4}},
                            "required": ["sku"],
                            "additionalProperties": False,
                        },
                    },
                },
                "required": ["status", "items"],
                "additionalProperties": False,
            }
        },
        "required": ["order"],
        "additionalProperties": False,
    },
    "number ranges": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 65},
            "score": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tools_server(tmp_path_factory.mktemp("structured")) as out:
        yield out


@pytest.fixture(scope="module")
def client(served):
    server, *_ = served
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_mask_equals_llguidance_reference():
    rng = np.random.default_rng(0)
    vocab = 300
    bitmask = rng.integers(-(2**31), 2**31, size=(3, 10), dtype=np.int64).astype(np.int32)
    bitmask[2] = 0  # nothing allowed: the row is left as it is
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    expected = logits.copy()
    apply_token_bitmask_inplace(expected[:2], bitmask[:2])
    got = np.asarray(masked_logits(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(got[:2], expected[:2])
    np.testing.assert_array_equal(got[2], logits[2])


@pytest.mark.parametrize("label", list(SCHEMAS))
def test_every_constrained_answer_validates(client, label):
    schema = SCHEMAS[label]
    for settings in ({"temperature": 0}, {"seed": 1}, {"seed": 2}):
        out = client.chat.completions.create(
            model=NAME,
            messages=HI,
            max_tokens=120,
            response_format=schema_format(schema),
            **settings,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.slow
def test_concurrent_constrained_clients_all_validate(client):
    import concurrent.futures

    def ask(i):
        label = list(SCHEMAS)[i % len(SCHEMAS)]
        out = client.chat.completions.create(
            model=NAME,
            messages=HI,
            max_tokens=120,
            seed=i,
            response_format=schema_format(SCHEMAS[label]),
            extra_body={"ignore_eos": i % 2 == 0},
        )
        return label, out.choices[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(16)))
    for label, choice in answers:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[label])


def test_json_object_answers_are_objects(client):
    for seed in range(4):
        out = client.chat.completions.create(
            model=NAME,
            messages=HI,
            max_tokens=200,
            seed=seed,
            response_format={"type": "json_object"},
        )
        choice = out.choices[0]
        if choice.finish_reason == "stop":  # (a random model may fill max_tokens in a string)
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")


def test_constrained_and_free_requests_share_a_batch_without_recompiling(served):
    _, service, model = served
    grammars = service.grammars()
    schema = {"enum": ["red", "green", "blue"]}
    prompt = service.tokenizer.encode("the cat sat on")
    eot = service.tokenizer.eot_id
    engine = Engine(model, max_batch=4, max_len=256, prefill_chunk=32)

    def run(with_constraint: bool, seed: int) -> tuple[list[int], str | None]:
        free, bound = [], []
        engine.submit(prompt, Params(max_tokens=16, seed=0), free.append)
        constraint = None
        if with_constraint:
            constraint = grammars.constraint(grammars.json_schema(schema), (eot,))
        params = Params(max_tokens=16, seed=seed, stop_tokens=(eot,))
        engine.submit(prompt, params, bound.append, constraint=constraint)
        engine.run(max_rounds=100)
        text = service.tokenizer.decode([e.id for e in bound[:-1] if e.id != eot])
        return [e.id for e in free[:-1]], text

    alone, _ = run(False, 1)
    together, text = run(True, 1)
    assert together == alone  # the free request is untouched by its constrained neighbour
    jsonschema.validate(json.loads(text), schema)
    traces = dict(engine.runner.traces)
    for seed in (2, 3):  # new constraints, other draws: the same compiled steps
        again, text = run(True, seed)
        assert again == alone
        jsonschema.validate(json.loads(text), schema)
    assert engine.runner.traces == traces


def test_tool_call_round_trips(client):
    out = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "weather in Oslo?"}],
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,  # one call (tests/test_tool_calls.py: several)
        max_tokens=140,
        seed=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    else:
        assert arguments == {}
    history = [
        {"role": "user", "content": "weather in Oslo?"},
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model=NAME, messages=history, tools=[WEATHER, CLOCK], max_tokens=8, seed=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage.prompt_tokens > out.usage.prompt_tokens  # the call and result are in


def test_streamed_tool_call_of_a_named_function(client):
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=140,
        seed=3,
        stream=True,
    )
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            assert not c.delta.content
    assert reasons[-1] == "tool_calls"
    (call,) = calls.values()
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


def test_auto_reads_hermes_calls_and_holds_them_out_of_streamed_content():
    body = ChatRequest(model=NAME, messages=HI, tools=[WEATHER])
    shape = Shape.of(body, grammars=None)
    assert shape.mode == "auto" and shape.grammar is None
    text = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
    text += "</tool_call>"
    reader = Reader(shape)
    sent = "".join(reader.feed(text[i : i + 3]) for i in range(0, len(text), 3))
    assert sent + reader.rest() == "Let me look. "
    content, calls = reader.finish()
    assert content == "Let me look. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Lima"})
    ]
    assert parse_calls('<tool_call>{"name": "nope"}</tool_call>', ("get_weather",))[1] == []
    plain = Reader(shape)
    assert plain.feed("no call <tool") == "no call " and plain.rest() == "<tool"


def test_tools_and_results_reach_the_chat_template(served):
    _, service, _ = served
    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    body = ChatRequest(
        model=NAME,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        ],
    )
    shape = Shape.of(body, service.grammars)
    text = service.chat_format.render(template_messages(body), tools=shape.tools)
    assert "tools: get_weather(The weather in a city.)" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in text
    assert "<|tool|>rain" in text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": schema_format({"type": "objekt"})}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, None),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
    ],
)
def test_bad_structure_gets_an_openai_error(served, client, extra, param):
    server, *_ = served
    status, error = post(
        f"{server.url}/v1/chat/completions", {"model": NAME, "messages": HI, **extra}
    )
    assert status == 400, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["error"]["param"] == param, error
    assert client.chat.completions.create(model=NAME, messages=HI, max_tokens=2).choices


def test_a_speculating_engine_refuses_a_constraint(served):
    _, service, model = served
    grammars = Grammars(service.tokenizer, service.engine.config.vocab_size)
    constraint = grammars.constraint(grammars.json_schema(None), (0,))
    engine = Engine(model, max_batch=2, max_len=64, speculate=2)
    with pytest.raises(ServeError, match="--speculate"):
        engine.submit([1, 2], Params(max_tokens=2), lambda e: None, constraint=constraint)


def test_missing_library_names_the_install(served, monkeypatch):
    import sys

    _, service, _ = served
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ServeError, match=r"pip install 'eqllm\[serve\]'"):
        Grammars(service.tokenizer, 300)
