"""SmolLM3 (Hugging Face, 2025, "SmolLM3: smol, multilingual, long-context reasoner"): the Llama
block with grouped-query attention and tied embeddings, where every fourth layer has no rotary
embedding (NoPE: its attention sees no positions; Yang et al., 2025, "Rope to Nope and back
again"). Those layers are `positions.nope_every`, a per-layer flag in the scanned stack."""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    LLAMA_TABLE,
    Family,
    attention_bias_from_hf,
    full_attention_only,
    llama_from_hf,
    llama_to_hf,
    one_attention_bias,
    refuse,
    token_ids,
)

_INTERVAL = 4  # SmolLM3Config's no_rope_layer_interval
_TOKEN_IDS = {"bos_token_id": 128000, "eos_token_id": 128001, "pad_token_id": 128004}  # its too


def nope_every(no_rope_layers: list[int]) -> int | None:
    """The `positions.nope_every` whose pattern is config.json's `no_rope_layers` (1: the layer
    rotates, 0: NoPE); None when every layer rotates. Any other pattern is refused."""
    zeros = [i for i, use_rope in enumerate(no_rope_layers) if not use_rope]
    every = zeros[0] + 1 if zeros else None
    expected = [int(every is None or (i + 1) % every != 0) for i in range(len(no_rope_layers))]
    if [int(bool(v)) for v in no_rope_layers] != expected:
        raise ConfigError(
            f"config.json no_rope_layers={no_rope_layers} is not supported; eqllm handles NoPE "
            "on every k-th layer (positions.nope_every), as no_rope_layer_interval builds it"
        )
    return every


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    every = cfg.positions.nope_every
    return {
        **token_ids(cfg, _TOKEN_IDS),
        **llama_to_hf(cfg),
        "hidden_act": "silu",
        "attention_bias": cfg.attention.qkv_bias,
        "mlp_bias": cfg.mlp.bias,
        "no_rope_layers": [int(r) for r in cfg.rotary_layers()],
        # Only read when no_rope_layers is absent; a model without NoPE layers writes the
        # default, which the list above overrides.
        "no_rope_layer_interval": every or _INTERVAL,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * cfg.n_layers,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    # transformers' SmolLM3 slides the window over the NoPE layers when use_sliding_window is
    # set (layer_types "sliding_attention" there); eqllm reads the published full attention.
    refuse(hf, "use_sliding_window", (False,))
    full_attention_only(hf, "SmolLM3")
    n_layers = hf.get("num_hidden_layers")
    layers = hf.get("no_rope_layers")
    if layers is None:  # as SmolLM3Config builds it
        interval = hf.get("no_rope_layer_interval") or _INTERVAL
        layers = [int((i + 1) % interval != 0) for i in range(n_layers or 0)]
    elif n_layers is not None and len(layers) < n_layers:
        raise ConfigError(
            f"config.json no_rope_layers has {len(layers)} entries for num_hidden_layers="
            f"{n_layers}; it needs one per layer"
        )
    return {
        **llama_from_hf(hf),
        **attention_bias_from_hf(hf),
        "mlp.bias": bool(hf.get("mlp_bias", False)),
        "positions.nope_every": nope_every(list(layers[:n_layers])),
        "tie_embeddings": bool(hf["tie_word_embeddings"]),
    }


FAMILY = Family(
    name="smollm3",
    released="2025-07",
    architecture="SmolLM3ForCausalLM",
    model_type="smollm3",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k != "positions.nope_every"},
        "attention.sliding_window": None,
    },
    table=LLAMA_TABLE,
    prefix=LLAMA_PREFIX,
    # sliding_window is only read with use_sliding_window (refused); max_window_layers is
    # Qwen2's setting, which the published files carry and transformers' SmolLM3 never reads;
    # pretraining_tp only splits Llama's matmuls, with the same result.
    hf_keys=LLAMA_KEYS
    | {
        "attention_bias",
        "mlp_bias",
        "no_rope_layers",
        "no_rope_layer_interval",
        "use_sliding_window",
        "sliding_window",
        "layer_types",
        "max_window_layers",
        "pretraining_tp",
    },
    to_hf=to_hf,
    from_hf=from_hf,
    check=one_attention_bias,
    # SmolLM3Config's defaults, which a config.json may leave out.
    defaults={"rope_theta": 2_000_000.0, "tie_word_embeddings": True},
)
