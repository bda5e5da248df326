"""The case type of the family contract's list (tests/families.py) and the tiny sizes its entries
share: 97 tokens, width 32, 2 or 3 layers; DeepSeek's latent attention and grouped routing."""

from __future__ import annotations

import dataclasses

from eqllm.config import ModelConfig

TINY = {
    "vocab_size": 97,
    "d_model": 32,
    "n_layers": 2,
    "attention.n_heads": 4,
    "mlp.d_ff": 64,
    "max_seq_len": 64,
}
# DeepSeek's latent attention: a 12-wide key/value latent, 8 + 6 rotated query/key dims, values
# of 10; three layers, the first dense, then 8 experts of 16 in 4 groups, 3 per token, and a
# shared expert of 32; YaRN with the attention-scale factors of the published checkpoints.
MLA = {
    **TINY,
    "n_layers": 3,
    "attention": {
        "n_kv_heads": 4,
        "kv_lora_rank": 12,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 6,
        "v_head_dim": 10,
        "head_dim": 14,
    },
    "moe": {"n_experts": 8, "experts_per_token": 3, "d_ff": 16, "shared_d_ff": 32},
    "positions": {
        "scaling": {
            "kind": "yarn",
            "factor": 4.0,
            "original_max_seq_len": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        }
    },
}

# DeepSeek-V3's routing (GLM-4.5's too): the best 2 of 4 groups, the weights scaled by 2.5; its
# query latent; GLM-4.5's attention (2 kv heads of 16, half of each rotated) and count.
GROUPED = {**MLA["moe"], "n_groups": 4, "topk_groups": 2, "routed_scale": 2.5}
MLA_Q = {**MLA["attention"], "q_lora_rank": 16}
GQA_16 = {"n_kv_heads": 2, "head_dim": 16}
GLM_355B = 352_797_829_024
# YaRN over an original context of 16, shorter than the test sequences.
YARN_16 = {
    "kind": "yarn",
    "factor": 4.0,
    "original_max_seq_len": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

# Falcon-H1's tiny Mamba-2 mixer (8 heads of 8, 2 groups of B and C, a state of 8, chunks of 16),
# every muP multiplier away from 1, and the modules peft adapts (all but out_proj: peft refuses
# out_proj and conv1d in Falcon-H1, as in its other Mamba models).
FALCON_MIXER = {
    "n_key_heads": 2,
    "n_value_heads": 8,
    "key_head_dim": 8,
    "value_head_dim": 8,
    "chunk_size": 16,
}
FALCON_MULTIPLIERS = {
    "embedding": 2.0,
    "logits": 0.5,
    "attention_in": 1.2,
    "attention_out": 0.7,
    "key": 0.8,
    "ssm_in": 1.1,
    "ssm_out": 0.6,
    "ssm": (0.9, 1.1, 0.8, 1.2, 1.3),
    "mlp_gate": 1.5,
    "mlp_down": 0.5,
}
FALCON_LORA = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "in_proj"),
    *("gate_proj", "up_proj", "down_proj", "lm_head"),
)

# Granite 4.0-H's tiny stack: Mamba-2, attention, then Mamba-2 twice (the pattern L F L cut at
# 4 layers), Falcon-H1's tiny mixer, each of Granite's multipliers away from 1, experts with the
# shared MLP; the modules peft adapts (its routers are not nn.Linear, and peft refuses out_proj
# in Mamba models).
GRANITE = {
    "n_layers": 4,
    "attention": {"n_kv_heads": 2},
    "linear": {**FALCON_MIXER, "pattern": ("linear", "full", "linear")},
    "multipliers": {
        "embedding": 2.0,
        "residual": 0.6,
        "logits_divisor": 3.0,
        "attention_scale": 0.3,
    },
}
GRANITE_MOE = {"n_experts": 4, "experts_per_token": 2, "shared_d_ff": 24}  # of mlp.d_ff 16
GRANITE_LORA = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "in_proj"),
    *("input_linear", "output_linear", "lm_head"),
)
# Nemotron 3's experts in Nemotron-H's feed-forward layers: 8 ungated squared-ReLU experts of
# 16 in 2 groups (each token chooses among the better group's, scored by its best two), 2 per
# token, the weights times 2.5, beside a shared expert of 24 (zoo nemotron_h-moe-nano's routing).
NEMOTRON_MOE = {
    "n_experts": 8,
    "experts_per_token": 2,
    "d_ff": 16,
    "shared_d_ff": 24,
    "n_groups": 2,
    "topk_groups": 1,
}

Count = int | str  # exact, or in billions as a model card rounds it ("46.7")


@dataclasses.dataclass(frozen=True)
class Tiny:
    """One tiny model the contract runs over.

    Arguments:
        name: the case's name in test ids (`llama3`); the family is `config.family`.
        config: the tiny config (97 tokens, width 32, 2 or 3 layers).
        variant: a second case of a family already listed: it runs in the slow set only.
        gguf: eqllm writes it as a GGUF file (`eqllm.hub.save_gguf`); the contract checks the
            file with transformers' GGUF loader, or that a model without it is refused.
        lora: the Hugging Face module names peft adapts in its transformers twin, when they are
            not all of `eqllm.lora.available_targets` (None: all of them).
        published: zoo names of released sizes -> the parameter count their release gives: the
            total, or (total, active); each exact (an `int`) or in billions as the model card
            rounds them (a string, "46.7").
        atol: the tolerance of its logits against transformers' (fp32 both sides).
        cached_atol: the tolerance of cached decoding against the full forward (a hybrid's
            chunked delta rule and the token-by-token one round differently, ~1e-5 apart).
        scan_atol: the tolerance of the unrolled layer loop against the scanned stack (both
            fp32; XLA fuses them differently).
        generates: cached generation runs it (False: a model whose cache cannot carry its
            state, refused with an EqllmError).
    """

    name: str
    config: ModelConfig
    variant: bool = False
    gguf: bool = False
    lora: tuple[str, ...] | None = None
    published: dict[str, Count | tuple[Count, Count]] = dataclasses.field(default_factory=dict)
    atol: float = 1e-5
    cached_atol: float = 1e-5
    scan_atol: float = 1e-5
    generates: bool = True

    @property
    def family(self) -> str:
        return self.config.family
