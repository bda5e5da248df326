"""`eqllm serve`'s HTTP API through the official `openai` client (and raw HTTP for bad input).

One tiny random Llama with a BPE tokenizer and a chat template is served once for the module on
127.0.0.1 and a free port. Seeded outputs are compared with `eqllm.generate`, echoed prompt
log-probabilities with transformers' own forward.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
import numpy as np
import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import eqllm  # noqa: E402
from eqllm import loading  # noqa: E402
from eqllm.commands.serve import chat_format_of  # noqa: E402
from eqllm.serve import Engine  # noqa: E402
from eqllm.serve.app import Service, create_app  # noqa: E402
from tests.serve_helpers import ServerThread, post, tiny_folder  # noqa: E402

NAME = "tiny"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("serve-llama"))


@pytest.fixture(scope="module")
def served(folder):
    model, tokenizer = loading.load(folder)
    engine = Engine(model, max_batch=4, max_len=256, prefill_chunk=32, max_queue=64)
    engine.warm()
    service = Service(
        engine, tokenizer, model_name=NAME, chat_format=chat_format_of(str(folder), tokenizer)
    )
    with ServerThread(create_app(service)) as server:
        yield server, service, model, tokenizer


@pytest.fixture(scope="module")
def client(served):
    server, *_ = served
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _reference(model, tokenizer, prompt, n, **settings) -> list[int]:
    """`eqllm.generate` ending at the end-of-text token (which the API does not print)."""
    out = eqllm.generate(
        model, prompt, max_new_tokens=n, stop_tokens=[tokenizer.eot_id], **settings
    ).tolist()
    return out[:-1] if out and out[-1] == tokenizer.eot_id else out


def test_seeded_completion_equals_generate_and_counts_usage(served, client):
    _, _, model, tokenizer = served
    prompt = "the cat sat on"
    ids = tokenizer.encode(prompt)
    response = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0.9, seed=7, extra_body={"top_k": 40}
    )
    want = _reference(model, tokenizer, ids, 12, key=jax.random.key(7), temperature=0.9, top_k=40)
    assert response.choices[0].text == tokenizer.decode(want)
    assert response.usage.prompt_tokens == len(ids)
    assert response.usage.completion_tokens in (len(want), len(want) + 1)  # + end-of-text
    assert response.usage.total_tokens == len(ids) + response.usage.completion_tokens


def test_streaming_joins_to_the_same_text(client):
    kwargs = dict(model=NAME, prompt="a quick brown", max_tokens=20, temperature=0.7, seed=3)
    whole = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(pieces) == whole and len(pieces) > 1


def test_raw_stream_is_server_sent_events_ending_in_done(served):
    server, *_ = served
    import urllib.request

    body = b'{"model": "tiny", "prompt": "hello", "max_tokens": 5, "stream": true}'
    request = urllib.request.Request(
        f"{server.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_chat_applies_the_template_and_streams(served, client):
    _, service, model, tokenizer = served
    messages = [{"role": "user", "content": "hello world"}]
    fmt = service.chat_format
    ids = fmt.encode_text(fmt.render(messages, add_generation_prompt=True))
    assert ids[-1] != tokenizer.eot_id and "<|assistant|>" in tokenizer.decode(ids)
    kwargs = dict(model=NAME, messages=messages, max_tokens=10, temperature=0.5, seed=11)
    response = client.chat.completions.create(**kwargs)
    want = _reference(model, tokenizer, ids, 10, key=jax.random.key(11), temperature=0.5)
    assert response.choices[0].message.content == tokenizer.decode(want)
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(ids)
    streamed = client.chat.completions.create(**kwargs, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == response.choices[0].message.content


def test_stop_string_cuts_the_text(client):
    kwargs = dict(model=NAME, prompt="one two", max_tokens=30, temperature=0.0)
    full = client.completions.create(**kwargs).choices[0].text
    assert len(full) > 4
    stop = full[2:4]
    cut = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    assert client.completions.create(**kwargs).choices[0].finish_reason == "length"


def test_echo_logprobs_equal_transformers(served, folder, client):
    _, _, _, tokenizer = served
    text = "the quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text)
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=1, logprobs=1, echo=True)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    want = logits[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(lp.token_logprobs[1 : len(ids)], want, atol=1e-4)
    assert out.choices[0].text.startswith(tokenizer.decode(ids))
    greedy = logits.argmax(-1).numpy()
    for i in range(1, len(ids)):
        (best,) = lp.top_logprobs[i].values()
        assert best == pytest.approx(float(logits[i - 1, greedy[i - 1]]), abs=1e-4)


def test_models_and_health(served, client):
    server, *_ = served
    assert [m.id for m in client.models.list().data] == [NAME]
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as response:
        assert response.status == 200


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        ({"model": NAME, "prompt": "hi", "max_token": 3}, 400, "max_token"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ({"model": NAME, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": NAME, "prompt": "hi", "top_p": 2}, 400, "top_p"),
        ({"model": NAME, "prompt": [1] * 300, "max_tokens": 1}, 400, "prompt"),
        ({"model": NAME, "prompt": [1] * 250, "max_tokens": 10}, 400, "prompt"),
        ({"model": NAME, "prompt": [10**6]}, 400, "prompt"),
        ({"model": NAME, "messages": []}, 400, "messages"),
    ],
)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(
    served, client, body, status, param
):
    server, *_ = served
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else ""
    got, error = post(f"{server.url}{path or '/v1/completions'}", body)
    assert got == status, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["error"]["param"] == param, error
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).choices


def test_api_key_is_required_when_set(served):
    server, service, *_ = served
    service.api_key = "sesame"
    try:
        url = f"{server.url}/v1"
        refused = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            refused.completions.create(model=NAME, prompt="hi", max_tokens=2)
        status, _ = post(f"{url}/completions", {"model": NAME, "prompt": "hi"})
        assert status == 401
        allowed = openai.OpenAI(base_url=url, api_key="sesame", max_retries=0)
        assert allowed.completions.create(model=NAME, prompt="hi", max_tokens=2).choices
    finally:
        service.api_key = None


def test_full_queue_answers_429(served, client):
    _, service, *_ = served
    service.engine.max_queue = 0
    try:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=NAME, prompt="hi", max_tokens=2)
    finally:
        service.engine.max_queue = 64
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).choices


def test_a_client_that_disconnects_frees_its_slot(served, client):
    _, service, *_ = served
    engine = service.engine
    before = engine.scheduler.cancelled
    stream = client.completions.create(
        model=NAME,
        prompt=[5],
        max_tokens=250,
        temperature=1.0,
        stream=True,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()
    for _ in range(100):  # bounded: 10 s
        if engine.busy() == 0:
            break
        time.sleep(0.1)
    assert engine.busy() == 0 and engine.scheduler.cancelled == before + 1
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).choices


def test_many_concurrent_clients_get_what_each_gets_alone(served, client):
    prompts = [f"{w} sat on the" for w in ("cat", "dog", "fox", "one", "two", "hello")] * 11
    prompts = prompts[:64]

    def ask(prompt):
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
        return out.choices[0].text

    alone = {p: ask(p) for p in set(prompts)}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, prompts))
    assert together == [alone[p] for p in prompts]
