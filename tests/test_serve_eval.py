"""Evaluation through `eqllm serve`: lm-evaluation-harness's `local-completions` and
`local-chat-completions` against the server give the scores of the in-process `eqllm` backend.

The slow comparison runs on a chat model folder as one is published (Qwen3's real tokenizer and
chat template, `tests/serve_eval.py`) with random weights: the scores are those of random
weights, what is asserted is that the two paths agree document by document. The default twin
checks the same request shapes (echo + logprobs, token-id prompts, vLLM's tokenizer routes) on
the tiny BPE folder of the serving tests, without lm_eval's task index.
"""

from __future__ import annotations

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("openai")

import eqllm.harness  # noqa: E402, F401  (registers the model name "eqllm")
from eqllm import loading  # noqa: E402
from eqllm.data.instruct import ChatFormat  # noqa: E402
from eqllm.harness.backend import EqllmLM  # noqa: E402
from eqllm.serve import Engine  # noqa: E402
from eqllm.serve.app import Service, create_app  # noqa: E402
from tests.serve_eval import qwen3_chat_folder  # noqa: E402
from tests.serve_helpers import ServerThread, post, tiny_folder  # noqa: E402
from tests.test_harness import REPO, TASKS_DIR, _responses  # noqa: E402

CONTEXT = 128
NAME = "qwen3-tiny"
MC, GEN = "eqllm_toy_mc", "eqllm_toy_gen"


def _serve(folder, name: str):
    model, tokenizer = loading.load(folder)
    engine = Engine(model, max_batch=4, max_len=CONTEXT, prefill_chunk=32)
    service = Service(engine, tokenizer, model_name=name, chat_format=ChatFormat(tokenizer))
    return model, tokenizer, ServerThread(create_app(service))


def _loglikelihoods(ours: dict, ref: dict, task: str) -> np.ndarray:
    """[request, 2] log-likelihoods; asserts the greedy flags are equal."""
    a, b = _responses(ours, task), _responses(ref, task)
    assert len(a) == len(b) > 0
    pairs = [p for docs in zip(a, b, strict=True) for p in zip(*docs, strict=True)]
    assert [x[0][1] for x, _ in pairs] == [y[0][1] for _, y in pairs]
    return np.array([[float(x[0][0]), float(y[0][0])] for x, y in pairs])


def _assert_same_scores(ours: dict, ref: dict, task: str) -> None:
    for metric, value in ref["results"][task].items():
        if metric.startswith(("acc", "exact_match")) and "stderr" not in metric:
            assert ours["results"][task][metric] == value, (task, metric)


# The comparison on a real chat tokenizer and template ---------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """lm_eval's results, in process and through the server, for each way of asking."""
    folder = qwen3_chat_folder(tmp_path_factory.mktemp("qwen3-chat"), context=CONTEXT)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # the task YAMLs name their data relative to the repository
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        manager = lm_eval.tasks.TaskManager(include_path=str(TASKS_DIR))
        common = dict(task_manager=manager, log_samples=True)
        model, tokenizer, server = _serve(folder, NAME)
        out = {}
        with server:
            url = f"model={NAME},base_url={server.url}/v1"
            for backend in ("huggingface", "auto"):  # auto: the server's /tokenize routes
                args = f"{url}/completions,tokenizer_backend={backend},max_length={CONTEXT}"
                if backend == "huggingface":
                    args += f",tokenizer={folder}"
                out[backend] = lm_eval.simple_evaluate(
                    model="local-completions",
                    model_args=args,
                    batch_size=4,
                    tasks=[MC, GEN],
                    **common,
                )
            out["chat"] = lm_eval.simple_evaluate(
                model="local-chat-completions",
                model_args=f"{url}/chat/completions,max_length={CONTEXT}",
                tasks=[GEN],
                apply_chat_template=True,
                **common,
            )
        local = EqllmLM(model=model, tokenizer=tokenizer, batch_size=4)
        out["local"] = lm_eval.simple_evaluate(model=local, tasks=[MC, GEN], **common)
        out["local_chat"] = lm_eval.simple_evaluate(
            model=local, tasks=[GEN], apply_chat_template=True, **common
        )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["huggingface", "auto"])
def test_local_completions_loglikelihoods_equal_in_process(runs, backend):
    ll = _loglikelihoods(runs[backend], runs["local"], MC)
    np.testing.assert_allclose(ll[:, 0], ll[:, 1], atol=1e-4, rtol=0)
    assert len(set(np.round(ll[:, 1], 3))) > len(ll) // 2  # distinct scores, not a constant
    _assert_same_scores(runs[backend], runs["local"], MC)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["huggingface", "auto"])
def test_local_completions_generations_equal_in_process(runs, backend):
    ours, ref = _responses(runs[backend], GEN), _responses(runs["local"], GEN)
    assert ours == ref
    assert len({r[0][0] for r in ref}) > 1  # the texts differ by prompt
    _assert_same_scores(runs[backend], runs["local"], GEN)


@pytest.mark.slow
def test_local_chat_completions_generations_equal_in_process(runs):
    served = sorted(runs["chat"]["samples"][GEN], key=lambda s: s["doc_id"])
    local = sorted(runs["local_chat"]["samples"][GEN], key=lambda s: s["doc_id"])
    prompt = local[0]["arguments"][0][0]
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
    assert '"role": "user"' in str(served[0]["arguments"][0][0])  # messages: the server renders
    assert [s["resps"] for s in served] == [s["resps"] for s in local]
    assert len({s["resps"][0][0] for s in local}) > 1
    _assert_same_scores(runs["chat"], runs["local_chat"], GEN)


# The default twin: the same request shapes on a tiny vocabulary ------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tiny_folder(tmp_path_factory.mktemp("serve-eval-tiny"), context=CONTEXT)
    model, tokenizer, server = _serve(folder, "tiny")
    with server:
        yield server, model, tokenizer


def test_tokenizer_routes_answer_as_vllm(tiny):
    server, _, tokenizer = tiny
    text = "the cat sat<|endoftext|> on the mat"
    status, body = post(f"{server.url}/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200 and body["tokens"] == tokenizer.encode_with_specials(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == CONTEXT
    assert tokenizer.eot_id in body["tokens"]  # special-token strings are those tokens
    status, back = post(f"{server.url}/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": text}
    messages = [{"role": "user", "content": "hello"}]
    status, chat = post(f"{server.url}/tokenize", {"messages": messages})
    assert status == 200 and tokenizer.decode(chat["tokens"]).endswith("<|assistant|>")
    status, error = post(f"{server.url}/detokenize", {"tokens": [10**6]})
    assert status == 400 and error["error"]["param"] == "tokens"
    status, error = post(f"{server.url}/tokenize", {"prompt": "a", "model": "other"})
    assert status == 404 and error["error"]["code"] == "model_not_found"
    status, error = post(f"{server.url}/tokenize", {"prompt": "a", "messages": messages})
    assert status == 400


def _requests(kind: str, args: list) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _clients(server, model, tokenizer):
    """lm_eval's own API models against `server` (tokenizing through its routes, as `auto`
    finds them), and the in-process backend on the same model."""
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    common = dict(model="tiny", max_length=CONTEXT, max_retries=1, timeout=60)
    remote = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", **common)
    assert remote.tokenizer_backend == "remote" and remote.eot_token_id == tokenizer.eot_id
    chat = LocalChatCompletion(base_url=f"{server.url}/v1/chat/completions", **common)
    return remote, chat, EqllmLM(model=model, tokenizer=tokenizer, batch_size=4)


def test_lm_eval_loglikelihoods_through_the_server_equal_in_process(tiny):
    remote, _, local = _clients(*tiny)
    pairs = [("the cat sat on", " the mat"), ("a quick brown", " fox jumps"), ("hello", " world")]
    ours = remote.loglikelihood(_requests("loglikelihood", pairs))
    ref = local.loglikelihood(_requests("loglikelihood", pairs))
    np.testing.assert_allclose([o[0] for o in ours], [r[0] for r in ref], atol=1e-4, rtol=0)
    assert [o[1] for o in ours] == [r[1] for r in ref]


@pytest.mark.slow  # compiles the in-process generation too
def test_lm_eval_generations_through_the_server_equal_in_process(tiny):
    remote, chat, local = _clients(*tiny)
    # five stop strings and the end-of-text one: more than OpenAI's 4, as humaneval sends
    stops = [".", "\nclass", "\ndef", "\n#", "\nif"]
    until = {"until": stops, "max_gen_toks": 6, "do_sample": False}
    prompts = [("the cat sat", until), ("one two three", until)]
    ours = remote.generate_until(_requests("generate_until", prompts))
    assert ours == local.generate_until(_requests("generate_until", prompts))
    messages = [{"role": "user", "content": "the cat sat"}]
    served = chat.generate_until(
        _requests("generate_until", [(chat.apply_chat_template(messages), until)])
    )
    rendered = local.apply_chat_template(messages)
    assert served == local.generate_until(_requests("generate_until", [(rendered, until)]))


def test_echo_scores_the_prompt_with_max_tokens_0_and_1(tiny):
    """lm_eval sends `max_tokens: 1` and drops the last entry; OpenAI's `max_tokens: 0` gives
    the prompt's entries alone. Both give the same prompt log-probabilities."""
    server, _, tokenizer = tiny
    ids = tokenizer.encode("the cat sat on the mat")
    body = {"model": "tiny", "prompt": [ids], "echo": True, "logprobs": 1, "temperature": 0}
    answers = []
    for n in (0, 1):
        status, out = post(f"{server.url}/v1/completions", {**body, "max_tokens": n})
        assert status == 200, out
        answers.append(out["choices"][0]["logprobs"])
    zero, one = answers
    assert len(zero["token_logprobs"]) == len(ids) and len(one["token_logprobs"]) == len(ids) + 1
    assert zero["token_logprobs"][0] is None and zero["top_logprobs"][0] is None
    assert zero["token_logprobs"] == one["token_logprobs"][:-1]
    assert zero["tokens"] == [tokenizer.decode([i]) for i in ids]
    greedy = max(one["top_logprobs"][-1].values())
    assert one["token_logprobs"][-1] == greedy  # the generated token is the argmax
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}]}
    chat |= {"max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 1}
    status, out = post(f"{server.url}/v1/chat/completions", chat)
    assert status == 200, out
    for entry in out["choices"][0]["logprobs"]["content"]:  # generated tokens' alternatives too
        assert [t["logprob"] for t in entry["top_logprobs"]] == [entry["logprob"]]


def test_text_prompts_tokenize_as_the_tokenize_route(tiny):
    """A text prompt (lm_eval's `tokenized_requests=False`) is read as /tokenize reads it:
    special-token strings in it are those tokens."""
    server, _, tokenizer = tiny
    text = "<|user|>the cat sat<|endoftext|>"
    _, tokens = post(f"{server.url}/tokenize", {"prompt": text, "add_special_tokens": False})
    body = {"model": "tiny", "prompt": text, "echo": True, "logprobs": 0, "max_tokens": 0}
    status, out = post(f"{server.url}/v1/completions", body)
    assert status == 200 and out["usage"]["prompt_tokens"] == tokens["count"]
    assert out["choices"][0]["logprobs"]["tokens"][-1] == "<|endoftext|>"
    assert out["choices"][0]["text"] == text


def test_stop_lists_longer_than_16_are_refused(tiny):
    server, *_ = tiny
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "stop": [str(i) for i in range(17)]}
    status, error = post(f"{server.url}/v1/completions", body)
    assert status == 400 and error["error"]["param"] == "stop"
