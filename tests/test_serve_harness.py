"""lm-evaluation-harness's `local-completions` model, scoring through `eqllm serve`, gives the
log-likelihoods and greedy flags of the in-process `eqllm` backend on the local tasks."""

from __future__ import annotations

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("openai")

import eqllm.harness  # noqa: E402, F401  (registers the model name "eqllm")
from eqllm import loading  # noqa: E402
from eqllm.serve import Engine  # noqa: E402
from eqllm.serve.app import Service, create_app  # noqa: E402
from tests.serve_helpers import ServerThread  # noqa: E402
from tests.test_harness import CONTEXT, REPO, TASKS_DIR, _responses, folder  # noqa: E402, F401

TASKS = ["eqllm_toy_mc", "eqllm_toy_cloze"]


@pytest.mark.slow
def test_local_completions_through_the_server_equals_the_eqllm_backend(folder, monkeypatch):  # noqa: F811
    monkeypatch.chdir(REPO)  # the task YAMLs name their data relative to the repository
    manager = lm_eval.tasks.TaskManager(include_path=str(TASKS_DIR))
    model, tokenizer = loading.load(folder)
    engine = Engine(model, max_batch=4, max_len=CONTEXT, prefill_chunk=32)
    engine.warm()
    service = Service(engine, tokenizer, model_name="tiny")
    common = dict(tasks=TASKS, task_manager=manager, log_samples=True)
    with ServerThread(create_app(service)) as server:
        served = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(
                f"model=tiny,base_url={server.url}/v1/completions,tokenizer={folder},"
                f"tokenizer_backend=huggingface,max_length={CONTEXT - 1},num_concurrent=1"
            ),
            batch_size=4,
            **common,
        )
    local = lm_eval.simple_evaluate(
        model="eqllm", model_args=f"pretrained={folder}", batch_size=4, device="cpu", **common
    )
    for task in TASKS:
        ours, ref = _responses(served, task), _responses(local, task)
        assert len(ours) == len(ref) > 0
        pairs = [p for docs in zip(ours, ref, strict=True) for p in zip(*docs, strict=True)]
        ll = np.array([[float(a[0][0]), float(b[0][0])] for a, b in pairs])
        np.testing.assert_allclose(ll[:, 0], ll[:, 1], atol=1e-4, rtol=0)
        assert [a[0][1] for a, _ in pairs] == [b[0][1] for _, b in pairs]
