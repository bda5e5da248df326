"""Folding muP / CompleteP multipliers into the weights, so that an SP consumer (transformers)
computes the same logits: the readout multiplier into an untied LM head, CompleteP's branch
multiplier into each block's attention output and MLP down projections, muP's attention-score
factor into the query projection (RoPE is linear, so scaling q before it scales the scores)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from eqllm.errors import EqllmError
from eqllm.model import CausalLM
from eqllm.nn import GatedDeltaNet, Mamba2
from eqllm.parametrization import scales


def _times(linear, factor: float):
    """A Linear (or a module wrapping one) with weight and bias multiplied by `factor`."""
    linear = eqx.tree_at(lambda m: m.weight, linear, linear.weight * factor)
    if linear.bias is not None:
        linear = eqx.tree_at(lambda m: m.bias, linear, linear.bias * factor)
    return linear


def fold_multipliers(model: CausalLM) -> CausalLM:
    """The same function as an SP model (`parametrization="sp"`): equal logits up to rounding.

    Raises EqllmError for what SP weights cannot express: a tied head with a readout
    multiplier, a branch multiplier before a post-norm, an attention factor under QK-norm.
    """
    cfg = model.config
    s = scales(cfg)
    if s.kind == "sp":
        return model
    if s.readout != 1.0:
        if model.lm_head is None:
            raise EqllmError(
                f"parametrization={cfg.parametrization!r} multiplies the logits by "
                f"{s.readout:g} (output_mult / width ratio), which a tied head cannot hold in "
                "its weights; train with tie_embeddings=False (untie) to export, or at the base "
                "width with output_mult=1"
            )
        model = eqx.tree_at(lambda m: m.lm_head, model, _times(model.lm_head, s.readout))
    blocks = model.blocks
    if s.branch != 1.0:
        if blocks.attn_post_norm is not None or blocks.mlp_post_norm is not None:
            raise EqllmError(
                "CompleteP's branch multiplier sits after the post-norms of this family, where "
                "no weight can hold it; export at base_n_layers == n_layers"
            )
        blocks = _branch_folded(blocks, s.branch)
    if s.attention != 1.0:
        if cfg.attention.qk_norm is not None:
            raise EqllmError(
                "muP's attention factor cannot be folded into q_proj under qk_norm (the norm "
                "undoes it); export at base_d_model == d_model"
            )
        blocks = eqx.tree_at(
            lambda b: b.attn.q_proj, blocks, _times(blocks.attn.q_proj, s.attention)
        )
    model = eqx.tree_at(lambda m: m.blocks, model, blocks)
    for field in ("linear_blocks", "ffn_blocks"):  # a hybrid's other stacks
        if (stack := getattr(model, field)) is not None and s.branch != 1.0:
            stack = _branch_folded(stack, s.branch)
            model = eqx.tree_at(lambda m, f=field: getattr(m, f), model, stack)
    sp = cfg.replace(parametrization="sp", base_d_model=None, base_n_layers=None, output_mult=1.0)
    # Rebuild the static parts (the blocks' branch scale, attention scale) for the SP config.
    skeleton = eqx.filter_eval_shape(CausalLM, sp, key=jax.random.key(0))
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(model)]
    return jax.tree.unflatten(jax.tree.structure(skeleton), leaves)


def _branch_folded(blocks, branch: float):
    """A stack with CompleteP's branch multiplier folded into the output projection of each
    sublayer it has: attention's o_proj (a recurrent mixer's out_proj), the MLP's down, a
    parallel mixer's out_proj."""
    out = "out_proj" if isinstance(blocks.attn, GatedDeltaNet | Mamba2) else "o_proj"
    parts = [lambda b: getattr(b.attn, out)] if blocks.attn is not None else []
    if blocks.mlp is not None:
        parts.append(lambda b: b.mlp.down)
    if blocks.ssm is not None:  # a parallel mixer's output joins attention's branch
        parts.append(lambda b: b.ssm.out_proj)
    for where in parts:
        blocks = eqx.tree_at(where, blocks, _times(where(blocks), branch))
    return blocks
