"""What the layers read beside their hidden states: checked token ids (`check_tokens`), a
layer's per-layer input (`config.per_layer`) and, in a kv-shared layer, its source layer's keys
and values (`attention.kv_shared_layers`; `eqllm.config.per_layer`): `layer_inputs` and
`shared_fields` in the full forward (`eqllm.stack.run`; cached decoding: `run.layer_extra`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from eqllm.config import ModelConfig
from eqllm.config.kinds import layer_stacks
from eqllm.config.per_layer import kv_sources
from eqllm.errors import EqllmError


def shared_fields(config: ModelConfig, kv: dict) -> dict:
    """{stack field: {window flag: (keys, values)}}: for each stack of kv-shared layers, the
    sources' keys and values of the types (windowed or global) its layers have, those computed
    so far (`kv`, by window flag)."""
    fields, local, stacks = {}, config.local_layers(), layer_stacks(config)
    for i in kv_sources(config):
        if local[i] in kv:
            fields.setdefault(stacks[i], {})[local[i]] = kv[local[i]]
    return fields


def layer_inputs(per_layer_input, shared: dict | None, local) -> dict:
    """The keyword arguments of a layer's `Block.routed` beyond the usual ones: its per-layer
    input, and a kv-shared layer's keys and values (those of its type's source: picked by its
    window flag, traced in a scan, where one stack has both types, of one shape)."""
    extra = {} if per_layer_input is None else {"per_layer_input": per_layer_input}
    if not shared:
        return extra
    if len(shared) == 1:
        extra["shared"] = next(iter(shared.values()))
    elif isinstance(local, bool | np.bool_):
        extra["shared"] = shared[bool(local)]
    else:
        extra["shared"] = jax.tree.map(
            lambda a, b: jnp.where(local, a, b), shared[True], shared[False]
        )
    return extra


def check_tokens(tokens, config: ModelConfig) -> None:
    """Reject token arrays the model cannot take, with a message that says what to do."""
    shape = getattr(tokens, "shape", None)
    if shape is None or len(shape) not in (1, 2):
        raise TypeError(
            f"tokens must be a 1-D (seq,) or 2-D (batch, seq) integer array, got shape {shape}"
        )
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must have an integer dtype, got {tokens.dtype}")
    if shape[-1] > config.max_seq_len:
        raise ValueError(
            f"sequence of {shape[-1]} tokens is longer than the context "
            f"max_seq_len={config.max_seq_len}; truncate it or use a model with a longer context"
        )
    if 0 in shape:
        raise ValueError(f"tokens is empty (shape {shape}); give at least one token")
    if not isinstance(tokens, jax.core.Tracer):  # concrete ids: check their range here
        ids = np.asarray(tokens)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= config.vocab_size:
            raise EqllmError(
                f"token id out of range: ids in [{low}, {high}], but ids must lie in "
                f"[0, vocab_size={config.vocab_size}); check the tokenizer matches the model"
            )
