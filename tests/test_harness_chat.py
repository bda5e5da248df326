"""Chat-formatted evaluation: the eqllm backend under a model's chat template (lm_eval's
--apply_chat_template, few-shot examples as turns) against lm_eval's own hf backend, request by
request."""

from __future__ import annotations

import json

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import eqllm.harness  # noqa: E402, F401  (registers the model name "eqllm")
from eqllm.cli import main as cli_main  # noqa: E402
from eqllm.data import Tokenizer  # noqa: E402
from eqllm.hub.folders import save_tokenizer  # noqa: E402
from tests.test_harness import CONTEXT, REPO, TASKS_DIR, _corpus, _fit  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TASKS = ["eqllm_toy_mc", "eqllm_toy_gen"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny fitted Llama whose folder has a chat_template.jinja."""
    tokenizer = Tokenizer.train_bpe(_corpus() * 4, 300).with_chat_template(TEMPLATE)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT * 2,
        eos_token_id=tokenizer.eot_id,
        pad_token_id=tokenizer.eot_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    _fit(model, tokenizer, steps=30)
    out = tmp_path_factory.mktemp("harness-chat")
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    return out


@pytest.fixture(scope="module")
def results(folder):
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        torch.set_num_threads(2)
        manager = lm_eval.tasks.TaskManager(include_path=str(TASKS_DIR))
        return {
            name: lm_eval.simple_evaluate(
                model=name,
                model_args=f"pretrained={folder},dtype=float32",
                tasks=TASKS,
                num_fewshot=1,
                limit=6,
                batch_size=4,
                device="cpu",
                task_manager=manager,
                log_samples=True,
                apply_chat_template=True,
                fewshot_as_multiturn=True,
            )
            for name in ("eqllm", "hf")
        }


def _samples(results, task):
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


@pytest.mark.parametrize(
    "task", [TASKS[0], *(pytest.param(t, marks=pytest.mark.slow) for t in TASKS[1:])]
)
def test_chat_formatted_requests_equal_hf(results, task):
    ours, ref = _samples(results["eqllm"], task), _samples(results["hf"], task)
    assert len(ours) == len(ref) > 0
    for a, b in zip(ours, ref, strict=True):
        assert a["arguments"] == b["arguments"]  # the same rendered contexts
    context = ours[0]["arguments"][0][0]
    assert "user: " in context and "<|endoftext|>" in context  # the template was applied
    if task == "eqllm_toy_mc":
        both = zip(ours, ref, strict=True)
        pairs = [p for a, b in both for p in zip(a["resps"], b["resps"], strict=True)]
        ll = np.array([[float(x[0][0]), float(y[0][0])] for x, y in pairs])
        np.testing.assert_allclose(ll[:, 0], ll[:, 1], atol=1e-4, rtol=0)
        assert [x[0][1] for x, _ in pairs] == [y[0][1] for _, y in pairs]
    else:
        assert [a["resps"] for a in ours] == [b["resps"] for b in ref]


@pytest.mark.slow  # a third harness run (~1 min on two cores)
def test_eval_command_applies_the_chat_template(folder, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "r.json"
    code = cli_main(
        [
            "eval",
            str(folder),
            "--tasks",
            "eqllm_toy_mc",
            "--limit",
            "2",
            "--num-fewshot",
            "1",
            "--include-path",
            str(TASKS_DIR),
            "--apply-chat-template",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    saved = json.loads(out.read_text())
    assert saved["chat_template"] == TEMPLATE
    assert "eqllm_toy_mc" in saved["results"]
