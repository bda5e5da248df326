"""Any order of a Gated DeltaNet hybrid's layers (config.json's `layer_types`,
`eqllm/families/_hybrid.py`): read as transformers reads it, written back as it was, refused by
name only where eqllm cannot run it; and an irregular order (tests/families.py's
`qwen3_5-layer_types`: L F L L F F) against transformers both ways, read back bit for bit.

The whole family contract runs over that entry in the slow set (scanned = unrolled, cached
decoding = the full forward, greedy generation = transformers', causality); tests/test_kinds.py
checks the stacked run and cached decoding of an irregular order in the default run."""

import numpy as np
import pytest

import eqllm
from eqllm.config import ConfigError
from tests.families import IRREGULAR, TINY_CONFIGS

transformers = pytest.importorskip("transformers")

L, F = "linear_attention", "full_attention"
# (layer_types, ModelConfig.linear's full_every and pattern eqllm reads them as)
ORDERS = [
    ([L, L, L, F] * 2, 4, None),  # the published groups
    ([L, L, L, F, L, L], 4, None),  # a last group cut short
    ([L, F, L, L, F, F], None, IRREGULAR),  # no repeating group: the whole list
    ([L, F, L, L, F, F, L], None, IRREGULAR),  # the same six layers, then the first again
    ([F, L, L, F, L, L, F, L], None, ("full", "linear", "linear")),  # attention first, cut
    ([L, L, F, L] * 2, None, ("linear", "linear", "full", "linear")),  # attention mid-group
    ([F, F, F], None, ("full",)),  # no linear layer (Qwen3.5's config allows it)
]
# transformers' OLMo hybrid refuses a model without linear layers (refused below too).
CASES = [
    (family, *order)
    for family in ("qwen3_5", "qwen3_next", "olmo_hybrid")
    for order in ORDERS
    if family != "olmo_hybrid" or L in order[0]
]


def _raw(family: str, types: list[str]) -> dict:
    """A config.json of `family`'s tiny entry with `types` as its layers."""
    hf = eqllm.hub.to_hf_config(TINY_CONFIGS[family])
    return {**hf, "num_hidden_layers": len(types), "layer_types": types}


@pytest.mark.parametrize("family, types, every, pattern", CASES)
def test_layer_types_read_as_transformers_reads_them_written_back(family, types, every, pattern):
    raw = _raw(family, types)
    cfg = eqllm.hub.from_hf_config(raw)
    assert (cfg.linear.full_every, cfg.linear.pattern) == (every, pattern)
    theirs = transformers.AutoConfig.for_model(
        raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"}
    )
    assert [f"{k}_attention" for k in cfg.layer_kinds()] == theirs.layer_types == types
    assert eqllm.hub.to_hf_config(cfg)["layer_types"] == types


@pytest.mark.parametrize(
    "family, types, message",
    [
        ("qwen3_5", [L, "sliding_attention"], r"has \['sliding_attention'\].*reads only"),
        ("qwen3_5", [L, L, F], "3 entries for num_hidden_layers=4"),
        ("qwen3_next", [L, L], "no full_attention layer.*mamba2"),
        ("olmo_hybrid", [L, L, L], "no full_attention layer"),
        ("olmo_hybrid", [F, F], "no linear_attention layer.*OLMo hybrid"),
    ],
)
def test_what_cannot_run_is_refused_by_name(family, types, message):
    raw = _raw(family, types)
    if message.startswith("3 entries"):
        raw["num_hidden_layers"] = 4
    with pytest.raises(ConfigError, match=f"layer_types.*{message}"):
        eqllm.hub.from_hf_config(raw)


# The irregular order against its transformers twin: the family contract's checks, by default.


@pytest.fixture(scope="module")
def twin(twins):
    return twins("qwen3_5-layer_types")


def test_irregular_order_imports_with_transformers_logits(twin):
    from tests.test_families import test_import_gives_transformers_logits as check

    assert twin.model.linear_blocks.attn.A_log.shape[0] == 3  # three linear layers
    assert twin.model.blocks.attn.q_proj.weight.shape[0] == 3  # three attention layers
    check(twin)


def test_irregular_order_exports_to_transformers_and_reads_back_bit_for_bit(twin, tmp_path):
    from tests.test_families import test_export_loads_in_transformers_with_the_same_logits as check

    check(twin, tmp_path)


def test_no_linear_layer_runs_as_transformers(tmp_path):
    """Qwen3.5 with attention layers only: the linear group's sizes stay in the config, no
    linear stack is built, and the logits are transformers'."""
    from tests.hf_parity import TOKENS, hf_logits, hf_model, logits

    hf = hf_model(_raw("qwen3_5", [F, F]))
    hf.save_pretrained(tmp_path)
    model = eqllm.hub.from_pretrained(tmp_path)
    assert model.linear_blocks is None
    tokens = TOKENS[:64]  # the tiny entry's context
    np.testing.assert_allclose(logits(model, tokens), hf_logits(hf, tokens), atol=1e-4, rtol=0)
