"""Key tables: which Hugging Face tensor holds which eqllm array, one table per family.

A row maps an HF name template (`{i}` = layer index) to the eqllm leaf path(s) it holds.
Layer rows fill the leading `layers` axis of the stacked `blocks`. A row naming several eqllm
leaves is a fused HF tensor, split along the output axis on the way in and concatenated on the
way out. `conv1d` rows are GPT-2's Conv1D, which stores weights (in, out): transposed.
Rows whose eqllm leaves the config does not have (biases, an untied head) are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    hf: str
    eqllm: tuple[str, ...]
    conv1d: bool = False

    @property
    def layered(self) -> bool:
        return "{i}" in self.hf


def _rows(*rows: tuple) -> tuple[Row, ...]:
    out = []
    for hf, eqllm, *conv1d in rows:
        out.append(Row(hf, (eqllm,) if isinstance(eqllm, str) else tuple(eqllm), *conv1d))
    return tuple(out)


_QKV = ("blocks.attn.q_proj.{p}", "blocks.attn.k_proj.{p}", "blocks.attn.v_proj.{p}")

GPT2 = _rows(
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

# Llama, Mistral, Qwen2 and Gemma checkpoints share these names (they differ in which rows
# exist: Qwen2 has q/k/v biases, Llama may have all biases, Gemma ties the head).
LLAMA = _rows(
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blocks.attn_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "blocks.attn.q_proj.weight"),
    ("model.layers.{i}.self_attn.q_proj.bias", "blocks.attn.q_proj.bias"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blocks.attn.k_proj.weight"),
    ("model.layers.{i}.self_attn.k_proj.bias", "blocks.attn.k_proj.bias"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blocks.attn.v_proj.weight"),
    ("model.layers.{i}.self_attn.v_proj.bias", "blocks.attn.v_proj.bias"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blocks.attn.o_proj.weight"),
    ("model.layers.{i}.self_attn.o_proj.bias", "blocks.attn.o_proj.bias"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks.mlp_norm.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "blocks.mlp.gate.weight"),
    ("model.layers.{i}.mlp.gate_proj.bias", "blocks.mlp.gate.bias"),
    ("model.layers.{i}.mlp.up_proj.weight", "blocks.mlp.up.weight"),
    ("model.layers.{i}.mlp.up_proj.bias", "blocks.mlp.up.bias"),
    ("model.layers.{i}.mlp.down_proj.weight", "blocks.mlp.down.weight"),
    ("model.layers.{i}.mlp.down_proj.bias", "blocks.mlp.down.bias"),
    ("model.norm.weight", "final_norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)

TABLES = {"gpt2": GPT2, "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "gemma": LLAMA}

# Prefix of the base model's names: checkpoints of the bare GPT2Model / LlamaModel (e.g. the
# original `gpt2` repo) store names without it.
PREFIX = {"gpt2": "transformer.", "llama": "model.", "mistral": "model.", "qwen2": "model."}
PREFIX["gemma"] = "model."

# Non-parameter buffers some checkpoints carry: read past, never needed.
BUFFERS = re.compile(r"(.*\.attn\.(bias|masked_bias)|.*\.rotary_emb\.inv_freq)$")

TIED_HEAD = "lm_head.weight"


def rows_for(family: str, leaves: set[str]) -> list[Row]:
    """The rows of `family`'s table that the model with these leaf paths has.

    Raises if a leaf is held by no row (a table out of step with the model code).
    """
    rows = [r for r in TABLES[family] if all(p in leaves for p in r.eqllm)]
    partial = [r for r in TABLES[family] if r not in rows and any(p in leaves for p in r.eqllm)]
    covered = {p for r in rows for p in r.eqllm}
    if partial or covered != leaves:
        raise AssertionError(
            f"{family} key table does not match the model: uncovered {sorted(leaves - covered)}, "
            f"partly present {[r.hf for r in partial]}"
        )
    return rows
