"""Per-layer input embeddings and key/value caches shared by the last layers (Gemma 3n, Gemma 4
E2B and E4B).

`ModelConfig.per_layer` (None: none): every layer reads a small input of its own, `d` numbers
per token, from a second embedding table (`vocab_size` rows of n_layers x d, scaled by
sqrt(d)) mixed with a projection of the token embeddings (`eqllm.nn.PerLayerInputs`); each
block gates it with its hidden state and adds it back (`eqllm.nn.PerLayerGate`).

`attention.kv_shared_layers` (None: none): the last k layers compute no keys or values; each
attends to those of the last earlier layer of its own type (windowed or global), its source,
and holds no cache of its own. `mlp.kv_shared_d_ff` (None: `mlp.d_ff`) is their MLP's hidden
size (Gemma 4's double-wide MLP: 2 x d_ff). The shared layers are stacks of their own (layer
kinds "shared" and "shared_global", `eqllm.config.kinds`).
"""

from __future__ import annotations

import typing
from typing import ClassVar

from eqllm.config.validation import STRICT, Positive, config_error, require, validated


@typing.no_type_check
@validated(STRICT, config_error)
class PerLayerConfig:
    """Per-layer inputs: `d` numbers per token and layer (hidden_size_per_layer_input), from a
    table of `vocab_size` rows (None: the model's vocabulary; vocab_size_per_layer_input)."""

    PATH: ClassVar[str] = "ModelConfig.per_layer"

    d: Positive
    vocab_size: Positive | None = None


def first_shared(config) -> int:
    """The index of the first layer that shares another's keys and values (n_layers: none)."""
    return config.n_layers - (config.attention.kv_shared_layers or 0)


def kv_sources(config) -> dict[int, int]:
    """{shared layer: its source}: the last layer before the first shared one whose type
    (windowed or global, `ModelConfig.local_layers`) is its own."""
    local, first = config.local_layers(), first_shared(config)
    last = {local[j]: j for j in range(first)}  # the last of each type wins
    return {i: last[local[i]] for i in range(first, config.n_layers) if local[i] in last}


def check_sharing(config) -> None:
    """Refuse per-layer inputs or kv-shared layers a model cannot run: per-layer inputs beside
    linear-attention layers or from a table smaller than the vocabulary; shared layers without
    attention in every layer, without a source of their type, or a `mlp.kv_shared_d_ff`
    without shared layers."""
    if (p := config.per_layer) is not None:
        require(
            config.linear is None,
            "ModelConfig.per_layer",
            p,
            "is only defined for attention in every layer (linear must be None)",
        )
        require(
            p.vocab_size is None or p.vocab_size >= config.vocab_size,
            "ModelConfig.per_layer.vocab_size",
            p.vocab_size,
            f"must hold every token id (vocab_size={config.vocab_size}) or be None",
        )
    k = config.attention.kv_shared_layers
    require(
        k is not None or config.mlp.kv_shared_d_ff is None,
        "ModelConfig.mlp.kv_shared_d_ff",
        config.mlp.kv_shared_d_ff,
        "needs attention.kv_shared_layers (it sizes those layers' MLP)",
    )
    if k is None:
        return
    path, n = "ModelConfig.attention.kv_shared_layers", config.n_layers
    require(k < n, path, k, f"must leave a layer that computes keys (n_layers={n})")
    require(
        config.attention.kind == "gqa" and config.linear is None and config.moe is None,
        path,
        k,
        "is only defined for grouped-query attention in every layer, without experts",
    )
    missing = [i for i in range(first_shared(config), n) if i not in kv_sources(config)]
    require(
        not missing,
        path,
        k,
        f"leaves layer {missing[:1]} without an earlier layer of its type (windowed or global)",
    )


def extra_matmul_params(config) -> int:
    """Matmul parameters per token that `ModelConfig.flops_per_token`'s layer formula leaves out:
    the per-layer inputs' projections and the shared layers' wider MLP (their attention, without
    keys and values, is the formula's own)."""
    d, extra = config.d_model, 0
    if (p := config.per_layer) is not None:  # the model's projection, each layer's gate and out
        extra += config.n_layers * p.d * 3 * d
    if (k := config.attention.kv_shared_layers) and config.mlp.kv_shared_d_ff is not None:
        extra += k * 3 * d * (config.mlp.kv_shared_d_ff - config.mlp.d_ff)
    return extra
