"""Distillation against the data alone: the distill-quickstart student trained for the same
steps twice, once distilled from the quickstart's model, once on the corpus alone (the
language model's loss), and the validation loss of each on the same held-out tokens.

    eqllm run quickstart            # the teacher, runs/quickstart
    PYTHONPATH=. python benchmarks/distill.py [--steps 300] [--set distill.temperature=2]

Each run is written under --out (default /tmp/distill-bench): `data-alone/` and `distilled/`.
"""

import argparse
import json
import time
from pathlib import Path

from eqllm.recipe import load_recipe
from eqllm.runs import RunFolder
from eqllm.train.loop import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("/tmp/distill-bench"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    distilled = load_recipe("distill-quickstart", [f"train.steps={args.steps}", *args.set])
    teacher = RunFolder(distilled.distill.teacher)
    alone = load_recipe(
        "distill-quickstart",
        [f"train.steps={args.steps}", *args.set, "train.objective=lm", 'distill.teacher=""'],
    )
    rows = []
    for name, recipe in (("data-alone", alone), ("distilled", distilled)):
        t = time.perf_counter()
        result = run(recipe, args.out / name, progress=False, echo=lambda *a: None)
        val = result.summary["val"]
        rows.append((name, val["loss"], val["bpb"], time.perf_counter() - t))
    summary = json.loads(teacher.summary_file.read_text())
    d = distilled.distill
    print(
        f"student: {distilled.model.variant} {dict(distilled.model.overrides)}, {args.steps} "
        f"steps x {distilled.tokens_per_step():,} tokens; distilled at temperature "
        f"{d.temperature:g}, cross-entropy weight {d.ce_weight:g}, top_k {d.top_k}"
    )
    print(f"{'run':12s} {'val loss':>9s} {'bits/byte':>10s} {'wall s':>7s}")
    teacher_val = summary["val"]
    print(f"{'teacher':12s} {teacher_val['loss']:9.4f} {teacher_val['bpb']:10.4f} {'':>7s}")
    for name, loss, bpb, seconds in rows:
        print(f"{name:12s} {loss:9.4f} {bpb:10.4f} {seconds:7.0f}")


if __name__ == "__main__":
    main()
