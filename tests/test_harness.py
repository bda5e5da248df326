"""The lm_eval backend `eqllm` against lm_eval's own `hf` backend on one tiny random model.

A Llama-shaped transformers model with a locally trained BPE tokenizer is saved to a folder;
both backends run the local tasks in tests/harness_tasks (multiple choice, a lambada-style
cloze, rolling perplexity, greedy generation) and must agree request by request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import eqllm  # noqa: E402
import eqllm.harness  # noqa: E402, F401  (registers the model name "eqllm")
from eqllm.cli import main as cli_main  # noqa: E402
from eqllm.commands.eval import write_report_section  # noqa: E402
from eqllm.data import Tokenizer  # noqa: E402
from eqllm.data.chat import DEFAULT_TEMPLATE  # noqa: E402
from eqllm.hub.folders import save_tokenizer  # noqa: E402
from eqllm.train import loop  # noqa: E402
from tests.reliability.harness import make_corpus, tiny_recipe  # noqa: E402
from tests.serve_helpers import tiny_llama  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO / "tests" / "harness_tasks"
TASKS = ["eqllm_toy_mc", "eqllm_toy_cloze", "eqllm_toy_ppl", "eqllm_toy_gen"]
CONTEXT = 64  # short, so the longer perplexity documents span several rolling windows


def _corpus() -> list[str]:
    docs = []
    for file in sorted((TASKS_DIR / "data").glob("*.jsonl")):
        for line in file.read_text().splitlines():
            values = json.loads(line).values()  # one record, one document
            docs.append(" ".join(" ".join(v) if isinstance(v, list) else str(v) for v in values))
    return docs


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama in Hugging Face format, with a BPE tokenizer trained here."""
    tokenizer = Tokenizer.train_bpe(_corpus() * 4, 300)
    model = tiny_llama(tokenizer, CONTEXT)
    _fit(model, tokenizer)
    out = tmp_path_factory.mktemp("harness-llama")
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return out


def _fit(model, tokenizer: Tokenizer, steps: int = 60) -> None:
    """A few Adam steps on the task texts, so some continuations are the greedy ones (a
    random model's never are, and is_greedy would only ever be compared as False)."""
    ids = [i for doc in _corpus() for i in tokenizer.encode(doc) + [tokenizer.eot_id]]
    rows = len(ids) // CONTEXT
    batch = torch.tensor(ids[: rows * CONTEXT]).reshape(rows, CONTEXT)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(batch, labels=batch).loss.backward()
        optimizer.step()
    model.eval()


def _run(model: str, folder: Path, manager) -> dict:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=f"pretrained={folder},dtype=float32",
        tasks=TASKS,
        batch_size=4,
        device="cpu",
        task_manager=manager,
        log_samples=True,
    )


@pytest.fixture(scope="module")
def results(folder):
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # the task YAMLs name their data relative to the repository
        torch.set_num_threads(2)
        manager = lm_eval.tasks.TaskManager(include_path=str(TASKS_DIR))  # indexing takes seconds
        return {name: _run(name, folder, manager) for name in ("eqllm", "hf")}


def _responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.parametrize("task", ["eqllm_toy_mc", "eqllm_toy_cloze"])
def test_loglikelihoods_and_greedy_flags_match_hf(results, task):
    ours, ref = _responses(results["eqllm"], task), _responses(results["hf"], task)
    assert len(ours) == len(ref) > 0
    pairs = [pair for docs in zip(ours, ref, strict=True) for pair in zip(*docs, strict=True)]
    ll = np.array([[float(a[0][0]), float(b[0][0])] for a, b in pairs])
    np.testing.assert_allclose(ll[:, 0], ll[:, 1], atol=1e-4, rtol=0)
    assert [a[0][1] for a, _ in pairs] == [b[0][1] for _, b in pairs]


def test_rolling_loglikelihoods_match_hf(results):
    ours = _responses(results["eqllm"], "eqllm_toy_ppl")
    ref = _responses(results["hf"], "eqllm_toy_ppl")
    ll = np.array([[float(a[0][0]), float(b[0][0])] for a, b in zip(ours, ref, strict=True)])
    np.testing.assert_allclose(ll[:, 0], ll[:, 1], atol=1e-4, rtol=0)


def test_greedy_generations_match_hf(results):
    ours = _responses(results["eqllm"], "eqllm_toy_gen")
    ref = _responses(results["hf"], "eqllm_toy_gen")
    assert ours == ref and any(r[0][0] for r in ours)


def test_metrics_match_hf(results):
    greedy = [r[0][1] for doc in _responses(results["eqllm"], "eqllm_toy_cloze") for r in doc]
    assert any(greedy), "the tiny model should get some continuations right"
    for task in TASKS:
        ours, ref = results["eqllm"]["results"][task], results["hf"]["results"][task]
        for metric, value in ref.items():
            if not isinstance(value, float):
                continue
            if metric.startswith(("acc", "exact_match")) and "stderr" not in metric:
                assert ours[metric] == value, (task, metric)
            elif "perplexity" in metric or "bits_per_byte" in metric:
                np.testing.assert_allclose(ours[metric], value, rtol=1e-5)


# The command line --------------------------------------------------------------------------------


def test_eval_tasks_command_writes_json_and_table(folder, results, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "results.json"
    args = ["eval", str(folder), "--tasks", "eqllm_toy_cloze", "--include-path", str(TASKS_DIR)]
    assert cli_main([*args, "--batch-size", "4", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "|eqllm_toy_cloze|" in printed and "|acc " in printed and f"wrote {out}" in printed
    saved = json.loads(out.read_text())["results"]["eqllm_toy_cloze"]
    assert saved["acc,none"] == results["hf"]["results"]["eqllm_toy_cloze"]["acc,none"]


@pytest.mark.slow
def test_eval_tasks_command_errors(folder, capsys, monkeypatch):
    assert cli_main(["eval", str(folder), "--tasks", "eqllm_toy_nope"]) == 2
    assert "unknown task(s) ['eqllm_toy_nope']" in capsys.readouterr().err
    assert cli_main(["eval", str(folder), "--tasks", "x", "--batch-size", "0"]) == 2
    assert "batch_size=0" in capsys.readouterr().err
    # Without lm-eval installed, the command says how to install it.
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setitem(sys.modules, "lm_eval.models", None)
    for name in [m for m in sys.modules if m.startswith("eqllm.harness")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(eqllm, "harness")
    assert cli_main(["eval", str(folder), "--tasks", "lambada_openai"]) == 2
    assert 'pip install "eqllm[eval]"' in capsys.readouterr().err


def test_report_section_is_added_then_replaced(tmp_path):
    (tmp_path / "report.md").write_text("# run\n\n## Samples\n\ntext\n")
    write_report_section(tmp_path, 10, "|Tasks|\n|old|")
    write_report_section(tmp_path, 10, "|Tasks|\n|new|")
    write_report_section(tmp_path, 20, "|Tasks|\n|later|")
    text = (tmp_path / "report.md").read_text()
    assert text.count("## lm-evaluation-harness, step 10") == 1
    assert "|new|" in text and "|old|" not in text and "|later|" in text
    assert text.startswith("# run\n\n## Samples\n\ntext\n")


@pytest.mark.slow
def test_lm_eval_command_line_uses_the_registered_backend(folder, tmp_path):
    """`python -m eqllm.harness` is lm_eval's own command line with `--model eqllm`."""
    command = [sys.executable, "-m", "eqllm.harness", "run", "--model", "eqllm"]
    command += ["--model_args", f"pretrained={folder}", "--tasks", "eqllm_toy_cloze"]
    command += ["--include_path", str(TASKS_DIR), "--limit", "2", "-b", "4"]
    command += ["--output_path", str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "eqllm_toy_cloze" in done.stdout and list((tmp_path / "out").rglob("results_*.json"))


@pytest.mark.slow  # trains a tiny run first (~50 s on two cores)
def test_eval_tasks_on_a_run_folder_writes_its_report(tmp_path, monkeypatch):
    monkeypatch.setenv("EQLLM_CACHE", str(tmp_path / "cache"))
    recipe = tiny_recipe(tmp_path, make_corpus(tmp_path), steps=2, eval_every=2)
    run = loop.run(recipe, tmp_path / "run", progress=False, echo=lambda *a: None).out_dir
    monkeypatch.chdir(REPO)
    args = ["--tasks", "eqllm_toy_cloze", "--include-path", str(TASKS_DIR), "--limit", "2"]
    assert cli_main(["eval", str(run), *args]) == 0
    assert json.loads((run / "harness-2.json").read_text())["results"]["eqllm_toy_cloze"]
    assert "## lm-evaluation-harness, step 2" in (run / "report.md").read_text()


def test_a_zoo_name_needs_a_tokenizer(folder):
    with pytest.raises(eqllm.EqllmError, match="without a tokenizer"):
        eqllm.harness.EqllmLM("llama-nano")  # a zoo name has fresh weights and no tokenizer
    lm = eqllm.harness.EqllmLM("llama-nano", tokenizer=str(folder), batch_size=2)
    assert lm.max_length == eqllm.zoo.config("llama-nano").max_seq_len
    small = eqllm.CausalLM(eqllm.zoo.config("llama-nano", vocab_size=64), key=jax.random.key(0))
    with pytest.raises(eqllm.EqllmError, match="the model only 64"):
        eqllm.harness.EqllmLM(model=small, tokenizer=str(folder))
    # One template per model: asked for, it is the folder's (here eqllm's default, said once);
    # a named template is refused.
    assert lm.chat_template(False) is None
    assert lm.chat_template(True) == DEFAULT_TEMPLATE
    with pytest.raises(eqllm.EqllmError, match="uses the model's one template"):
        lm.chat_template("tool_use")
    # Generation kwargs: greedy unless do_sample; sampling settings pass through; others refused.
    assert lm._sampling({"do_sample": False, "temperature": 0.7}) == {"temperature": 0.0}
    sampled = lm._sampling({"do_sample": True, "temperature": 0.7, "top_p": 0.9})
    assert sampled == {"temperature": 0.7, "top_p": 0.9}
    with pytest.raises(eqllm.EqllmError, match=r"\['num_beams'\] are not supported"):
        lm._sampling({"num_beams": 4})


@pytest.fixture(scope="module")
def bos_folder(folder, tmp_path_factory):
    """The same model with a tokenizer that prepends a BOS token (Llama-style post-processor)."""
    out = tmp_path_factory.mktemp("harness-bos")
    for file in folder.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    spec = json.loads((folder / "tokenizer.json").read_text())
    eot = "<|endoftext|>"
    eot_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == eot)
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": eot, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {eot: {"id": eot, "ids": [eot_id], "tokens": [eot]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": eot}))
    return out


def test_bos_and_empty_context_encoding_match_hf(bos_folder):
    from lm_eval.api.instance import Instance

    ours = eqllm.harness.EqllmLM(str(bos_folder), batch_size=4)
    ref = lm_eval.api.registry.get_model("hf")(
        pretrained=str(bos_folder), batch_size=4, device="cpu"
    )
    texts = ["The red fox", "<|endoftext|>The red fox", " hides in the barn. "]
    assert [ours.tok_encode(t) for t in texts] == [ref.tok_encode(t) for t in texts]
    assert ours.tok_encode(texts[0])[0] == ours.prefix_token_id == ref.prefix_token_id
    pairs = [("", "The red fox"), ("The red fox ", "hides"), ("<|endoftext|>The", " cat")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    a, b = ours.loglikelihood(requests), ref.loglikelihood(requests)
    np.testing.assert_allclose([x for x, _ in a], [x for x, _ in b], atol=1e-4, rtol=0)
    assert [g for _, g in a] == [g for _, g in b]
