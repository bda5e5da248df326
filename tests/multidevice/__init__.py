"""Tests on 8 simulated CPU devices; tests/test_sharding.py runs them in their own process."""

import eqllm

# 8 heads, 8 kv heads and d_ff 128 so that every mesh below divides them.
CFG = eqllm.zoo.config(
    "llama-nano",
    vocab_size=96,
    d_model=64,
    n_layers=2,
    attention={"n_heads": 8, "n_kv_heads": 8},
    mlp={"d_ff": 128},
    max_seq_len=32,
)
MESHES = ["data=8", "data=2,fsdp=4", "data=2,fsdp=2,tensor=2", "data=1,tensor=8"]
