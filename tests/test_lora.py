"""LoRA adapters: the wrapper's contracts, and the adapters eqllm refuses to read.

PEFT's format both ways against peft itself, on every family, is tests/test_families.py's.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm import lora
from eqllm.lora import LoraError
from eqllm.nn import param_info
from eqllm.nn.params import is_param_info


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


def test_a_copy_of_the_output_layer_peft_keeps_must_be_the_base_models(tmp_path):
    """peft saves the weights of an adapted lm_head with the adapter: eqllm reads the adapter when
    they are the base model's, and refuses it, naming the tensor, when they are not."""
    from safetensors.numpy import load_file, save_file

    model = eqllm.zoo.create("llama-nano", key=jax.random.key(0))
    adapted = lora.apply(model, rank=2, alpha=2, targets=["lm_head"], key=jax.random.key(0))
    eqllm.hub.save_adapter(adapted, tmp_path)
    file = str(tmp_path / "adapter_model.safetensors")
    tensors = load_file(file)
    name = "base_model.model.lm_head.base_layer.weight"
    save_file({**tensors, name: np.asarray(model.lm_head.weight)}, file)
    assert lora.adapters(eqllm.hub.load_adapter(model, tmp_path))
    save_file({**tensors, name: np.asarray(model.lm_head.weight) + 1}, file)
    with pytest.raises(LoraError, match=f"{name} .* is not the base model's lm_head.weight"):
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
