"""The tool-calling server the structured-output tests share: a tiny random Llama with a BPE
tokenizer and a Hermes-style chat template (tools in the system turn, calls as
`<tool_call>{...}</tool_call>`), and the functions offered to it."""

from __future__ import annotations

import contextlib
import json

from eqllm import loading
from eqllm.commands.serve import chat_format_of
from eqllm.serve import Engine
from eqllm.serve.app import Service, create_app
from tests.serve_helpers import ServerThread, tiny_folder

NAME = "tiny"
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}"
    "({{ t['function']['description'] }}){% endfor %}"
    "{{ eos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HI = [{"role": "user", "content": "hello world"}]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@contextlib.contextmanager
def tools_server(root, context: int = 256):
    """(server, service, model): the tiny model served on 127.0.0.1 and a free port."""
    folder = tiny_folder(root, context=context)
    config = folder / "tokenizer_config.json"
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "chat_template": TOOLS_TEMPLATE})
    )
    model, tokenizer = loading.load(folder)
    engine = Engine(model, max_batch=4, max_len=context, prefill_chunk=32, max_queue=64)
    service = Service(
        engine, tokenizer, model_name=NAME, chat_format=chat_format_of(str(folder), tokenizer)
    )
    with ServerThread(create_app(service)) as server:
        yield server, service, model
