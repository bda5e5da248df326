"""The attention setting: cuDNN's fused kernel on a GPU, the model's own attention elsewhere.

No GPU here, so the fused path is checked with the same arguments and XLA's implementation of
`jax.nn.dot_product_attention`: what a GPU run changes is only `implementation="cudnn"`.
"""

import copy
import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS

import eqllm
from eqllm import attention_backend
from eqllm.config import ConfigError
from eqllm.nn.attention import dot_product_attention
from eqllm.nn.fused_attention import fused_arguments, fused_attention
from eqllm.nn.mask import attention_mask

SEQ = 24


def qkv(heads, kv_heads, batch=(2,), seq=SEQ, head_dim=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (*batch, seq, heads, head_dim))
    k = jax.random.normal(keys[1], (*batch, seq, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (*batch, seq, kv_heads, head_dim))
    return q, k, v


def own(q, k, v, positions, window, local, scale):
    fixed = jnp.arange(q.shape[-3]) if positions is None else positions
    mask = attention_mask(fixed, fixed, window, local)
    out = dot_product_attention(q, k, v, mask, scale=scale)
    return out


def jax_xla(q, k, v, positions, window, local, scale):
    """jax.nn.dot_product_attention with the cuDNN path's own arguments, on XLA."""
    args = fused_arguments(q, k, v, positions, sliding_window=window, local=local, scale=scale)
    return jax.nn.dot_product_attention(**args, implementation="xla").reshape(q.shape)


# (heads, kv_heads, window, local, scale): multi-head, grouped, multi-query; windows on a
# local layer, lifted on a global one, and always on; Gemma's custom scale.
CASES = {
    "gqa": (4, 2, None, None, None),
    "mqa": (4, 1, None, None, None),
    "window": (4, 2, 5, None, None),
    "window_global": (4, 2, 5, False, None),
    "scale": (4, 1, 7, None, 12**-0.5),
}


# By default grouped heads in order; the other cases and layouts in the slow set.
@pytest.mark.parametrize(
    "case", ["gqa", *(pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES) if c != "gqa")]
)
@pytest.mark.parametrize(
    "layout",
    ["in_order", *(pytest.param(x, marks=pytest.mark.slow) for x in ("padded", "one_sequence"))],
)
def test_fused_arguments_give_the_models_attention(case, layout):
    heads, kv_heads, window, local, scale = CASES[case]
    scale = 8**-0.5 if scale is None else scale
    batch = () if layout == "one_sequence" else (2,)
    q, k, v = qkv(heads, kv_heads, batch)
    positions = None
    if layout == "padded":  # row 0 starts at position 100; row 1 has 7 padding slots first
        positions = jnp.stack([jnp.arange(SEQ) + 100, jnp.arange(SEQ) - 7])
    ours = own(q, k, v, positions, window, local, scale)
    if positions is None:  # no padding rows: the raw call matches too
        np.testing.assert_allclose(
            jax_xla(q, k, v, positions, window, local, scale), ours, atol=1e-5
        )
    fused = fused_attention(
        q, k, v, positions, sliding_window=window, local=local, scale=scale, implementation="xla"
    )
    np.testing.assert_allclose(fused, ours, atol=1e-5)


@pytest.mark.parametrize("flag", [True, False])
def test_a_traced_layer_flag_picks_the_windowed_or_the_global_call(flag):
    """Inside the scan over layers the local/global flag is traced: lax.cond between the two."""
    q, k, v = qkv(4, 2)
    run = jax.jit(
        lambda local: fused_attention(
            q, k, v, sliding_window=5, local=local, scale=0.3, implementation="xla"
        )
    )
    np.testing.assert_allclose(run(jnp.asarray(flag)), own(q, k, v, None, 5, flag, 0.3), atol=1e-5)


def with_kernel(model, kernel):
    """The model with its attention layers switched to `kernel` (the same weights)."""
    attn = copy.copy(model.blocks.attn)
    object.__setattr__(attn, "kernel", kernel)
    return eqx.tree_at(lambda m: m.blocks.attn, model, attn)


# One family per attention feature: learned positions and multi-head (gpt2), multi-query with
# biases (qwen2), grouped heads and a window on every layer (mistral), per-layer local/global
# flags, RoPE bases and Gemma's scale (gemma3, scanned and unrolled), QK-norm (qwen3). Gemma 2
# soft-caps its scores, which the fused kernel cannot: it always uses the model's attention.
# The first runs by default, the others in the slow set.
FEATURES = [("gpt2", True), ("qwen2", True), ("mistral", True), ("qwen3", True)]
FEATURES += [("gemma3", True), ("gemma3", False)]
FEATURES = [FEATURES[0], *(pytest.param(*case, marks=pytest.mark.slow) for case in FEATURES[1:])]


@pytest.mark.parametrize("family, scan", FEATURES)
def test_each_attention_feature_gives_the_models_logits_through_the_fused_arguments(family, scan):
    """Whole models: in order (causal skip, window, per-layer flags scanned or unrolled) and
    with explicit, left-padded positions; padding rows are not compared (they are masked)."""
    config = TINY_CONFIGS[family].replace(scan_layers=scan)
    model = eqllm.CausalLM(config, key=jax.random.key(0))
    fused = with_kernel(model, "xla")
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ), 0, 97)
    forward = jax.jit(lambda m, t, p: m(t, p))
    np.testing.assert_allclose(
        forward(fused, tokens, None), forward(model, tokens, None), atol=1e-4
    )
    positions = jnp.stack([jnp.arange(SEQ), jnp.arange(SEQ) - 5])
    real = np.asarray(positions) >= 0
    got, want = forward(fused, tokens, positions), forward(model, tokens, positions)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-4)


def test_gradients_through_the_fused_arguments_equal_the_models():
    model = eqllm.CausalLM(TINY_CONFIGS["gemma3"], key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ), 0, 97)

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(m):
        return jnp.mean(jax.nn.logsumexp(m(tokens), axis=-1))

    for got, want in zip(
        jax.tree.leaves(grads(with_kernel(model, "xla"))),
        jax.tree.leaves(grads(model)),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_on_cpu_auto_is_the_models_own_attention_and_cudnn_an_error():
    cfg = TINY_CONFIGS["llama"].replace(compute_dtype="bfloat16")
    assert eqllm.CausalLM(cfg, key=jax.random.key(0)).blocks.attn.kernel is None
    assert attention_backend.attention_kernel(cfg.replace(attention={"kernel": "xla"})) is None
    with pytest.raises(
        ConfigError, match=r"attention.kernel='cudnn' cannot run here: no NVIDIA GPU"
    ):
        eqllm.CausalLM(cfg.replace(attention={"kernel": "cudnn"}), key=jax.random.key(0))


def test_on_a_gpu_auto_picks_cudnn_where_it_can_run_and_says_why_not_once(monkeypatch, caplog):
    monkeypatch.setattr(attention_backend, "_device", lambda: ("cuda", 256))
    bf16 = TINY_CONFIGS["llama"].replace(compute_dtype="bfloat16")
    assert attention_backend.attention_kernel(bf16) == "cudnn"
    assert attention_backend.attention_kernel(bf16.replace(attention={"kernel": "xla"})) is None
    capped = TINY_CONFIGS["gemma2"].replace(compute_dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="eqllm.attention_backend"):
        assert attention_backend.attention_kernel(capped) is None
        assert attention_backend.attention_kernel(capped) is None
    said = [r.getMessage() for r in caplog.records if "attention.softcap" in r.getMessage()]
    assert len(said) == 1 and "gemma2" in said[0]
    with pytest.raises(ConfigError, match="compute_dtype='float32'"):
        attention_backend.attention_kernel(
            TINY_CONFIGS["llama"].replace(attention={"kernel": "cudnn"})
        )
    odd = bf16.replace(attention={"head_dim": 12, "kernel": "cudnn"})
    with pytest.raises(ConfigError, match="head_dim=12"):
        attention_backend.attention_kernel(odd)


def test_attention_is_an_execution_setting():
    from eqllm.recipe import load_recipe

    model = eqllm.CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(0))
    assert model.with_config(attention={"kernel": "xla"}).config.attention.kernel == "xla"
    recipe = load_recipe("quickstart", ["model.overrides.attention.kernel=xla"])
    assert recipe.model_config().attention.kernel == "xla"
    with pytest.raises(ConfigError, match="must be one of 'auto', 'xla', 'cudnn'"):
        TINY_CONFIGS["llama"].replace(attention={"kernel": "flash"})


def test_the_command_line_says_why_cudnn_cannot_run(capsys):
    from eqllm.cli import main

    argv = ["bench", "llama-nano", "--set", "attention.kernel=cudnn", "--dtype", "bfloat16"]
    assert main([*argv, "--steps", "1", "--warmup", "0", "--quiet", "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eqllm: error: ModelConfig.attention.kernel='cudnn' cannot run here")
    assert "\n" not in err
