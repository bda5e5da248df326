"""Mamba-2: both forms of the SSD scan against a plain NumPy recurrence, the state carried from
prefill into decoding, packed documents, the state dtype, and the whole layer against
transformers' `Mamba2Mixer` on its torch path (chunked, and recurrent with a cache)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqllm.errors import EqllmError
from eqllm.nn import Mamba2, Mamba2State
from eqllm.nn.ssd import ssd_chunked, ssd_recurrent

D_MODEL, HEADS, HEAD_DIM, D_STATE, GROUPS = 12, 4, 6, 8, 2  # inner 24 = 2 x d_model

chunked_jit = jax.jit(ssd_chunked, static_argnames="chunk_size")
recurrent_jit = jax.jit(ssd_recurrent)


def numpy_scan(x, dt, A, B, C, state, reset):
    """S = exp(dt A) S + dt x B^T; y = S C, one token and one head at a time, in float64."""
    heads, group = x.shape[1], x.shape[1] // B.shape[1]
    s = np.array(state, np.float64)
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for h in range(heads):
            b, c = B[t, h // group].astype(np.float64), C[t, h // group].astype(np.float64)
            if reset[t]:
                s[h] = 0.0
            s[h] = np.exp(dt[t, h] * A[h]) * s[h] + dt[t, h] * np.outer(x[t, h], b)
            out[t, h] = s[h] @ c
    return out, s


def scan_inputs(seq, gates, seed=0):
    """Inputs, keys, queries, time steps of the named regime and a state, in fp32."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(seq, HEADS, HEAD_DIM))
    B = rng.normal(size=(seq, GROUPS, D_STATE)) * 0.5
    C = rng.normal(size=(seq, GROUPS, D_STATE)) * 0.5
    A = -rng.uniform(0.5, 4.0, HEADS)
    dt = rng.uniform(0.01, 0.5, (seq, HEADS))
    if gates == "keep_all":  # dt ~ 0: the state neither decays nor takes anything in
        dt = np.full_like(dt, 1e-6)
    elif gates == "forget_all":  # exp(dt A) ~ 0: each token replaces the state
        dt = np.full_like(dt, 20.0)
    elif gates == "slow_decay":  # A ~ 0: a long memory, large writes
        A = np.full_like(A, -1e-5)
        dt = np.full_like(dt, 2.0)
    state = 0.5 * rng.normal(size=(HEADS, HEAD_DIM, D_STATE))
    return tuple(v.astype(np.float32) for v in (x, dt, A, B, C, state))


CASES = [(1, 5), (3, 9), (8, 8), (8, 21), (64, 70)]  # (chunk, seq): multiples and not
GATES = ["random", "keep_all", "forget_all", "slow_decay"]


@pytest.mark.parametrize("gates", GATES)
@pytest.mark.parametrize("chunk,seq", CASES)
def test_both_forms_equal_the_numpy_recurrence(chunk, seq, gates):
    x, dt, A, B, C, state = scan_inputs(seq, gates)
    reset = np.zeros(seq, bool)
    if gates == "random":  # a new document part of the way in
        reset[seq // 2] = True
    expected, expected_state = numpy_scan(x, dt, A, B, C, state, reset)
    scale = max(1.0, float(np.abs(expected).max()))
    for out, final in (
        chunked_jit(x, dt, A, B, C, state, chunk_size=chunk, reset=reset),
        recurrent_jit(x, dt, A, B, C, state, reset=reset),
    ):
        np.testing.assert_allclose(out / scale, expected / scale, atol=2e-5)
        np.testing.assert_allclose(final / scale, expected_state / scale, atol=2e-5)


# The layer tests share these shapes (and a chunk of 16), so `run` compiles each (shape,
# structure) once for the whole file: a batch of two sequences of 40 tokens, prefilled with 35
# (three chunks, the last padded) then decoded.
CHUNK = 16
X = np.random.default_rng(6).normal(size=(2, 40, D_MODEL)).astype(np.float32)
PREFILL = 35


def make_layer(key=0, **flags):
    return Mamba2(
        D_MODEL, HEADS, HEAD_DIM, D_STATE, n_groups=GROUPS, chunk_size=CHUNK, **flags,
        key=jax.random.key(key),
    )  # fmt: skip


@pytest.fixture(scope="module")
def layer():
    """A layer whose biases, skip and norm are not at their initial values."""
    model = make_layer()
    keys = jax.random.split(jax.random.key(1), 4)
    return eqx.tree_at(
        lambda m: (m.conv_bias, m.D, m.norm.weight, m.out_proj.weight),
        model,
        (
            0.3 * jax.random.normal(keys[0], model.conv_bias.shape),
            jax.random.normal(keys[1], (HEADS,)),
            1.0 + 0.1 * jax.random.normal(keys[2], model.norm.weight.shape),
            jax.random.normal(keys[3], model.out_proj.weight.shape) * 0.3,
        ),
    )


@eqx.filter_jit
def run(model, x, state=None, segment_ids=None, form=None):
    return model(x, state, segment_ids, form=form)


def test_prefill_then_decode_equals_one_pass(layer):
    x = jnp.asarray(X)
    full, full_state = run(layer, x)
    out, state = run(layer, x[:, :PREFILL])  # chunked prefill
    outs = [out]
    for t in range(PREFILL, PREFILL + 2):  # one token at a time
        out, state = run(layer, x[:, t : t + 1], state)
        outs.append(out)
    out, state = run(layer, x[:, PREFILL + 2 :], state, form="recurrent")  # a few at once
    outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-5)
    np.testing.assert_allclose(state.ssm, full_state.ssm, atol=1e-5)
    np.testing.assert_allclose(state.conv, full_state.conv, atol=1e-6)
    assert state.conv.shape == (2, 3, HEADS * HEAD_DIM + 2 * GROUPS * D_STATE)
    assert state.ssm.shape == (2, HEADS, HEAD_DIM, D_STATE)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_left_padding_neither_reads_nor_changes_the_state(layer, form):
    """A cached chunk's left padding (`valid` False): the real tokens' outputs and the state
    after them are those without the padding, continuing a state already carried (the
    convolution's past included); a chunk of padding only leaves the state as it is."""
    x = jnp.asarray(X[0])  # (seq, d_model)
    _, state = run(layer, x[:5])  # a state to continue, non-zero
    call = eqx.filter_jit(lambda m, x, s, valid: m(x, s, form=form, valid=valid))
    alone, want = call(layer, x[5:9], state, None)
    padded = jnp.concatenate([jnp.ones((3, D_MODEL)), x[5:9]])
    out, got = call(layer, padded, state, jnp.arange(7) >= 3)
    np.testing.assert_allclose(out[3:], alone, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    _, same = call(layer, padded[:2], state, jnp.zeros(2, bool))
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_packed_documents_equal_each_alone(layer, form):
    x = jax.random.normal(jax.random.key(3), (12, D_MODEL))
    segment_ids = jnp.repeat(jnp.arange(3), 4)  # three documents of 4 tokens
    packed, state = run(layer, x, None, segment_ids, form)
    alone, alone_state = run(layer, x.reshape(3, 4, D_MODEL), None, None, form)
    np.testing.assert_allclose(packed, alone.reshape(12, D_MODEL), atol=1e-5)
    np.testing.assert_allclose(state.ssm, alone_state.ssm[-1], atol=1e-5)
    np.testing.assert_allclose(state.conv, alone_state.conv[-1], atol=1e-6)


def test_state_dtype_is_a_setting():
    layer, half = make_layer(), make_layer(state_dtype="bfloat16")  # the same weights
    assert layer.init_state((3,)).ssm.dtype == jnp.float32
    state = half.init_state((2,))
    assert state.ssm.dtype == jnp.bfloat16
    _, after = run(half, jnp.asarray(X[:, :5]), state)
    assert after.ssm.dtype == jnp.bfloat16  # carried in the dtype it came in
    _, exact = run(layer, jnp.asarray(X[:, :5]))
    np.testing.assert_allclose(after.ssm.astype(jnp.float32), exact.ssm, rtol=1e-2, atol=1e-2)


def test_time_step_limit_clamps_dt():
    clamped = make_layer(dt_min=0.2, dt_max=0.3)
    dt = clamped.time_step(jnp.linspace(-20.0, 20.0, 4 * HEADS).reshape(4, HEADS))
    assert float(dt.min()) == pytest.approx(0.2) and float(dt.max()) == pytest.approx(0.3)


def test_scan_over_stacked_layers_and_gradients():
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *(make_layer(i) for i in (1, 2)))
    params, static = eqx.partition(stacked, eqx.is_array)
    x = jnp.asarray(X)

    def loss(params):
        def body(h, p):
            return h + eqx.combine(p, static)(h)[0], None

        out = jax.lax.scan(body, x, params)[0]
        return jnp.sum(out**2), out

    (_, scanned), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    unrolled = x
    for i in range(2):
        layer_i = eqx.combine(jax.tree.map(lambda a, i=i: a[i], params), static)
        unrolled = unrolled + run(layer_i, unrolled)[0]
    np.testing.assert_allclose(scanned, unrolled, atol=1e-5)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_bad_sizes_are_refused():
    with pytest.raises(EqllmError, match="n_groups=3 must divide n_heads=4"):
        Mamba2(D_MODEL, 4, HEAD_DIM, D_STATE, n_groups=3, key=jax.random.key(0))
    with pytest.raises(EqllmError, match="chunk_size=0 must be at least 1"):
        Mamba2(D_MODEL, 4, HEAD_DIM, D_STATE, chunk_size=0, key=jax.random.key(0))
    assert isinstance(make_layer().init_state(), Mamba2State)


# --- against transformers ----------------------------------------------------------------


def twin():
    """transformers' Mamba2Mixer with random weights, its config, and eqllm's layer holding the
    same weights (in_proj split into z, x, B, C, dt)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    config = transformers.Mamba2Config(
        hidden_size=D_MODEL, num_heads=HEADS, head_dim=HEAD_DIM, expand=2,
        state_size=D_STATE, n_groups=GROUPS, chunk_size=CHUNK, num_hidden_layers=1,
        time_step_limit=(0.0, float("inf")),
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = Mamba2Mixer(config, 0).float().eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        theirs.norm.weight.add_(1.0)
    inner, bc = HEADS * HEAD_DIM, GROUPS * D_STATE
    parts = np.split(
        theirs.in_proj.weight.detach().numpy(), np.cumsum([inner, inner, bc, bc])
    )  # z, x, B, C, dt
    ours = make_layer()
    ours = eqx.tree_at(
        lambda m: (
            *(getattr(m, f"{n}_proj").weight for n in ("z", "x", "B", "C", "dt")),
            m.out_proj.weight, m.conv_weight, m.conv_bias, m.A_log, m.dt_bias, m.D, m.norm.weight,
        ),
        ours,
        tuple(
            jnp.asarray(t if isinstance(t, np.ndarray) else t.detach().numpy())
            for t in (
                *parts, theirs.out_proj.weight, theirs.conv1d.weight[:, 0, :], theirs.conv1d.bias,
                theirs.A_log, theirs.dt_bias, theirs.D, theirs.norm.weight,
            )
        ),
    )  # fmt: skip
    return torch, config, theirs, ours


def test_layer_equals_transformers_chunked_and_recurrent():
    torch, config, theirs, ours = twin()
    from transformers import DynamicCache

    with torch.no_grad():  # no cache: the chunked path (chunks of 16, the last padded)
        expected = theirs(torch.from_numpy(X)).numpy()
    got, _ = run(ours, jnp.asarray(X))
    np.testing.assert_allclose(got, expected, atol=1e-5)

    # With a cache: a chunked prefill, then the recurrent path one token at a time.
    cache = DynamicCache(config=config)
    with torch.no_grad():
        expected = [theirs(torch.from_numpy(X[:, :PREFILL]), cache=cache).numpy()]
        for t in range(PREFILL, X.shape[1]):
            expected.append(theirs(torch.from_numpy(X[:, t : t + 1]), cache=cache).numpy())
    out, state = run(ours, jnp.asarray(X[:, :PREFILL]))
    got = [out]
    for t in range(PREFILL, X.shape[1]):
        out, state = run(ours, jnp.asarray(X[:, t : t + 1]), state)
        got.append(out)
    np.testing.assert_allclose(np.concatenate(got, 1), np.concatenate(expected, 1), atol=1e-5)
    layer_cache = cache.layers[0]
    np.testing.assert_allclose(state.ssm, layer_cache.recurrent_states[0].numpy(), atol=1e-5)
    conv = layer_cache.conv_states[0].numpy()[:, :, 1:].transpose(0, 2, 1)
    np.testing.assert_allclose(state.conv, conv, atol=1e-6)
