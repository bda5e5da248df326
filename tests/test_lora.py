"""LoRA adapters: the wrapper's contracts, and PEFT's format both ways against peft itself.

Adapters are tested with non-zero B everywhere: a broken export still "loads" in peft with B at
zero (peft only warns about missing keys), so only the logits tell.
"""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm import lora
from eqllm.lora import LoraError
from eqllm.nn import param_info
from eqllm.nn.linear import is_param_info
from tests.hf_parity import hf_logits, hf_model, logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 97
TOKENS = np.random.default_rng(0).integers(0, VOCAB, 200)
LLAMA = dict(
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=256,
)
GPT2 = dict(model_type="gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256)
ALL_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def base(request, tmp_path_factory):
    """(family, HF base folder, eqllm base model)."""
    folder = tmp_path_factory.mktemp(f"base-{request.param}")
    hf_model(LLAMA if request.param == "llama" else GPT2).save_pretrained(folder)
    return request.param, folder, eqllm.hub.from_pretrained(folder)


def _fresh_hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_adapter_made_with_peft_loads_with_peft_logits(base, tmp_path):
    family, folder, _ = base
    targets = ALL_LLAMA if family == "llama" else ["c_attn", "c_proj", "c_fc"]
    config = peft.LoraConfig(
        r=4,
        lora_alpha=12,
        target_modules=targets,
        init_lora_weights=False,  # random, non-zero B
        rank_pattern={targets[-1]: 2},
        alpha_pattern={targets[-1]: 3},
        fan_in_fan_out=family == "gpt2",
        use_rslora=family == "llama",  # scale alpha / sqrt(r)
    )
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(_fresh_hf(folder), config).eval()
    peft_model.save_pretrained(tmp_path)
    model = eqllm.hub.from_pretrained(folder, adapter=tmp_path)
    assert len(lora.adapters(model)) > 0
    expected = hf_logits(peft_model, TOKENS)
    np.testing.assert_allclose(logits(model, TOKENS), expected, atol=1e-4, rtol=0)


def test_adapter_saved_by_eqllm_loads_in_peft_and_merges(base, tmp_path):
    family, folder, model = base
    targets = ALL_LLAMA if family == "llama" else ["c_attn", "c_proj", "c_fc"]
    adapted = lora.apply(model, rank=3, alpha=6, targets=targets, key=jax.random.key(0))
    # Train-like: every B non-zero, and for GPT-2 q, k, v with different A (rank 3 x 3 export).
    leaves, treedef = jax.tree.flatten(adapted)
    keys = iter(jax.random.split(jax.random.key(1), len(leaves)))
    mask = jax.tree.leaves(lora.trainable(adapted))
    leaves = [
        x + 0.05 * jax.random.normal(next(keys), x.shape) if m else x
        for x, m in zip(leaves, mask, strict=True)
    ]
    adapted = jax.tree.unflatten(treedef, leaves)
    ours = logits(adapted, TOKENS)
    assert np.abs(ours - logits(model, TOKENS)).max() > 1e-3  # the adapters change the function

    eqllm.hub.save_adapter(adapted, tmp_path / "adapter")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = peft.PeftModel.from_pretrained(_fresh_hf(folder), tmp_path / "adapter")
    key_warnings = [str(w.message) for w in caught if "keys" in str(w.message).lower()]
    assert not key_warnings  # peft warns about missing or unexpected keys
    np.testing.assert_allclose(hf_logits(peft_model.eval(), TOKENS), ours, atol=1e-4, rtol=0)

    merged = lora.merge(adapted)
    assert not lora.adapters(merged)
    np.testing.assert_allclose(logits(merged, TOKENS), ours, atol=1e-4, rtol=0)
    eqllm.hub.save_pretrained(merged, tmp_path / "merged")
    np.testing.assert_allclose(
        hf_logits(_fresh_hf(tmp_path / "merged"), TOKENS), ours, atol=1e-4, rtol=0
    )
    # And back: eqllm reads its own export to the same function.
    again = eqllm.hub.from_pretrained(folder, adapter=tmp_path / "adapter")
    np.testing.assert_allclose(logits(again, TOKENS), ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scan", [True, False])
def test_fresh_adapters_change_nothing_and_carry_axes(scan):
    model = eqllm.zoo.create("llama-nano", key=jax.random.key(0)).with_config(scan_layers=scan)
    adapted = lora.apply(
        model, rank=4, alpha=8, targets=["q_proj", "down_proj"], key=jax.random.key(1)
    )
    tokens = jnp.arange(16)
    np.testing.assert_array_equal(adapted(tokens), model(tokens))  # B = 0
    wrapped = adapted.blocks.attn.q_proj
    assert wrapped.lora_a.weight.shape == (4, 4, 128)  # [layers, rank, in]
    assert wrapped.lora_b.weight.shape == (4, 128, 4)  # [layers, out, rank]
    assert not np.any(wrapped.lora_b.weight)
    info = param_info(adapted).blocks.attn.q_proj
    assert info.base.weight.axes == (None, "heads", "d_model")  # the base keeps its axes
    assert info.lora_a.weight.axes == (None, None, "d_model")
    assert info.lora_b.weight.axes == (None, "heads", None)
    mask = lora.trainable(adapted)
    n = sum(
        x.size for x, m in zip(jax.tree.leaves(adapted), jax.tree.leaves(mask), strict=True) if m
    )
    assert n == 4 * 4 * (128 + 128) + 4 * 4 * (384 + 128)
    assert all(
        jax.tree.leaves(
            jax.tree.map(lambda i: i is not None, param_info(adapted), is_leaf=is_param_info)
        )
    )


def test_bad_settings_are_named():
    model = eqllm.zoo.create("llama-nano", key=jax.random.key(0))
    with pytest.raises(LoraError, match=r"\['qproj'\].*available: q_proj, k_proj"):
        lora.apply(model, rank=4, alpha=8, targets=["qproj"], key=jax.random.key(0))
    with pytest.raises(LoraError, match="rank=0 must be a positive integer"):
        lora.apply(model, rank=0, alpha=8, targets=["q_proj"], key=jax.random.key(0))


def test_adapter_for_another_base_names_the_shapes(tmp_path):
    big = eqllm.zoo.create("llama-nano", key=jax.random.key(0))
    adapted = lora.apply(big, rank=2, alpha=2, targets=["q_proj"], key=jax.random.key(0))
    eqllm.hub.save_adapter(adapted, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["target_modules"] == ["q_proj"]
    small = eqllm.zoo.create(
        "llama-nano", d_model=64, attention={"n_heads": 2}, key=jax.random.key(0)
    )
    with pytest.raises(
        LoraError,
        match=r"q_proj: lora_A \[2, 128\] and lora_B \[128, 2\] do not fit the base weight "
        r"\[64, 64\]",
    ):
        eqllm.hub.load_adapter(small, tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save=\\['lm_head'\\] is not supported"),
        ({"peft_type": "IA3"}, "peft_type='IA3'; eqllm reads only 'LORA'"),
    ],
)
def test_adapters_eqllm_cannot_read_are_refused(tmp_path, change, message):
    model = eqllm.zoo.create("llama-nano", key=jax.random.key(0))
    adapted = lora.apply(model, rank=2, alpha=2, targets=["q_proj"], key=jax.random.key(0))
    eqllm.hub.save_adapter(adapted, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(LoraError, match=message):
        eqllm.hub.load_adapter(model, tmp_path)


def test_adapter_on_some_layers_only_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    model = eqllm.zoo.create("llama-nano", key=jax.random.key(0))
    adapted = lora.apply(model, rank=2, alpha=2, targets=["q_proj"], key=jax.random.key(0))
    eqllm.hub.save_adapter(adapted, tmp_path)
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    kept = {k: v for k, v in tensors.items() if ".layers.1." not in k}
    save_file(kept, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="adapter covers only some layers"):
        eqllm.hub.load_adapter(model, tmp_path)
