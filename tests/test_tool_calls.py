"""Parallel tool calls on /v1/chat/completions and `response_format` on /v1/completions, through
the official `openai` client (the tiny tool-calling server of tests/structured_helpers.py on
127.0.0.1 and a free port). Every call's arguments validate against its function's parameters
and every constrained completion against its schema with `jsonschema` (the reference), though
the model's weights are random; the tool-call grammar is checked on written text with
llguidance's own matcher."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from eqllm.serve.protocol import ChatRequest  # noqa: E402
from eqllm.serve.tools import Reader, Shape, call_schema  # noqa: E402
from tests.serve_helpers import post  # noqa: E402
from tests.structured_helpers import (  # noqa: E402
    CLOCK,
    HI,
    NAME,
    WEATHER,
    schema_format,
    tools_server,
)

ASK = [{"role": "user", "content": "weather in Oslo and the time?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "n"],
    "additionalProperties": False,
}
SEEDS = range(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tools_server(tmp_path_factory.mktemp("tool_calls"), context=512) as out:
        yield out


@pytest.fixture(scope="module")
def client(served):
    server, *_ = served
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _check_call(name: str, arguments: str) -> None:
    if name == "get_weather":
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    else:
        assert name == "get_time" and json.loads(arguments) == {}


def _ask(client, seed, **extra):
    return client.chat.completions.create(
        model=NAME,
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        max_tokens=360,
        seed=seed,
        **extra,
    )


def test_required_gives_one_or_more_calls_and_parallel_false_one(client):
    counts: dict[bool, list[int]] = {True: [], False: []}
    for parallel in (True, False):
        extra = {} if parallel else {"parallel_tool_calls": False}
        for seed in SEEDS:
            choice = _ask(client, seed, **extra).choices[0]
            assert choice.finish_reason == "tool_calls", choice.message.content
            assert choice.message.content is None
            calls = choice.message.tool_calls
            for call in calls:
                _check_call(call.function.name, call.function.arguments)
            assert len({c.id for c in calls}) == len(calls)
            counts[parallel].append(len(calls))
    assert set(counts[False]) == {1}
    assert min(counts[True]) >= 1 and max(counts[True]) >= 2, counts  # several calls happen


def test_streamed_calls_carry_their_indices(client):
    for seed in SEEDS:
        whole = _ask(client, seed).choices[0].message.tool_calls
        if len(whole) >= 2:
            break
    else:
        pytest.fail("no seed gave several calls")
    calls: dict[int, dict] = {}
    order, reasons = [], []
    for chunk in _ask(client, seed, stream=True):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                order.append(d.index)
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert order == list(range(len(whole)))  # one delta per call, in order
    assert reasons[-1] == "tool_calls"
    got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    assert got == want  # the same seed: the same calls as the answer not streamed
    assert all(c["id"] for c in calls.values())


def test_the_grammar_takes_several_blocks_only_when_parallel(served):
    _, service, _ = served
    grammars, tokenizer = service.grammars(), service.tokenizer
    body = ChatRequest(model=NAME, messages=HI, tools=[WEATHER, CLOCK])
    schema = call_schema(body, ("get_weather", "get_time"))
    one = '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
    two = one + '\n<tool_call>{"name":"get_weather","arguments":{"city":"Lima","days":2}}'
    two += "</tool_call>"
    bad = '<tool_call>{"name":"get_weather","arguments":{"city":"Rome","days":2}}</tool_call>'
    stops = (tokenizer.eot_id,)

    def accepts(text: str, many: bool) -> bool:
        constraint = grammars.constraint(grammars.tool_calls(schema, many=many), stops)
        tokens = tokenizer.encode(text) + [tokenizer.eot_id]
        return all(constraint.matcher.consume_token(t) for t in tokens) and constraint.finished

    assert accepts(one, many=True) and accepts(one, many=False)
    assert accepts(two, many=True) and not accepts(two, many=False)
    assert not accepts(bad, many=True)  # "Rome" is not in the enum
    assert not accepts('{"name":"get_time","arguments":{}}', many=True)  # no block


def test_auto_reads_several_blocks_and_parallel_false_keeps_the_first():
    text = 'Two calls. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
    text += '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for parallel, names in [(None, ["get_time", "get_weather"]), (False, ["get_time"])]:
        body = ChatRequest(
            model=NAME, messages=HI, tools=[WEATHER, CLOCK], parallel_tool_calls=parallel
        )
        reader = Reader(Shape.of(body, grammars=None))
        sent = "".join(reader.feed(text[i : i + 4]) for i in range(0, len(text), 4))
        content, calls = reader.finish()
        assert sent + reader.rest() == content == "Two calls. "
        assert [c["function"]["name"] for c in calls] == names


def test_completions_take_response_format(client):
    prompts = ["the cat sat on", "one two three"]
    out = client.completions.create(
        model=NAME,
        prompt=prompts,
        max_tokens=80,
        seed=0,
        extra_body={"response_format": schema_format(SCHEMA)},
    )
    texts = {}
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)
        texts[choice.index] = choice.text
    assert sorted(texts) == [0, 1]
    streamed: dict[int, str] = {}
    stream = client.completions.create(
        model=NAME,
        prompt=prompts,
        max_tokens=80,
        seed=0,
        stream=True,
        extra_body={"response_format": schema_format(SCHEMA)},
    )
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == texts  # the same seed, streamed or not
    for seed in range(3):
        obj = client.completions.create(
            model=NAME,
            prompt="hello",
            max_tokens=120,
            seed=seed,
            extra_body={"response_format": {"type": "json_object"}},
        ).choices[0]
        if obj.finish_reason == "stop":  # (a random model may fill max_tokens in a string)
            assert isinstance(json.loads(obj.text), dict)
        else:
            assert obj.text.startswith("{")


@pytest.mark.parametrize(
    "response_format, param",
    [
        (schema_format({"type": "objekt"}), "response_format"),
        ({"type": "json_schema"}, "response_format"),
        ({"type": "xml"}, "response_format.type"),
    ],
)
def test_bad_response_format_on_completions_gets_an_openai_error(served, response_format, param):
    server, *_ = served
    body = {"model": NAME, "prompt": "hi", "max_tokens": 4, "response_format": response_format}
    status, error = post(f"{server.url}/v1/completions", body)
    assert status == 400, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["param"] == param, error
