"""GPT-NeoX (Black et al., 2022, "GPT-NeoX-20B") and Pythia (Biderman et al., 2023): LayerNorm
with biases, biases on every projection, an exact-GELU MLP, rotary positions on the leading
`rotary_pct` of each head, a parallel residual (attention and MLP both read the block's input;
`use_parallel_residual = false` chains them) and an untied output embedding (`embed_out`).

The published checkpoints store q, k and v as one `query_key_value` tensor interleaved per head
([n_heads, 3, head_dim] along its output axis), which the key table marks `per_head`.
transformers 5 renames `embed_out` to `lm_head` in memory and may save either: both are read,
`embed_out` is written (the published layout, which transformers 4 and 5 read).
"""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families._rope import max_position_embeddings, rope_from_hf, rope_params
from eqllm.families.base import (
    DENSE,
    Family,
    need,
    one_attention_bias,
    rows,
    token_ids,
)

_QKV = ("blocks.attn.q_proj.{p}", "blocks.attn.k_proj.{p}", "blocks.attn.v_proj.{p}")
_LAYER = "gpt_neox.layers.{i}"


def _table(head: str) -> tuple:
    return (
        rows(
            ("gpt_neox.embed_in.weight", "embed.weight"),
            (f"{_LAYER}.input_layernorm.weight", "blocks.attn_norm.weight"),
            (f"{_LAYER}.input_layernorm.bias", "blocks.attn_norm.bias"),
        )
        + rows(
            (f"{_LAYER}.attention.query_key_value.weight", [t.format(p="weight") for t in _QKV]),
            (f"{_LAYER}.attention.query_key_value.bias", [t.format(p="bias") for t in _QKV]),
            per_head=True,
        )
        + rows(
            (f"{_LAYER}.attention.dense.weight", "blocks.attn.o_proj.weight"),
            (f"{_LAYER}.attention.dense.bias", "blocks.attn.o_proj.bias"),
            (f"{_LAYER}.post_attention_layernorm.weight", "blocks.mlp_norm.weight"),
            (f"{_LAYER}.post_attention_layernorm.bias", "blocks.mlp_norm.bias"),
            (f"{_LAYER}.mlp.dense_h_to_4h.weight", "blocks.mlp.up.weight"),
            (f"{_LAYER}.mlp.dense_h_to_4h.bias", "blocks.mlp.up.bias"),
            (f"{_LAYER}.mlp.dense_4h_to_h.weight", "blocks.mlp.down.weight"),
            (f"{_LAYER}.mlp.dense_4h_to_h.bias", "blocks.mlp.down.bias"),
            ("gpt_neox.final_layer_norm.weight", "final_norm.weight"),
            ("gpt_neox.final_layer_norm.bias", "final_norm.bias"),
            (head, "lm_head.weight"),
        )
    )


TABLE = _table("embed_out.weight")
# hidden_act -> mlp.gelu: "gelu" is the exact erf form; GPT-NeoX-20B's "gelu_fast" and
# "gelu_new" are the tanh approximation (the same formula).
_GELU = {"gelu": "exact", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh"}
_TOKEN_IDS = {"bos_token_id": 0, "eos_token_id": 0}  # <|endoftext|> in the releases' tokenizer


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **token_ids(cfg, _TOKEN_IDS),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.attention.n_heads,
        "hidden_act": "gelu" if cfg.mlp.gelu == "exact" else "gelu_new",
        "max_position_embeddings": max_position_embeddings(cfg),
        "layer_norm_eps": cfg.norms.eps,
        "rotary_pct": cfg.positions.fraction,
        "rotary_emb_base": cfg.positions.theta,
        "use_parallel_residual": cfg.parallel_residual,
        "attention_bias": cfg.attention.qkv_bias,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("hidden_act", "gelu")
    if act not in _GELU:
        raise ConfigError(
            f"config.json hidden_act={act!r} is not supported; eqllm handles {list(_GELU)}"
        )
    # transformers reads rope_parameters (transformers 5) or rope_scaling first, then the
    # releases' rotary_emb_base and rotary_pct (0.25 when absent).
    rope = rope_params(hf)
    theta = rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0))
    fraction = rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    d, n_heads = need(hf, "hidden_size"), need(hf, "num_attention_heads")
    bias = bool(hf.get("attention_bias", True))
    return {
        **rope_from_hf({**hf, "rope_theta": theta}, allowed=("default",)),
        "vocab_size": need(hf, "vocab_size"),
        "d_model": d,
        "n_layers": need(hf, "num_hidden_layers"),
        "attention.n_heads": n_heads,
        "attention.head_dim": d // n_heads,
        "attention.qkv_bias": bias,
        "attention.out_bias": bias,
        "mlp.d_ff": need(hf, "intermediate_size"),
        "mlp.gelu": _GELU[act],
        "positions.fraction": float(fraction),
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "norms.eps": hf.get("layer_norm_eps", 1e-5),
        "parallel_residual": bool(hf.get("use_parallel_residual", True)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def check(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' GPT-NeoX has d_model // n_heads wide heads, all of them for keys and
    values, and one switch for every attention bias."""
    wrong = one_attention_bias(cfg)
    if cfg.head_dim * cfg.attention.n_heads != cfg.d_model:
        wrong["attention.head_dim"] = cfg.head_dim
    if cfg.attention.n_kv_heads != cfg.attention.n_heads:
        wrong["attention.n_kv_heads"] = cfg.attention.n_kv_heads
    return wrong


FAMILY = Family(
    name="gpt_neox",
    released="2022-04",
    architecture="GPTNeoXForCausalLM",
    model_type="gpt_neox",
    fixed={
        **DENSE,
        "attention.sinks": False,
        "norms.kind": "layernorm",
        "norms.bias": True,
        "norms.pre": True,
        "norms.post": False,
        "mlp.kind": "gelu",
        "mlp.bias": True,
        "positions.kind": "rope",
        "positions.local_theta": None,
        "positions.scaling": None,
        "positions.nope_every": None,
        "attention.qk_norm": None,
        "attention.softcap": None,
        "attention.sliding_window": None,
        "attention.global_every": None,
        "attention.query_pre_attn_scalar": None,
        "final_softcap": None,
        "embed_scale": False,
    },
    table=TABLE,
    prefix="gpt_neox.",
    # The dropouts do nothing at inference (transformers 4 named them *_prob);
    # classifier_dropout belongs to the sequence-classification head.
    hf_keys=frozenset(
        """
        hidden_size intermediate_size num_hidden_layers num_attention_heads hidden_act
        max_position_embeddings layer_norm_eps rotary_pct rotary_emb_base rope_scaling
        rope_parameters use_parallel_residual attention_bias attention_dropout hidden_dropout
        attention_probs_dropout_prob hidden_dropout_prob classifier_dropout
        """.split()
    ),
    to_hf=to_hf,
    from_hf=from_hf,
    check=check,
    layouts=(_table("lm_head.weight"),),
    module_renames={"embed_out": "lm_head"},
)
