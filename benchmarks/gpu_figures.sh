#!/usr/bin/env bash
# GPU figures for docs/experiments/gpu.md: eqllm against transformers (eager and torch.compile)
# on one NVIDIA GPU, bf16 compute, with the attention kernel chosen by attention=auto (cuDNN's
# fused kernel) and with attention=xla (the model's own attention, scores materialised).
#
# One process per run, so that each starts with the whole GPU: JAX's allocator and torch's
# caching allocator each keep what they have taken, and llama3.2-1b at 8 x 2048 with both
# frameworks' models and optimizer states in one process does not fit in an H200's 141 GB
# (hence batch 4 for it). transformers is timed beside attention=auto only: its own attention
# does not change with eqllm's setting.
#
# Run from the repository root on a machine with a CUDA build of jax and torch:
#   pip install -e ".[torch]" "jax[cuda12]"
#   bash benchmarks/gpu_figures.sh            # or: bash benchmarks/gpu_figures.sh --steps 20
# Extra arguments go to every `eqllm bench` call. Each writes bench.md and bench.json (tokens/s,
# step time, compile time, MFU, peak device memory; bench.png unless --no-plots) under OUT/<run>.
set -euo pipefail

OUT=${OUT:-docs/experiments/gpu}

if ! python3 -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
    echo "gpu_figures.sh: jax sees no GPU (jax.default_backend() = $(python3 -c \
'import jax; print(jax.default_backend())')); these figures need one" >&2
    exit 1
fi
python3 -c "import jax; print('device:', jax.devices()[0].device_kind, '| jax', jax.__version__)"

common=(--dtype bfloat16 --seq 2048)
eqllm bench llama-350m "${common[@]}" --batch 8 --vs-torch --set attention.kernel=auto \
    --out "$OUT/llama-350m-auto" "$@"
eqllm bench llama3.2-1b "${common[@]}" --batch 4 --vs-torch --set attention.kernel=auto \
    --out "$OUT/llama3.2-1b-auto" "$@"
eqllm bench llama-350m "${common[@]}" --batch 8 --set attention.kernel=xla \
    --out "$OUT/llama-350m-xla" "$@"
echo "written: $OUT/*/bench.md"
