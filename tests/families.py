"""The one list of tiny models the family contract runs over (tests/test_families.py); the case
type and the tiny sizes entries share are in tests/tiny.py.

Each entry is one line: a name, a tiny `ModelConfig`, and what the model supports. Every family in
`eqllm/families/` has an entry that runs in the default suite; a second entry of one family (a
variant: another residual, untied heads, raw top-k weights) runs in the slow set. A new family is
one line here, and tests/test_families.py fails until it has one.

The transformers twin of an entry is built from the entry's own config (`to_hf_config`), so one
config describes both sides: transformers interprets the fields eqllm writes, and a field written
under a name transformers does not read shows up in the logits.

Tests that run over the list use `params` (or `TINY_CONFIGS`, name -> config); the cases outside
the default run are marked slow on the parameters themselves, so renaming a test cannot change
what runs by default.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

import eqllm
from eqllm.config import ModelConfig
from tests import tiny
from tests.tiny import GLM_355B, GQA_16, GROUPED, MLA, MLA_Q, TINY, YARN_16, Tiny


def _zoo(name: str, **overrides) -> ModelConfig:
    return eqllm.zoo.config(name, **{**TINY, **overrides})


_ROUTED_LORA = ("q_proj", "k_proj", "v_proj", "o_proj", "lm_head")  # transformers' routers
# The hybrids' tiny stack: two groups of (Gated DeltaNet, gated attention), 2 key heads to 4
# value heads, a tied head; their mixtures' experts and the modules peft adapts in them
# (transformers' routers and fused experts are not nn.Linear).
_HYBRID = {
    "n_layers": 4,
    "attention": {"n_kv_heads": 2, "head_dim": 16},
    "linear": {
        "full_every": 2,
        "n_key_heads": 2,
        "n_value_heads": 4,
        "key_head_dim": 8,
        "value_head_dim": 8,
    },
}
# linear, full, linear, linear, full, full: no group repeats (runs of one kind).
IRREGULAR = ("linear", "full", "linear", "linear", "full", "full")
_HYBRID_MOE = {"n_experts": 4, "experts_per_token": 2, "shared_d_ff": 24}
_HYBRID_LORA = ("q_proj", "k_proj", "v_proj", "o_proj", "shared_expert_gate", "out_proj")
_OLMO_LINEAR = {
    "full_every": 2,
    "n_key_heads": 2,
    "n_value_heads": 4,
    "key_head_dim": 8,
    "value_head_dim": 8,
}
_GEMMA4_LOCAL = {"n_kv_heads": 2, "head_dim": 8, "sliding_window": 5, "global_every": 2}
# Gemma 4's global layers of their own shape: heads twice as wide, one kv head, keys as values.
_GEMMA4_GLOBAL = {**_GEMMA4_LOCAL, "global_head_dim": 16, "global_kv_heads": 1, "k_eq_v": True}
GEMMA4_E = {
    "n_layers": 6,
    "attention": {**_GEMMA4_LOCAL, "global_head_dim": 16, "kv_shared_layers": 4},
    "positions": {"global_fraction": 0.25},
    "mlp": {"kv_shared_d_ff": 128},
    "per_layer": {"d": 8},
    "final_softcap": 2.0,
}
_MLA_LORA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "lm_head")

FAMILIES = [
    # Learned positions, biases, GELU, a tied head, GPT-2's Conv1D layout.
    Tiny("gpt2", _zoo("gpt2-nano"), published={"gpt2-small": 124_439_808}),
    Tiny(
        "llama",
        _zoo("llama-nano", attention={"n_kv_heads": 2}),
        gguf=True,
        published={
            "llama2-7b": 6_738_415_616,
            "llama2-13b": 13_015_864_320,
            "llama2-70b": 68_976_648_192,
            "llama3-8b": 8_030_261_248,
            "llama3.1-70b": 70_553_706_496,
            "llama3.1-405b": 405_853_388_800,
            "smollm2-135m": 134_515_008,
        },
    ),
    # Llama 3's frequency-banded RoPE scaling (head_dim 8: every band is exercised).
    Tiny(
        "llama3",
        _zoo(
            "llama3.2-1b",
            attention={"n_kv_heads": 2},
            positions={"scaling": {"original_max_seq_len": 16}},
        ),
        variant=True,
        gguf=False,  # llama.cpp's llama architecture in eqllm's writer holds no RoPE scaling
    ),
    # q/k/v and output biases, which Llama's config.json switches on as attention_bias.
    Tiny(
        "llama-bias",
        _zoo("llama-nano", attention={"n_kv_heads": 2, "qkv_bias": True, "out_bias": True}),
        variant=True,
    ),
    # A window of 5, shorter than every test sequence: the ring-buffer cache wraps.
    Tiny("mistral", _zoo("mistral-7b", attention={"n_kv_heads": 2, "sliding_window": 5})),
    # q/k/v biases, one kv head, a tied head.
    Tiny("qwen2", _zoo("qwen2.5-0.5b", attention={"n_kv_heads": 1}), gguf=True),
    # Embedding scaling, (1 + w) norms, a tied head.
    Tiny("gemma", _zoo("gemma-2b", attention={"n_kv_heads": 1})),
    # QK-norm, heads wider than d_model / n_heads, tied and untied heads.
    Tiny(
        "qwen3",
        _zoo("qwen3-0.6b", attention={"n_kv_heads": 2, "head_dim": 16}),
        gguf=True,
        published={"qwen3-8b": 8_190_735_360},
    ),
    Tiny(
        "qwen3-untied",
        _zoo("qwen3-0.6b", attention={"n_kv_heads": 2, "head_dim": 16}, tie_embeddings=False),
        variant=True,
        gguf=True,
    ),
    # Windows shorter than the test sequences; caps small enough that tanh bends the values.
    Tiny(
        "gemma2",
        _zoo(
            "gemma2-2b",
            attention={
                "n_kv_heads": 2,
                "head_dim": 16,
                "query_pre_attn_scalar": 12,
                "sliding_window": 5,
                "softcap": 1.0,
            },
            final_softcap=2.0,
        ),
        published={"gemma2-2b": 2_614_341_888, "gemma2-9b": 9_241_705_984},
    ),
    # Local, global, local layers with their two RoPE bases; (1 + w) QK-norm.
    Tiny(
        "gemma3",
        _zoo(
            "gemma3-1b",
            n_layers=3,
            attention={
                "n_kv_heads": 1,
                "head_dim": 8,
                "query_pre_attn_scalar": 12,
                "sliding_window": 5,
                "global_every": 2,
            },
        ),
        published={"gemma3-1b": 999_885_952, "gemma3-4b": 3_880_263_168},
    ),
    # Gemma 3's layout with plain-weight norms, a weightless value norm, unscaled scores and a
    # stored scalar per layer: local, global, local, global layers (transformers makes the last
    # layer global), a soft-cap of 2 on the logits. The global layers are a stack of their own:
    # heads twice as wide, one kv head whose values are its keys, a quarter of the frequencies
    # turning (proportional RoPE). The variant's global layers have the local layers' shape.
    Tiny(
        "gemma4",
        _zoo(
            "gemma4-nano",
            n_layers=4,
            attention=_GEMMA4_GLOBAL,
            positions={"global_fraction": 0.25},
            final_softcap=2.0,
        ),
        atol=3e-5,  # unscaled scores of QK-normed heads: fp32 rounding reaches 1.3e-5
        gguf=True,
    ),
    # E2B/E4B's mechanisms: per-layer inputs of 8; local, global, then four kv-shared layers
    # (local, global, local, global: sources 0 and 1) with a double-wide MLP. Its default tests
    # are tests/test_gemma4_e.py's.
    Tiny(
        "gemma4-e",
        _zoo("gemma4-nano", **GEMMA4_E),
        variant=True,
        atol=3e-5,
        cached_atol=2e-5,  # 240 tokens: fp32 rounding of the cached path reached 1.07e-5
        gguf=True,
    ),
    Tiny(
        "gemma4-plain-global",
        _zoo("gemma4-nano", n_layers=4, attention=_GEMMA4_LOCAL, final_softcap=2.0),
        variant=True,
        gguf=True,
    ),
    # 26B-A4B's block on the same layers: the dense GeGLU MLP (64) beside 4 experts of 16, 2 per
    # token, each branch normed before and after; the router through its own RMSNorm and scale,
    # a scale per expert (perturbed away from 1 in the twin, as every parameter).
    Tiny(
        "gemma4-moe",
        _zoo(
            "gemma4-moe-nano",
            n_layers=4,
            attention=_GEMMA4_GLOBAL,
            positions={"global_fraction": 0.25},
            moe={"n_experts": 4, "d_ff": 16, "shared_d_ff": 64},
            final_softcap=2.0,
        ),
        variant=True,
        # The release's 25.2B total, 3.8B active, as the language model counts (transformers'
        # exact counts: tests/test_gemma4.py).
        published={"gemma4-26b-a4b": ("25.2", "3.8")},
        atol=3e-5,  # as gemma4's
        scan_atol=2e-5,  # unscaled QK-normed scores amplify fp32 rounding (1.1e-5 here)
        gguf=True,
    ),
    # Fused qkv_proj and gate_up_proj; half of each head rotated; a window over every layer.
    Tiny(
        "phi3",
        _zoo(
            "phi3-mini-4k",
            attention={"n_kv_heads": 2, "sliding_window": 6},
            positions={"fraction": 0.5},
        ),
        published={
            "phi3-mini-4k": 3_821_079_552,
            "phi3-mini-128k": 3_821_079_552,
            "phi3.5-mini": 3_821_079_552,
            "phi4-mini": 3_836_021_760,
        },
    ),
    # Norms after the sublayers only; QK-norm over the whole projections (grouped kv heads).
    Tiny("olmo2", _zoo("olmo2-1b", attention={"n_kv_heads": 2}), gguf=True),
    # OLMo 2's block over windowed, full, windowed layers (a window of 5): YaRN on the full layer
    # only (the original context, 16, shorter than the test sequences), another base on the others.
    Tiny(
        "olmo3",
        _zoo(
            "olmo3-nano",
            n_layers=3,
            attention={"n_kv_heads": 2, "sliding_window": 5, "global_every": 2},
            positions={"local_theta": 500.0, "scaling": YARN_16},
        ),
    ),
    # Mixtures of experts: 4 experts, 2 per token (tests/test_moe.py: the grouped product).
    Tiny(
        "mixtral",
        _zoo("mixtral-8x7b", attention={"n_kv_heads": 2}, moe={"n_experts": 4}),
        lora=_ROUTED_LORA,
        published={"mixtral-8x7b": (46_702_792_704, "12.9")},
    ),
    # A shared expert with its gate, top-k probabilities not renormalised, q/k/v biases.
    Tiny(
        "qwen2_moe",
        _zoo(
            "qwen1.5-moe-a2.7b",
            attention={"n_kv_heads": 2},
            moe={"n_experts": 4, "experts_per_token": 2, "d_ff": 16, "shared_d_ff": 24},
        ),
        lora=(*_ROUTED_LORA, "shared_expert_gate"),
        published={"qwen1.5-moe-a2.7b": ("14.3", "2.7")},
    ),
    Tiny(
        "olmoe",
        _zoo("olmoe-1b-7b", moe={"n_experts": 4, "experts_per_token": 2}),
        lora=_ROUTED_LORA,
        published={"olmoe-1b-7b": ("6.9", "1.3")},
    ),
    # Pythia's block: a parallel residual, a quarter of each head rotated (2 of 8 dims).
    Tiny(
        "gpt_neox",
        _zoo("pythia-nano"),
        # Not the output embedding: eqllm names its adapter embed_out as checkpoints do, while
        # transformers 5 holds that module as lm_head, where peft looks for it.
        lora=("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
        published={
            "pythia-70m": 70_426_624,
            "pythia-160m": 162_322_944,
            "pythia-410m": 405_334_016,
            "pythia-1b": 1_011_781_632,
            "pythia-1.4b": 1_414_647_808,
            "pythia-2.8b": 2_775_208_960,
            "pythia-6.9b": 6_857_302_016,
            "pythia-12b": 11_846_072_320,
            "gpt-neox-20b": 20_554_567_680,
        },
    ),
    # The sequential residual; int(8 * 0.6) = 4 rotated dims (the fraction is truncated), another
    # base, another eps.
    Tiny(
        "gpt_neox-sequential",
        _zoo(
            "pythia-nano",
            parallel_residual=False,
            positions={"fraction": 0.6, "theta": 500.0},
            norms={"eps": 1e-3},
        ),
        variant=True,
    ),
    # NoPE layers: every second layer has no rotary embedding.
    Tiny(
        "smollm3",
        _zoo("smollm3-nano", n_layers=4, attention={"n_kv_heads": 2}, positions={"nope_every": 2}),
        published={"smollm3-3b": 3_075_098_624},
    ),
    # QK-norm over heads wider than d_model / n_heads, 4 experts of 16, 2 per token, an aux loss
    # coefficient large enough to move the training loss; top-k weights renormalised or not.
    Tiny(
        "qwen3_moe",
        _zoo(
            "qwen3_moe-nano",
            attention={"n_kv_heads": 2, "head_dim": 16},
            moe={"n_experts": 4, "experts_per_token": 2, "d_ff": 16, "aux_loss_coef": 0.1},
        ),
        lora=_ROUTED_LORA,
        published={"qwen3-30b-a3b": 30_532_122_624, "qwen3-235b-a22b": 235_093_634_560},
    ),
    Tiny(
        "qwen3_moe-raw_topk",
        _zoo(
            "qwen3_moe-nano",
            attention={"n_kv_heads": 2, "head_dim": 16},
            moe={
                "n_experts": 4,
                "experts_per_token": 2,
                "d_ff": 16,
                "aux_loss_coef": 0.1,
                "norm_topk_prob": False,
            },
        ),
        variant=True,
        lora=_ROUTED_LORA,
    ),
    # Sliding (layer 0) and full layers, attention sinks, biases, YaRN, 4 experts of 64 with a
    # clamp small enough to bind on these activations.
    Tiny(
        "gpt_oss",
        _zoo(
            "gpt_oss-nano",
            attention={"n_kv_heads": 2, "head_dim": 16, "sliding_window": 8},
            moe={"n_experts": 4, "swiglu_limit": 0.5, "aux_loss_coef": 0.1},
            positions={"theta": 150000.0},
        ),
        lora=_ROUTED_LORA,
        published={"gpt-oss-20b": 20_914_757_184, "gpt-oss-120b": 116_829_156_672},
    ),
    # Query compression, sigmoid scores with a correction bias, the best 2 of 4 groups.
    Tiny(
        "deepseek_v3",
        _zoo("deepseek_v3-nano", **{**MLA, "attention": MLA_Q, "moe": GROUPED}),
        lora=_MLA_LORA,
        gguf=True,
        # Kimi K2's total as transformers' DeepSeek-V3 counts its config.json (its model card
        # rounds it to 1T).
        published={"deepseek-v3": 671_026_419_200, "kimi-k2": 1_026_408_232_448},
    ),
    # GLM-4.5 (counts as transformers counts the published config.json files, without the
    # multi-token-prediction layer; the model cards' 355B and 106B include it): q/k/v biases,
    # QK-norm, half of each 16-wide head rotated, a dense first layer and then sigmoid scores
    # with a correction bias, the best 2 of 4 groups, a shared expert.
    Tiny(
        "glm4_moe",
        _zoo("glm4_moe-nano", n_layers=3, attention=GQA_16, moe=GROUPED),
        lora=_ROUTED_LORA,
        gguf=True,
        published={"glm-4.5": GLM_355B, "glm-4.6": GLM_355B, "glm-4.5-air": 106_852_251_264},
    ),
    # GLM-4.5-Air's block: no QK-norm, one group, one shared expert, weights not renormalised;
    # YaRN on the 8 rotated dims (the original context, 16, shorter than the test sequences).
    Tiny(
        "glm4_moe-air",
        _zoo(
            "glm4_moe-nano",
            n_layers=3,
            attention={**GQA_16, "qk_norm": None},
            moe={"n_experts": 4, "experts_per_token": 2, "d_ff": 16, "shared_d_ff": 16},
            positions={"scaling": YARN_16},
            **{"moe.norm_topk_prob": False},
        ),
        variant=True,
        lora=_ROUTED_LORA,
    ),
    # Llama 4 Scout's block: chunked (chunks of 8, many inside the test sequences), global NoPE,
    # chunked, global NoPE layers; L2-normalised q/k on the chunked ones, temperature tuning on
    # the global ones from position 15 on, adjacent rotary pairs; 4 experts of 16, one per
    # token, scaling the expert's input, and the shared expert.
    Tiny(
        "llama4",
        _zoo(
            "llama4-nano",
            n_layers=4,
            attention={
                "n_kv_heads": 2,
                "head_dim": 8,
                "chunk_size": 8,
                "global_every": 2,
                "temperature_floor": 16,
            },
            positions={"nope_every": 2},
            moe={"n_experts": 4, "d_ff": 16, "shared_d_ff": 16},
        ),
        lora=_ROUTED_LORA,
        published={"llama4-scout": (107_769_861_120, "17")},
    ),
    # Llama 4 Maverick's layout: dense and expert layers alternate (interleave_moe_layer_step 2;
    # the dense MLP 40 wide, the experts 16) over seven layers, so the depth is not a whole
    # number of (dense, experts) pairs; chunked, chunked, global NoPE: the window pattern (period
    # 3) crosses the pairs, and each kind of layer has both chunked and global layers.
    Tiny(
        "llama4-maverick",
        _zoo(
            "llama4-nano",
            n_layers=7,
            attention={
                "n_kv_heads": 2,
                "head_dim": 8,
                "chunk_size": 8,
                "global_every": 3,
                "temperature_floor": 16,
            },
            positions={"nope_every": 3},
            mlp={"d_ff": 40},
            moe={"n_experts": 4, "d_ff": 16, "shared_d_ff": 16, "sparse_every": 2},
        ),
        variant=True,
        lora=_ROUTED_LORA,
        published={"llama4-maverick": (400_711_848_960, "17")},
    ),
    # Direct queries, softmax greedy top-k, not renormalised.
    Tiny(
        "deepseek_v2",
        _zoo("deepseek_v2-nano", **{**MLA, "moe": {**MLA["moe"], "routed_scale": 1.5}}),
        lora=tuple(t for t in _MLA_LORA if t not in ("q_a_proj", "q_b_proj")) + ("q_proj",),
        gguf=True,
        published={"deepseek-v2-lite": 15_706_484_224},
    ),
    # Gated DeltaNet, gated attention, Gated DeltaNet, gated attention: two groups of the
    # pattern, key heads fewer than value heads, a quarter of each head rotated, (1 + w) norms.
    # Both sides' chunked delta rule in fp32 lie ~1e-5 from an fp64 reference, hence 1e-4.
    Tiny(
        "qwen3_5",
        _zoo("qwen3_5-nano", **_HYBRID),
        gguf=True,
        atol=1e-4,
        cached_atol=3e-5,  # the chunked and token-by-token delta rules round differently
    ),
    # Any order of config.json's layer_types: linear, full, linear, linear, full, full (no
    # repeating group: the stack runs it as runs of one kind).
    Tiny(
        "qwen3_5-layer_types",
        _zoo(
            "qwen3_5-nano",
            **{
                **_HYBRID,
                "n_layers": 6,
                "linear": {**_HYBRID["linear"], "full_every": None, "pattern": IRREGULAR},
            },
        ),
        variant=True,
        # The layer order is what this case checks: adapters on attention only (with every
        # target, peft's large rsLoRA B moves fp32 rounding past the peft test's 1e-4 bound
        # on a few logits of this deeper stack, 3.4e-4; the 4-layer entry covers every target).
        lora=("q_proj", "k_proj", "v_proj", "o_proj"),
        atol=1e-4,
        cached_atol=3e-5,
    ),
    # Qwen3.5's hybrid with 4 experts of 16 (renormalised top 2) and a gated shared expert of
    # 24 in every layer.
    Tiny(
        "qwen3_5_moe",
        _zoo("qwen3_5_moe-nano", **{**_HYBRID, "mlp.d_ff": 16}, moe=_HYBRID_MOE),
        lora=_HYBRID_LORA + ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
        # The 397B-A17B's language model is 396.3B: its 397B counts the vision tower.
        published={"qwen3.5-35b-a3b": ("35", "3")},
        gguf=True,
        atol=1e-4,
        cached_atol=3e-5,  # the chunked and token-by-token delta rules round differently
    ),
    # The same stack with the Gated DeltaNet's projections grouped by key head (in_proj_qkvz,
    # in_proj_ba).
    Tiny(
        "qwen3_next",
        _zoo("qwen3_next-nano", **_HYBRID, moe={**_HYBRID_MOE, "d_ff": 16}),
        lora=_HYBRID_LORA + ("in_proj_qkvz", "in_proj_ba"),
        published={"qwen3-next-80b-a3b": "80"},  # 3.87B active, named "A3B"
        gguf=True,
        atol=1e-4,
        cached_atol=3e-5,  # the chunked and token-by-token delta rules round differently
    ),
    # Pre-norm Gated DeltaNet layers between post-norm attention layers with whole QK-norm, the
    # write strength up to 2, the gated norm's own epsilon; fewer key heads than value heads.
    Tiny(
        "olmo_hybrid",
        _zoo("olmo_hybrid-nano", n_layers=4, attention={"n_kv_heads": 2}, linear=_OLMO_LINEAR),
        atol=1e-4,
        cached_atol=3e-5,  # the chunked and token-by-token delta rules round differently
        published={"olmo-hybrid-7b": "7"},
    ),
    # The 7B release's positions: none (rope_theta null), key heads as many as value heads.
    Tiny(
        "olmo_hybrid-nope",
        _zoo(
            "olmo_hybrid-nano",
            n_layers=4,
            positions={"kind": "none"},
            linear={**_OLMO_LINEAR, "n_value_heads": 2},
        ),
        variant=True,
        atol=1e-4,
    ),
    # Mamba-2 layers alone (no attention, no MLP): 8 heads of 8 in 2 groups of B and C, a state
    # of 8, chunks of 16 (the test sequence padded to whole chunks, as transformers pads it).
    # peft adapts in_proj of Mamba models and refuses out_proj (its fused kernels' limit).
    Tiny(
        "mamba2",
        _zoo(
            "mamba2-nano",
            attention={"n_heads": 1},
            mlp={"d_ff": 1},
            linear={
                "n_key_heads": 2,
                "n_value_heads": 8,
                "key_head_dim": 8,
                "value_head_dim": 8,
                "chunk_size": 16,
            },
        ),
        lora=("in_proj",),
        gguf=True,
        atol=1e-4,
        # state-spaces' sizes as their names round them; Mistral's release post of Codestral Mamba
        # counts 7,285,403,648.
        published={
            "mamba2-130m": "0.13",
            "mamba2-370m": "0.37",
            "mamba2-780m": "0.78",
            "mamba2-1.3b": "1.3",
            "mamba2-2.7b": "2.7",
            "mamba-codestral-7b": 7_285_403_648,
        },
    ),
    # Mamba-Codestral's layout: an untied head, one group; dt clamped to limits that the
    # perturbed twin's time steps cross at both ends (transformers' time_step_limit on its
    # chunked path).
    Tiny(
        "mamba2_untied",
        _zoo(
            "mamba2-nano",
            attention={"n_heads": 1},
            mlp={"d_ff": 1},
            tie_embeddings=False,
            linear={
                "n_key_heads": 1,
                "n_value_heads": 4,
                "key_head_dim": 8,
                "value_head_dim": 16,
                "chunk_size": 32,
                "dt_min": 0.01,
                "dt_max": 0.1,
            },
        ),
        variant=True,
        lora=("in_proj",),
        atol=1e-4,
    ),
    # Nemotron-H: one sublayer per layer, Mamba-2 (tests/tiny.py's mixer), MLP, attention (2
    # kv heads of 8, no rotary), MLP, Mamba-2: an irregular pattern cut into runs. peft's
    # default targets for it are the attention projections; in_proj and the MLP's are nn.Linear.
    Tiny(
        "nemotron_h",
        _zoo(
            "nemotron_h-nano",
            n_layers=5,
            attention={"n_heads": 4, "n_kv_heads": 2, "head_dim": 8},
            mlp={"d_ff": 64},
            linear={**tiny.FALCON_MIXER, "pattern": ("linear", "ffn", "full", "ffn", "linear")},
        ),
        lora=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"),
        gguf=True,
        # As the releases name them (where each size comes from: zoo/nemotron_h.toml).
        published={
            "nemotron-h-4b": "4",
            "nemotron-h-8b": "8",
            "nemotron-h-47b": "47",
            "nemotron-h-56b": "56",
            "nemotron-nano-9b-v2": "9",
            "nemotron-nano-12b-v2": "12",
        },
        atol=1e-4,
    ),
    # Nemotron 3: the same layers with mixtures of experts in place of the MLPs (tests/tiny.py's
    # NEMOTRON_MOE: ungated experts, grouped sigmoid routing with the correction bias). peft
    # adapts the shared expert's up/down_proj; the router and fused experts are not nn.Linear.
    Tiny(
        "nemotron_h_moe",
        _zoo(
            "nemotron_h-moe-nano",
            n_layers=5,
            attention={"n_heads": 4, "n_kv_heads": 2, "head_dim": 8},
            mlp={"d_ff": 16},
            linear={**tiny.FALCON_MIXER, "pattern": ("linear", "ffn", "full", "ffn", "linear")},
            moe=tiny.NEMOTRON_MOE,
        ),
        variant=True,
        lora=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"),
        published={"nemotron-3-nano-30b-a3b": ("31.6", "3.6")},
        atol=1e-4,
        gguf=True,
    ),
    # Falcon-H1: attention (2 kv heads of 8) and Mamba-2 (tests/tiny.py) in parallel in every
    # layer, its releases' norm-free gate, every muP multiplier away from 1.
    Tiny(
        "falcon_h1",
        _zoo(
            "falcon_h1-nano",
            attention={"n_heads": 4, "n_kv_heads": 2, "head_dim": 8},
            linear=tiny.FALCON_MIXER,
            multipliers=tiny.FALCON_MULTIPLIERS,
        ),
        lora=tiny.FALCON_LORA,
        gguf=True,
        atol=1e-4,
    ),
    # The mixer's gated RMSNorm before the gate (mamba_rms_norm and mamba_norm_before_gate),
    # dt clamped to limits the perturbed twin's time steps cross at both ends, a tied head.
    Tiny(
        "falcon_h1_normed",
        _zoo(
            "falcon_h1-nano",
            attention={"n_heads": 4, "n_kv_heads": 2, "head_dim": 8},
            linear={**tiny.FALCON_MIXER, "gate_norm": "before_gate", "dt_min": 0.01, "dt_max": 0.1},
            multipliers=tiny.FALCON_MULTIPLIERS,
            tie_embeddings=True,
        ),
        variant=True,
        lora=tiny.FALCON_LORA[:-1],  # tied: no lm_head of its own
        atol=1e-4,
    ),
    # Granite 4.0-H: Mamba-2 and attention layers in a pattern with a remainder, every layer's
    # experts beside the shared MLP, rotary positions, each of Granite's multipliers away from 1.
    Tiny(
        "granitemoehybrid",
        _zoo(
            "granitemoehybrid-nano",
            **tiny.GRANITE,
            moe=tiny.GRANITE_MOE,
            mlp={"d_ff": 16},
            positions={"kind": "rope"},
            tie_embeddings=False,
        ),
        lora=tiny.GRANITE_LORA,
        gguf=True,
        published={
            "granite-4.0-h-tiny": ("7", "1"),
            "granite-4.0-h-1b": "1.5",
            "granite-4.0-h-small": ("32", "9"),
            "granite-4.0-h-micro": "3",
        },
        atol=1e-4,
        cached_atol=3e-5,
    ),
    # The dense sizes (num_local_experts 0: the shared MLP alone), no positions, a tied head.
    Tiny(
        "granitemoehybrid_dense",
        _zoo("granitemoehybrid-nano", **tiny.GRANITE, moe=None),
        variant=True,
        lora=tiny.GRANITE_LORA[:-1],
        gguf=True,
        atol=1e-4,
        cached_atol=3e-5,
    ),
]
# tests/conftest.py records here the parametrised tests none of whose cases runs by default;
# tests/test_suite.py fails naming them.
NO_DEFAULT_CASE = pytest.StashKey[list]()

BY_NAME = {tiny.name: tiny for tiny in FAMILIES}
TINY_CONFIGS = {tiny.name: tiny.config for tiny in FAMILIES}


def params(default: Iterable[str] | None = None, *, where=None) -> list:
    """pytest parameters over the list's names (those `where(tiny)` keeps): the cases in
    `default` run by default and the others in the slow set; without `default`, every family's
    first entry runs by default and variants in the slow set. A name in `default` that is not in
    the list is an error, so renaming an entry cannot drop a case silently."""
    chosen = [t for t in FAMILIES if where is None or where(t)]
    if default is None:
        default = {t.name for t in chosen if not t.variant}
    default = set(default)
    unknown = default - {t.name for t in chosen}
    if unknown:
        raise KeyError(f"{sorted(unknown)} are not in tests/families.py's FAMILIES (or filtered)")
    return [
        t.name if t.name in default else pytest.param(t.name, marks=pytest.mark.slow)
        for t in chosen
    ]
