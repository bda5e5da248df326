"""The stacked Transformer blocks: built from a ModelConfig (`build`) and run in order by
`lax.scan` (`run`).

Every layer is the same Block (`eqllm.nn.Block`), its arrays stacked on a leading `layers` axis
so one compiled body serves any depth (Levanter, MaxText do the same). What differs between
layers, the local/global attention pattern of Gemma 2 and 3 and OLMo 3 (with its own RoPE base)
and SmolLM3's layers without rotary embedding (NoPE), are per-layer flags scanned alongside the
weights rather than second stacks or an unrolled loop. A model with several kinds of layer
(`ModelConfig.layer_kinds`: a mixture of experts' dense layers, a hybrid's linear-attention
layers) holds one stack per kind and runs them in segments (`run_stacks`): a run of one kind
(`run_blocks`) or a repeated pattern of kinds, scanned group by group (`run_groups`).
"""

from eqllm.stack.build import (
    dtype_of,
    initial_parts,
    make_attention,
    make_block,
    make_linear_attention,
    make_norm,
    make_rope,
    mla_scale,
    multipliers_of,
)
from eqllm.stack.run import (
    REMAT_POLICIES,
    LayerHook,
    checkpointed,
    each_layer,
    layer_flag,
    layer_flags,
    run_blocks,
    run_groups,
    run_stacks,
)

__all__ = [
    "REMAT_POLICIES",
    "LayerHook",
    "checkpointed",
    "dtype_of",
    "each_layer",
    "initial_parts",
    "layer_flag",
    "layer_flags",
    "make_attention",
    "make_block",
    "make_linear_attention",
    "make_norm",
    "make_rope",
    "mla_scale",
    "multipliers_of",
    "run_blocks",
    "run_groups",
    "run_stacks",
]
