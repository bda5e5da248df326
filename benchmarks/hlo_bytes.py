"""Where a compiled step's HBM bytes go: its HLO's unfused ops, loops at their trip counts,
grouped by the model scope in each op's name and by op.

    eqllm plan ... --dump-hlo step.hlo
    PYTHONPATH=$PWD python benchmarks/hlo_bytes.py step.hlo [--top 12]

Bytes are counted as XLA's cost analysis counts them (`eqllm.bench.hlo.Program.costs`); a
scope is the first eqllm module named in the op's metadata (eqllm.MoE, eqllm.Attention, ...),
and within it the op's own name (gather, scatter, the kernel's pallas_call, ...).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

from eqllm.bench.hlo import Program

_SCOPE = re.compile(r"(eqllm\.[A-Z]\w*)")


def by_scope(program: Program) -> tuple[Counter, Counter]:
    """(bytes by model scope, bytes by scope and op) per step."""
    scopes, ops = Counter(), Counter()
    for text, moved in program.costs("bytes"):
        op_name = re.search(r'op_name="([^"]*)"', text)
        op_name = op_name.group(1) if op_name else ""
        scope = _SCOPE.search(op_name)
        scope = scope.group(1) if scope else "(outside the model's modules)"
        scopes[scope] += moved
        ops[(scope, op_name.rsplit("/", 1)[-1])] += moved
    return scopes, ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hlo", type=Path)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    program = Program(args.hlo.read_text())
    scopes, ops = by_scope(program)
    total = sum(scopes.values())
    print(f"{total:.3g} bytes per chip per step, loops at their trip counts")
    for scope, moved in scopes.most_common():
        print(f"  {scope:40s} {moved:10.3g}  {moved / total:4.0%}")
    print("by op:")
    for (scope, op), moved in ops.most_common(args.top):
        print(f"  {scope:25s} {op[:40]:40s} {moved:10.3g}  {moved / total:4.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
