"""Peak host memory of eqllm.hub.from_pretrained / save_pretrained against the checkpoint size.

    PYTHONPATH=$PWD python benchmarks/hub_memory.py [--family llama|gpt2] [--layers 10]

Writes a random fp32 Hugging Face checkpoint (~480 MB by default, in ~200 MB shards) with numpy
and safetensors, then runs each measurement in a fresh interpreter and reads its peak resident
set size (`ru_maxrss`): a baseline interpreter that imported jax + eqllm and ran one op, one
that loads the checkpoint, and one that loads and saves it again. This script itself imports
only the standard library: Linux carries the parent's peak RSS into a child's `ru_maxrss`
across fork + exec, so a large parent would inflate every figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys
import jax, jax.numpy as jnp
import eqllm
eqllm.configure_process()
jnp.ones(4).block_until_ready()
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def now():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
mode, src, dst = sys.argv[1:4]
out = {}
if mode != "baseline":
    model = eqllm.hub.from_pretrained(src)
    jax.block_until_ready(model)
    out["after_load"] = now()
    out["peak_load"] = peak()
if mode == "save":
    eqllm.hub.save_pretrained(model, dst, max_shard_size="200MB")
out["peak"] = peak()
print(json.dumps(out))
"""


def write_checkpoint(folder: Path, family: str, layers: int) -> int:
    import numpy as np
    from safetensors.numpy import save_file

    import eqllm
    from eqllm.hub.files import PlannedTensor, shard

    name = {"llama": "llama-125m", "gpt2": "gpt2-small"}[family]
    overrides = {"n_layers": layers}
    if family == "llama":
        overrides.update(vocab_size=32000, d_model=768)
        overrides.update(attention={"n_heads": 12, "n_kv_heads": 12}, mlp={"d_ff": 2048})
    cfg = eqllm.zoo.config(name, **overrides)
    # The tensor names and shapes save_pretrained would write, filled with random numbers.
    shapes = eqllm.hub.folders.skeleton(cfg)[0]
    rows = eqllm.hub.tables.rows_for(cfg.family, set(shapes))
    rng = np.random.default_rng(0)
    tensors = []
    for row in rows:
        for i in range(cfg.n_layers) if row.layered else [None]:
            per_layer = [shapes[p].shape[1:] if row.layered else shapes[p].shape for p in row.eqllm]
            shape = eqllm.hub.tables.hf_shape(row, per_layer)
            tensors.append(
                PlannedTensor(row.hf.format(i=i), shape, np.dtype("float32"), lambda: None)
            )
    groups = shard(tensors, 200_000_000)
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        arrays = {t.name: rng.standard_normal(t.shape, np.float32) * 0.02 for t in group}
        save_file(arrays, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(arrays, file))
    total = sum(t.nbytes for t in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(eqllm.hub.to_hf_config(cfg)))
    return total


def run(mode: str, src: Path, dst: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(src), str(dst)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["llama", "gpt2"], default="llama")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--write", help=argparse.SUPPRESS)  # internal: write the checkpoint
    args = parser.parse_args()
    if args.write:
        print(write_checkpoint(Path(args.write), args.family, args.layers))
        return
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "dst"
        src.mkdir()
        size = int(
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--write",
                    str(src),
                    "--family",
                    args.family,
                    "--layers",
                    str(args.layers),
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split()[-1]
        )
        base = run("baseline", src, dst)["peak"]
        load = run("load", src, dst)
        save = run("save", src, dst)
        files = sum(p.stat().st_size for p in dst.glob("*.safetensors"))

    mb = 1e6
    print(f"checkpoint: {args.family}, {size / mb:.0f} MB of fp32 weights")
    print(f"baseline (python + jax + eqllm): peak RSS {base / mb:.0f} MB")
    print(
        f"from_pretrained: peak RSS {load['peak'] / mb:.0f} MB = baseline + "
        f"{(load['peak'] - base) / mb:.0f} MB ({(load['peak'] - base) / size:.2f} x weights); "
        f"after load {load['after_load'] / mb:.0f} MB"
    )
    print(
        f"from_pretrained + save_pretrained: peak RSS {save['peak'] / mb:.0f} MB = baseline + "
        f"{(save['peak'] - base) / mb:.0f} MB ({(save['peak'] - base) / size:.2f} x weights); "
        f"wrote {files / mb:.0f} MB"
    )


if __name__ == "__main__":
    main()
