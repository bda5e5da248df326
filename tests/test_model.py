"""CausalLM on tiny models: batches, windows, GQA, attention, remat, training, per-layer patterns,
soft-capping, norm placement and the new switches' validation.

What every family must meet (transformers' logits, causality, scanned == unrolled, cached
decoding) is tests/test_families.py's, over the one list in tests/families.py.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqllm
from tests.families import TINY_CONFIGS, params

SEQ = 24


@eqx.filter_jit
def forward(model, tokens):
    return model(tokens)


def random_tokens(seed, n=SEQ, vocab=97):
    return jax.random.randint(jax.random.key(seed), (n,), 0, vocab)


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@pytest.mark.parametrize("family", params({"gemma"}))
def test_batch_call_equals_vmap_and_one_by_one(family):
    model = eqllm.CausalLM(TINY_CONFIGS[family], key=jax.random.key(0))
    tokens = jnp.stack([random_tokens(1), random_tokens(2)])
    batched = forward(model, tokens)
    assert batched.shape == (2, SEQ, 97) and batched.dtype == jnp.float32
    np.testing.assert_allclose(batched[1], forward(model, tokens[1]), atol=1e-5)
    np.testing.assert_allclose(batched, eqx.filter_jit(jax.vmap(model))(tokens), atol=1e-5)


def test_sliding_window_limits_influence():
    """With window w, the logit at position i depends only on tokens i-w+1..i (per layer).

    Two layers widen the receptive field to 2(w-1) positions back; a token further back has no
    influence at all, while one inside the window does.
    """
    cfg = TINY_CONFIGS["mistral"]
    w = cfg.attention.sliding_window
    model = eqllm.CausalLM(cfg, key=jax.random.key(1))
    tokens = random_tokens(4)
    i = SEQ - 1
    far = i - cfg.n_layers * (w - 1) - 1
    near = i - (w - 1)
    base = forward(model, tokens)[i]
    far_changed = forward(model, tokens.at[far].set((tokens[far] + 1) % 97))[i]
    near_changed = forward(model, tokens.at[near].set((tokens[near] + 1) % 97))[i]
    np.testing.assert_array_equal(base, far_changed)
    assert not np.allclose(base, near_changed)
    full = eqllm.CausalLM(cfg.replace(attention={"sliding_window": None}), key=jax.random.key(1))
    assert not np.allclose(base, forward(full, tokens.at[far].set((tokens[far] + 1) % 97))[i])


def test_gqa_equals_multi_head_with_repeated_kv_heads():
    """GQA == multi-head attention whose k/v heads are copies of the shared ones."""
    gqa_cfg = TINY_CONFIGS["llama"]  # 4 query heads, 2 kv heads
    gqa = eqllm.CausalLM(gqa_cfg, key=jax.random.key(2))
    mha_cfg = gqa_cfg.replace(attention={"n_kv_heads": gqa_cfg.attention.n_heads})
    mha = eqllm.CausalLM(mha_cfg, key=jax.random.key(3))
    group = gqa_cfg.attention.n_heads // gqa_cfg.attention.n_kv_heads
    hd = gqa_cfg.head_dim

    def repeat(w):  # (layers, kv_heads * hd, d) -> (layers, heads * hd, d)
        layers, _, d = w.shape
        w = w.reshape(layers, gqa_cfg.attention.n_kv_heads, 1, hd, d)
        return jnp.broadcast_to(w, (layers, gqa_cfg.attention.n_kv_heads, group, hd, d)).reshape(
            layers, -1, d
        )

    attn = gqa.blocks.attn
    mha = eqx.tree_at(lambda m: m.blocks.attn.k_proj.weight, mha, repeat(attn.k_proj.weight))
    mha = eqx.tree_at(lambda m: m.blocks.attn.v_proj.weight, mha, repeat(attn.v_proj.weight))
    for path in (
        lambda m: m.embed,
        lambda m: m.lm_head,
        lambda m: m.final_norm,
        lambda m: m.blocks.attn.q_proj,
        lambda m: m.blocks.attn.o_proj,
        lambda m: m.blocks.mlp,
        lambda m: m.blocks.attn_norm,
        lambda m: m.blocks.mlp_norm,
    ):
        mha = eqx.tree_at(path, mha, path(gqa))
    tokens = random_tokens(6)
    np.testing.assert_allclose(forward(gqa, tokens), forward(mha, tokens), atol=1e-5)


def test_attention_equals_jax_reference():
    """Our masked attention == jax.nn.dot_product_attention (causal) for multi-head."""
    q, k, v = (jax.random.normal(jax.random.key(i), (SEQ, 4, 8)) for i in range(3))
    pos = jnp.arange(SEQ)
    ours = eqllm.nn.dot_product_attention(q, k, v, eqllm.nn.attention_mask(pos, pos))
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_remat_gives_same_loss_and_gradients():
    cfg = TINY_CONFIGS["llama"]
    model = eqllm.CausalLM(cfg, key=jax.random.key(4))
    tokens = jnp.stack([random_tokens(7, SEQ + 1), random_tokens(8, SEQ + 1)])
    grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))
    loss, grads = grad_fn(model, tokens)
    for policy in ("full", "dots", "offload"):
        remat = model.with_config(remat=policy)
        loss_r, grads_r = grad_fn(remat, tokens)
        np.testing.assert_allclose(loss, loss_r, rtol=1e-6)
        for g, g_r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r), strict=True):
            np.testing.assert_allclose(g, g_r, atol=1e-6)


def test_remat_saves_memory_with_an_unrolled_layer_loop_too():
    """remat runs the layers as a scan whatever scan_layers says: unrolled, XLA would schedule
    the recomputation early and keep every activation alive anyway."""
    cfg = TINY_CONFIGS["llama"].replace(n_layers=4, scan_layers=False)
    model = eqllm.CausalLM(cfg, key=jax.random.key(4))
    tokens = jax.random.randint(jax.random.key(5), (16, SEQ + 1), 0, 97)
    grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))

    def temp_bytes(m):
        return grad_fn.lower(m, tokens).compile().compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(model.with_config(remat="full")) < 0.7 * temp_bytes(model)


def test_initial_loss_is_near_uniform():
    """Small init: the first loss is within 0.1 nats of log(vocab)."""
    model = eqllm.CausalLM(TINY_CONFIGS["gpt2"], key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, SEQ + 1), 0, 97)
    assert abs(float(loss_fn(model, tokens)) - np.log(97)) < 0.1


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_overfits_one_batch(family):
    """AdamW on one fixed batch drives the loss from ~log(97)=4.57 below 0.5 in 150 steps."""
    model = eqllm.CausalLM(TINY_CONFIGS[family], key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 97)
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    for _ in range(150):
        model, opt_state, loss = step(model, opt_state)
    assert float(loss) < 0.5


def test_with_config_refuses_architecture_changes():
    model = eqllm.CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(0))
    with pytest.raises(ValueError, match="n_layers"):
        model.with_config(n_layers=3)


def test_bad_inputs_raise_clear_errors():
    model = eqllm.CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(0))
    with pytest.raises(TypeError, match="tokens"):
        model(jnp.zeros((2, 2, 8), jnp.int32))  # neither a sequence nor a batch
    with pytest.raises(TypeError, match="tokens"):
        model(jnp.zeros((8,), jnp.float32))
    with pytest.raises(ValueError, match="longer than the context max_seq_len=64"):
        model(jnp.zeros((65,), jnp.int32))
    # Concrete ids are checked on the host (inside jit the caller checks: train step, generate).
    with pytest.raises(eqllm.errors.EqllmError, match=r"token id out of range: ids in \[38, 97\]"):
        model(jnp.arange(60) + 38)
    with pytest.raises(eqllm.errors.EqllmError, match="vocab_size=97"):
        model(jnp.full((SEQ,), -1, jnp.int32))


# Per-layer patterns, soft-capping, norms after the sublayers ----------------------------------


def test_local_and_global_layers_are_one_scanned_stack():
    """Gemma 2's alternation is data scanned with the weights: one scan, any depth."""
    cfg = TINY_CONFIGS["gemma2"].replace(n_layers=6)
    shapes = eqx.filter_eval_shape(eqllm.CausalLM, cfg, key=jax.random.key(0))
    jaxpr = jax.make_jaxpr(lambda m, t: m(t))(shapes, random_tokens(0))
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 6
    assert cfg.local_layers() == (True, False) * 3


def test_a_global_layer_sees_past_the_window():
    """Beyond the receptive field of windowed layers, only the global layers carry a token."""
    cfg = TINY_CONFIGS["gemma2"]
    w = cfg.attention.sliding_window
    model = eqllm.CausalLM(cfg, key=jax.random.key(1))
    tokens = random_tokens(4)
    i, far = SEQ - 1, SEQ - 1 - cfg.n_layers * (w - 1) - 1
    changed = tokens.at[far].set((tokens[far] + 1) % 97)
    assert not np.allclose(forward(model, tokens)[i], forward(model, changed)[i])
    windowed = eqllm.CausalLM(cfg.replace(attention={"global_every": None}), key=jax.random.key(1))
    np.testing.assert_array_equal(forward(windowed, tokens)[i], forward(windowed, changed)[i])


def test_unrolled_layers_with_known_flags_equal_the_scan():
    """Unrolled, each layer's flag is a Python bool and windowed layers skip key blocks."""
    cfg = TINY_CONFIGS["gemma2"].replace(max_seq_len=160)
    model = eqllm.CausalLM(cfg, key=jax.random.key(2))
    tokens = random_tokens(9, n=160)
    unrolled = model.with_config(scan_layers=False)
    np.testing.assert_allclose(forward(model, tokens), forward(unrolled, tokens), atol=1e-5)


def test_local_flag_selects_the_window_and_the_rope_base():
    x = jax.random.normal(jax.random.key(0), (SEQ, 32))
    Rope = eqllm.nn.RotaryEmbedding

    def attention(rope, window):  # the same weights each time
        return eqllm.nn.Attention(
            32, 4, n_kv_heads=2, rope=rope, sliding_window=window, key=jax.random.key(1)
        )

    both = attention(Rope(8, 1e6, local_theta=1e4), 4)
    np.testing.assert_allclose(both(x, None, jnp.bool_(True)), attention(Rope(8, 1e4), 4)(x))
    np.testing.assert_allclose(both(x, None, jnp.bool_(False)), attention(Rope(8, 1e6), None)(x))


def test_soft_capping_bounds_the_logits():
    cfg = TINY_CONFIGS["gemma2"]
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    hidden = 100 * jax.random.normal(jax.random.key(1), (SEQ, cfg.d_model))
    raw = model.embed.attend(hidden)
    assert float(jnp.abs(raw).max()) > 10 * cfg.final_softcap
    np.testing.assert_allclose(
        model.logits(hidden), cfg.final_softcap * jnp.tanh(raw / cfg.final_softcap), rtol=1e-6
    )


def test_norm_placement_switches_the_block_layout():
    shapes = {
        name: eqx.filter_eval_shape(eqllm.CausalLM, TINY_CONFIGS[name], key=jax.random.key(0))
        for name in ("llama", "gemma2", "olmo2")
    }
    present = {
        name: tuple(getattr(m.blocks, f) is not None for f in ("attn_norm", "attn_post_norm"))
        for name, m in shapes.items()
    }
    assert present == {"llama": (True, False), "gemma2": (True, True), "olmo2": (False, True)}
    olmo = shapes["olmo2"].blocks.attn  # QK-norm over the whole projections
    assert olmo.q_norm.weight.shape == (2, 4 * 8) and olmo.k_norm.weight.shape == (2, 2 * 8)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"attention.global_every": 2, "attention.sliding_window": None},
            "ModelConfig.attention.global_every=2 needs a sliding_window",
        ),
        (
            {"positions.local_theta": 1e4},
            "ModelConfig.positions.local_theta=10000.0 needs attention.global_every",
        ),
        ({"positions.fraction": 0.2}, "ModelConfig.positions.fraction=0.2 must rotate an even"),
        (
            {"positions.kind": "learned", "positions.fraction": 0.5},
            "ModelConfig.positions.fraction=0.5 needs kind='rope'",
        ),
        ({"attention.softcap": 0.0}, "ModelConfig.attention.softcap=0.0 must be positive"),
    ],
)
def test_new_switches_are_validated(change, message):
    with pytest.raises(eqllm.ConfigError, match=message):
        TINY_CONFIGS["llama"].replace(**change)
