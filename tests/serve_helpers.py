"""Shared pieces of the serving tests: a tiny Hugging Face folder and a server on a free port."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import uvicorn

from eqllm.data import Tokenizer
from eqllm.hub.folders import save_tokenizer

TEXTS = [
    "the cat sat on the mat and the dog sat on the log",
    "a quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny language model talking",
    "one two three four five six seven eight nine ten",
]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_llama(tokenizer: Tokenizer, context: int):
    """A random 2-layer Llama of d_model 32 (seed 0) for `tokenizer`'s vocabulary."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        eos_token_id=tokenizer.eot_id,
        pad_token_id=tokenizer.eot_id,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def tiny_folder(root: Path, *, context: int = 256) -> Path:
    """A random tiny Llama in Hugging Face format with a BPE tokenizer and a chat template."""
    tokenizer = Tokenizer.train_bpe(TEXTS * 8, 300)
    tiny_llama(tokenizer, context).save_pretrained(root)
    save_tokenizer(tokenizer, root)
    file = root / "tokenizer_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "chat_template": TEMPLATE}))
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """A uvicorn server for `app` on 127.0.0.1 in a thread (started with `with`)."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        for _ in range(600):  # bounded: 60 s
            if self.server.started:
                return self
            time.sleep(0.1)
        raise TimeoutError("the test server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=60)


def post(url: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict | str]:
    """(status, parsed JSON or text) of a raw POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text
