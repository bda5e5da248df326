"""Harness speed: requests/s of lm_eval's `eqllm` backend against its own `hf` backend.

One random zoo model (exported as a Hugging Face folder with a BPE tokenizer trained on the task
texts) and four generated local tasks of the four request kinds: multiple choice, a lambada-like
cloze (loglikelihood), rolling perplexity (loglikelihood_rolling, documents longer than the
context) and greedy generation (generate_until). Both backends run every task twice in the same
process with the same batch size; the table shows the second (warm) run's requests/s and the first
run's seconds (for eqllm that includes compiling each length bucket), both counting only the time
inside the backend's request methods (lm_eval's own task building is the same for both and left
out). Requests are lm_eval's instances: one per choice, per cloze, per document, per generation.

    PYTHONPATH=$PWD python benchmarks/harness.py [--model llama-micro] [--docs 200]
        [--batch-size 16] [--threads N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import jax
import lm_eval
import torch
from lm_eval.tasks import TaskManager

import eqllm
import eqllm.harness  # noqa: F401  (registers "eqllm")
from eqllm.data import Tokenizer

WORDS = {
    "animal": ["cat", "dog", "fox", "owl", "bee", "cow", "hen", "pig", "elk", "yak"],
    "colour": ["red", "blue", "green", "black", "white", "brown", "grey", "pink"],
    "place": ["barn", "field", "river", "forest", "garden", "house", "hill", "lake"],
    "verb": ["sleeps", "runs", "sings", "eats", "hides", "jumps", "waits", "swims"],
}


def _sentence(rng: random.Random) -> str:
    w = {k: rng.choice(v) for k, v in WORDS.items()}
    return f"The {w['colour']} {w['animal']} {w['verb']} in the {w['place']}."


def write_tasks(folder: Path, docs: int) -> dict[str, list[dict]]:
    """Four task YAMLs over JSONL files in `folder`; returns the documents."""
    rng = random.Random(0)
    data = {
        "mc": [
            {
                "question": " ".join(_sentence(rng) for _ in range(2)) + " Where is it?",
                "choices": rng.sample(WORDS["place"], 4),
                "label": rng.randrange(4),
            }
            for _ in range(docs)
        ],
        "cloze": [{"text": " ".join(_sentence(rng) for _ in range(3))[:-1]} for _ in range(docs)],
        "ppl": [{"text": " ".join(_sentence(rng) for _ in range(60))} for _ in range(docs // 10)],
    }
    data["gen"] = [
        {"question": _sentence(rng) + "\nQ: colour?\nA:", "answer": rng.choice(WORDS["colour"])}
        for _ in range(docs // 10)
    ]
    kinds = {
        "mc": 'output_type: multiple_choice\ndoc_to_text: "{{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n',
        "cloze": "output_type: loglikelihood\n"
        "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
        "doc_to_target: \"{{' ' + text.split(' ')[-1]}}\"\nmetric_list:\n  - metric: acc\n",
        "ppl": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n",
        "gen": 'output_type: generate_until\ndoc_to_text: "{{question}}"\n'
        'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n"]\n'
        "  max_gen_toks: 32\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
    }
    for name, rows in data.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"bench_{name}.yaml").write_text(
            f"task: bench_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {folder / f'{name}.jsonl'}\ntest_split: test\n{kinds[name]}"
            "metadata:\n  version: 1.0\n"
        )
    return data


def save_model(folder: Path, variant: str, data: dict) -> None:
    texts = [" ".join(str(v) for v in row.values()) for rows in data.values() for row in rows]
    tokenizer = Tokenizer.train_bpe(texts, 1024)
    config = eqllm.zoo.config(variant, vocab_size=tokenizer.vocab_size)
    model = eqllm.CausalLM(config, key=jax.random.key(0))
    eqllm.hub.save_pretrained(model, folder, tokenizer=tokenizer)


def _timed(lm) -> dict:
    """Wrap the three request methods of `lm` to add up the seconds spent inside them."""
    spent = {"s": 0.0}

    def wrap(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - start

        return wrapper

    for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
        setattr(lm, name, wrap(getattr(lm, name)))
    return spent


def measure(backend: str, folder: Path, tasks_dir: Path, batch_size: int) -> dict:
    """Per task: requests, seconds in the model's request methods (first and warm run), and
    the task's metrics."""
    lm = lm_eval.api.registry.get_model(backend).create_from_arg_string(
        f"pretrained={folder},dtype=float32", {"batch_size": batch_size, "device": "cpu"}
    )
    spent = _timed(lm)
    manager = TaskManager(include_path=str(tasks_dir))
    out = {}
    for task in ("bench_mc", "bench_cloze", "bench_ppl", "bench_gen"):
        times = []
        for _ in range(2):
            spent["s"] = 0.0
            res = lm_eval.simple_evaluate(
                model=lm, tasks=[task], task_manager=manager, log_samples=True
            )
            times.append(spent["s"])
        requests = sum(len(s["resps"]) for s in res["samples"][task])
        metrics = {k: v for k, v in res["results"][task].items() if isinstance(v, float)}
        out[task] = {"requests": requests, "first_s": times[0], "warm_s": times[1], **metrics}
        print(f"{backend:6s} {task:12s} {requests:5d} requests {times[1]:7.2f} s warm", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-micro", help="zoo variant (random weights)")
    parser.add_argument("--docs", type=int, default=200, help="documents of mc and cloze")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=None, help="also write the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="eqllm-harness-bench-"))
    data = write_tasks(root, args.docs)
    save_model(root / "model", args.model, data)
    figures = {b: measure(b, root / "model", root, args.batch_size) for b in ("eqllm", "hf")}
    print(
        f"\n{args.model}, batch size {args.batch_size}, {jax.devices()[0].device_kind}, "
        f"{args.threads} threads\n"
    )
    print(
        "| task | requests | eqllm req/s | hf req/s | speed-up | eqllm first run s | same metric |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for task, ours in figures["eqllm"].items():
        ref = figures["hf"][task]
        same = all(
            abs(ours[k] - ref[k]) <= 1e-4 * max(1.0, abs(ref[k]))
            for k in ref
            if k not in ("requests", "first_s", "warm_s") and "stderr" not in k
        )
        a, b = ours["requests"] / ours["warm_s"], ref["requests"] / ref["warm_s"]
        print(
            f"| {task} | {ours['requests']} | {a:.1f} | {b:.1f} | {a / b:.2f}x | "
            f"{ours['first_s']:.1f} | {'yes' if same else 'NO'} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, **figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
