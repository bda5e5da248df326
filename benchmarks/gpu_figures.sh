#!/usr/bin/env bash
# GPU figures for docs/experiments/gpu/: eqllm against transformers (eager and torch.compile)
# on one NVIDIA GPU, bf16 compute, with the attention kernel chosen by attention=auto (cuDNN's
# fused kernel) and with attention=xla (the model's own attention, scores materialised).
#
# Run from the repository root on a machine with a CUDA build of jax and torch:
#   pip install -e ".[torch]" "jax[cuda12]"
#   bash benchmarks/gpu_figures.sh            # or: bash benchmarks/gpu_figures.sh --steps 20
# Extra arguments go to every `eqllm bench` call. Each call writes bench.md, bench.json and
# bench.png (tokens/s, step time, compile time, MFU, peak device memory) under OUT/<attention>.
set -euo pipefail

OUT=${OUT:-docs/experiments/gpu}
BATCH=${BATCH:-8}
SEQ=${SEQ:-2048}

if ! python -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
    echo "gpu_figures.sh: jax sees no GPU (jax.default_backend() = $(python -c \
'import jax; print(jax.default_backend())')); these figures need one" >&2
    exit 1
fi
python -c "import jax; print('device:', jax.devices()[0].device_kind, '| jax', jax.__version__)"

for attention in auto xla; do
    eqllm bench llama-350m llama3.2-1b --dtype bfloat16 --vs-torch \
        --batch "$BATCH" --seq "$SEQ" --set "attention.kernel=$attention" \
        --out "$OUT/$attention" "$@"
done
echo "written: $OUT/auto/bench.md and $OUT/xla/bench.md"
