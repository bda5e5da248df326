"""GPT-2 (Radford et al., 2019): learned positions, LayerNorm with biases, GELU MLP, biases on
every projection, LM head tied to the embedding; Hugging Face's Conv1D stores (in, out)."""

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families.base import PLAIN, Family, refuse, rows

_QKV = ("blocks.attn.q_proj.{p}", "blocks.attn.k_proj.{p}", "blocks.attn.v_proj.{p}")
_END_OF_TEXT = 50256  # GPT-2's <|endoftext|>

TABLE = rows(
    ("transformer.wte.weight", "embed.weight"),
    ("transformer.wpe.weight", "pos_embed.weight"),
    ("transformer.h.{i}.ln_1.weight", "blocks.attn_norm.weight"),
    ("transformer.h.{i}.ln_1.bias", "blocks.attn_norm.bias"),
    ("transformer.h.{i}.attn.c_attn.weight", [t.format(p="weight") for t in _QKV], True),
    ("transformer.h.{i}.attn.c_attn.bias", [t.format(p="bias") for t in _QKV], True),
    ("transformer.h.{i}.attn.c_proj.weight", "blocks.attn.o_proj.weight", True),
    ("transformer.h.{i}.attn.c_proj.bias", "blocks.attn.o_proj.bias", True),
    ("transformer.h.{i}.ln_2.weight", "blocks.mlp_norm.weight"),
    ("transformer.h.{i}.ln_2.bias", "blocks.mlp_norm.bias"),
    ("transformer.h.{i}.mlp.c_fc.weight", "blocks.mlp.up.weight", True),
    ("transformer.h.{i}.mlp.c_fc.bias", "blocks.mlp.up.bias", True),
    ("transformer.h.{i}.mlp.c_proj.weight", "blocks.mlp.down.weight", True),
    ("transformer.h.{i}.mlp.c_proj.bias", "blocks.mlp.down.bias", True),
    ("transformer.ln_f.weight", "final_norm.weight"),
    ("transformer.ln_f.bias", "final_norm.bias"),
    ("lm_head.weight", "lm_head.weight"),
)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    # GPT2Config defaults bos/eos to 50256, outside a smaller vocabulary; transformers then
    # warns and generation would use an invalid id.
    end_of_text = _END_OF_TEXT if cfg.vocab_size > _END_OF_TEXT else None
    return {
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.attention.n_heads,
        "n_inner": cfg.mlp.d_ff,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norms.eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": end_of_text,
        "eos_token_id": end_of_text,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"))
    refuse(hf, "scale_attn_weights", (True,))
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        refuse(hf, key, (False, None))
    refuse(hf, "add_cross_attention", (False, None))
    # OpenAI GPT's extra special embeddings, carried in the gpt2-medium/large/xl configs: none.
    refuse(hf, "n_special", (0,))
    refuse(hf, "tie_word_embeddings", (True,))
    d = hf.get("n_embd", 768)
    return {
        "vocab_size": hf.get("vocab_size", 50257),
        "d_model": d,
        "n_layers": hf.get("n_layer", 12),
        "attention.n_heads": hf.get("n_head", 12),
        "mlp.d_ff": hf.get("n_inner") or 4 * d,
        "max_seq_len": hf.get("n_positions", 1024),
        "norms.eps": hf.get("layer_norm_epsilon", 1e-5),
    }


FAMILY = Family(
    name="gpt2",
    released="2019-02",
    architecture="GPT2LMHeadModel",
    model_type="gpt2",
    fixed={
        **PLAIN,
        "norms.kind": "layernorm",
        "norms.bias": True,
        "mlp.kind": "gelu",
        "positions.kind": "learned",
        "attention.qkv_bias": True,
        "attention.out_bias": True,
        "mlp.bias": True,
        "tie_embeddings": True,
        "attention.sliding_window": None,
        "attention.qk_norm": None,
        "embed_scale": False,
    },
    table=TABLE,
    prefix="transformer.",
    hf_keys=frozenset(
        """
        n_embd n_layer n_head n_inner n_positions n_ctx activation_function layer_norm_epsilon
        resid_pdrop embd_pdrop attn_pdrop scale_attn_weights scale_attn_by_inverse_layer_idx
        reorder_and_upcast_attn add_cross_attention summary_type summary_use_proj
        summary_activation summary_proj_to_labels summary_first_dropout n_special
        predict_special_tokens
        """.split()
    ),
    to_hf=to_hf,
    from_hf=from_hf,
    check=lambda cfg: (
        {}
        if cfg.head_dim * cfg.attention.n_heads == cfg.d_model
        else {"attention.head_dim": cfg.head_dim}
    ),
)
