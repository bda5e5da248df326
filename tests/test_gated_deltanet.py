"""Gated DeltaNet: both forms of the delta rule against a plain NumPy recurrence, the state
carried from prefill into decoding, packed documents, and the whole layer against transformers'
`Qwen3NextGatedDeltaNet` on its chunked and its recurrent path."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqllm.errors import EqllmError
from eqllm.nn import GatedDeltaNet, GatedDeltaNetState
from eqllm.nn.gated_deltanet import chunked, recurrent

D_MODEL, KEY_HEADS, HEADS, D_K, D_V = 16, 2, 4, 8, 6

chunked_jit = jax.jit(chunked, static_argnames="chunk_size")
recurrent_jit = jax.jit(recurrent)


def numpy_rule(q, k, v, g, beta, state, reset):
    """The gated delta rule one token and one head at a time, in float64."""
    heads, group = v.shape[1], v.shape[1] // k.shape[1]
    s = np.array(state, np.float64)
    out = np.zeros(v.shape, np.float64)
    for t in range(v.shape[0]):
        for h in range(heads):
            q_t, k_t = q[t, h // group].astype(np.float64), k[t, h // group].astype(np.float64)
            if reset[t]:
                s[h] = 0.0
            s[h] *= np.exp(g[t, h])
            s[h] += beta[t, h] * np.outer(k_t, v[t, h] - k_t @ s[h])
            out[t, h] = q_t @ s[h]
    return out, s


def rule_inputs(seq, gates, seed=0):
    """Normalised q (scaled) and k, values, and gates of the named regime, in fp32."""
    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.normal(size=shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit((seq, KEY_HEADS, D_K)) * D_K**-0.5
    k = unit((seq, KEY_HEADS, D_K))
    v = rng.normal(size=(seq, HEADS, D_V))
    g = -rng.uniform(0.0, 1.0, (seq, HEADS))
    beta = rng.uniform(0.0, 1.0, (seq, HEADS))
    if gates == "write_nothing":  # beta ~ 0
        beta = np.full_like(beta, 1e-6)
    elif gates == "overwrite":  # beta ~ 1
        beta = np.full_like(beta, 1.0 - 1e-6)
    elif gates == "keep_all":  # decay ~ 1: g ~ 0
        g = np.full_like(g, -1e-6)
    elif gates == "forget_all":  # decay ~ 0: g very negative
        g = np.full_like(g, -30.0)
    state = 0.5 * rng.normal(size=(HEADS, D_K, D_V))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta, state))


CASES = [(1, 5), (3, 9), (8, 8), (8, 21), (64, 70)]  # (chunk, seq): multiples and not
GATES = ["random", "write_nothing", "overwrite", "keep_all", "forget_all"]


@pytest.mark.parametrize("gates", GATES)
@pytest.mark.parametrize("chunk,seq", CASES)
def test_both_forms_equal_the_numpy_recurrence(chunk, seq, gates):
    q, k, v, g, beta, state = rule_inputs(seq, gates)
    # A reset (new document) part of the way in, except in the plainest case.
    reset = np.zeros(seq, bool)
    if gates == "random":
        reset[seq // 2] = True
    expected, expected_state = numpy_rule(q, k, v, g, beta, state, reset)
    for out, final in (
        chunked_jit(q, k, v, g, beta, state, chunk_size=chunk, reset=reset),
        recurrent_jit(q, k, v, g, beta, state, reset=reset),
    ):
        np.testing.assert_allclose(out, expected, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(final, expected_state, atol=2e-5, rtol=1e-5)


# The layer tests share these shapes (and the default chunk of 64), so `run` compiles each
# (shape, structure) once for the whole file: a batch of two sequences of 74 tokens, prefilled
# with 70 (two chunks, the last padded) then decoded.
X = np.random.default_rng(6).normal(size=(2, 74, D_MODEL)).astype(np.float32)
PREFILL = 70


@pytest.fixture(scope="module")
def layer():
    """A layer whose gates and norm are not at their initial values."""
    model = GatedDeltaNet(D_MODEL, KEY_HEADS, HEADS, D_K, D_V, key=jax.random.key(0))
    keys = jax.random.split(jax.random.key(1), 3)
    return eqx.tree_at(
        lambda m: (m.dt_bias, m.norm.weight, m.out_proj.weight),
        model,
        (
            jax.random.normal(keys[0], (HEADS,)),
            1.0 + 0.1 * jax.random.normal(keys[1], (D_V,)),
            jax.random.normal(keys[2], model.out_proj.weight.shape) * 0.3,
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
    np.testing.assert_allclose(state.recurrent, full_state.recurrent, atol=1e-5)
    np.testing.assert_allclose(state.conv, full_state.conv, atol=1e-6)
    assert state.conv.shape == (2, 3, 2 * KEY_HEADS * D_K + HEADS * D_V)
    assert state.recurrent.shape == (2, HEADS, D_K, D_V)


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
    valid = jnp.arange(7) >= 3
    out, got = call(layer, padded, state, valid)
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
    # The returned state continues the last document.
    np.testing.assert_allclose(state.recurrent, alone_state.recurrent[-1], atol=1e-5)
    np.testing.assert_allclose(state.conv, alone_state.conv[-1], atol=1e-6)


def test_scan_over_stacked_layers_and_gradients():
    layers = [
        GatedDeltaNet(D_MODEL, KEY_HEADS, HEADS, D_K, D_V, key=jax.random.key(i)) for i in (1, 2)
    ]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)  # a leading `layers` axis
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
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert all(float(jnp.abs(g).max()) > 0 for g in leaves)


def test_bad_sizes_are_refused():
    with pytest.raises(EqllmError, match="n_key_heads=3 must divide n_value_heads=4"):
        GatedDeltaNet(D_MODEL, 3, 4, D_K, D_V, key=jax.random.key(0))
    with pytest.raises(EqllmError, match="chunk_size=0 must be at least 1"):
        GatedDeltaNet(D_MODEL, KEY_HEADS, HEADS, D_K, D_V, chunk_size=0, key=jax.random.key(0))


def test_state_is_a_module_of_its_arrays(layer):
    state = layer.init_state((3,))
    assert isinstance(state, GatedDeltaNetState)
    assert state.recurrent.dtype == jnp.float32 and state.recurrent.shape == (3, HEADS, D_K, D_V)


# --- against transformers ----------------------------------------------------------------

SIZES = dict(
    hidden_size=D_MODEL,
    linear_num_key_heads=KEY_HEADS,
    linear_num_value_heads=HEADS,
    linear_key_head_dim=D_K,
    linear_value_head_dim=D_V,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
)


def split_qwen3_next(theirs) -> dict:
    """Qwen3-Next fuses q, k, v, z into `in_proj_qkvz` and b, a into `in_proj_ba`, interleaved
    per key head: [q (d_k), k (d_k), v (group * d_v), z (group * d_v)] rows, then [b, a]."""
    group = HEADS // KEY_HEADS
    qkvz = theirs.in_proj_qkvz.weight.detach().numpy().reshape(KEY_HEADS, -1, D_MODEL)
    q, k, v, z = np.split(qkvz, np.cumsum([D_K, D_K, group * D_V]), axis=1)
    ba = theirs.in_proj_ba.weight.detach().numpy().reshape(KEY_HEADS, 2 * group, D_MODEL)
    b, a = np.split(ba, [group], axis=1)
    return dict(zip("qkvzba", (w.reshape(-1, D_MODEL) for w in (q, k, v, z, b, a)), strict=True))


def split_qwen3_5(theirs) -> dict:
    """Qwen3.5 stacks q, k, v in `in_proj_qkv` (all heads of each in turn)."""
    qkv = theirs.in_proj_qkv.weight.detach().numpy()
    q, k, v = np.split(qkv, [KEY_HEADS * D_K, 2 * KEY_HEADS * D_K])
    named = dict(z=theirs.in_proj_z, b=theirs.in_proj_b, a=theirs.in_proj_a)
    return dict(q=q, k=k, v=v, **{n: m.weight.detach().numpy() for n, m in named.items()})


def split_olmo_hybrid(theirs) -> dict:
    """OLMo-hybrid keeps every projection apart; its gate z is `g_proj`."""
    named = dict(q="q_proj", k="k_proj", v="v_proj", z="g_proj", b="b_proj", a="a_proj")
    return {n: getattr(theirs, m).weight.detach().numpy() for n, m in named.items()}


# family: (config class, layer class under transformers.models, weights split, eqllm flags)
FAMILIES = {
    "qwen3_next": (
        "Qwen3NextConfig",
        "qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet",
        split_qwen3_next,
        dict(),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet",
        split_qwen3_5,
        dict(),
    ),
    # OLMo-hybrid: beta in (0, 2), and its output norm's eps is 1e-5 whatever the config says.
    "olmo_hybrid": (
        "OlmoHybridConfig",
        "olmo_hybrid.modeling_olmo_hybrid.OlmoHybridGatedDeltaNet",
        split_olmo_hybrid,
        dict(allow_neg_eigval=True, norm_eps=1e-5),
    ),
}


def twin(family: str):
    """transformers' layer of `family` with random weights (gates and norm too), its config,
    and eqllm's layer holding the same weights."""
    import importlib

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config_class, layer_path, split, flags = FAMILIES[family]
    config = getattr(transformers, config_class)(
        **SIZES, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]
    )
    module, layer_class = layer_path.rsplit(".", 1)
    module = importlib.import_module(f"transformers.models.{module}")
    torch.manual_seed(0)
    theirs = getattr(module, layer_class)(config, 0).float().eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.2)  # outputs of order 1, like a trained layer's
    norm = theirs.o_norm if family == "olmo_hybrid" else theirs.norm
    out = theirs.o_proj if family == "olmo_hybrid" else theirs.out_proj
    with torch.no_grad():
        norm.weight.add_(1.0)
    w = split(theirs)
    ours = GatedDeltaNet(D_MODEL, KEY_HEADS, HEADS, D_K, D_V, **flags, key=jax.random.key(0))
    ours = eqx.tree_at(
        lambda m: (
            *(getattr(m, f"{n}_proj").weight for n in "qkvzba"),
            m.out_proj.weight,
            m.conv_weight,
            m.A_log,
            m.dt_bias,
            m.norm.weight,
        ),
        ours,
        tuple(
            jnp.asarray(t if isinstance(t, np.ndarray) else t.detach().numpy())
            for t in (
                *(w[n] for n in "qkvzba"),
                out.weight,
                theirs.conv1d.weight[:, 0, :],  # torch's (channels, 1, kernel)
                theirs.A_log,
                theirs.dt_bias,
                norm.weight,
            )
        ),
    )
    return torch, config, theirs, ours


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_equals_transformers_chunked_and_recurrent(family):
    torch, config, theirs, ours = twin(family)
    from transformers import DynamicCache

    x = X
    with torch.no_grad():  # no cache: the chunked path (chunks of 64, the last padded)
        expected = theirs(torch.from_numpy(x)).numpy()
    got, _ = run(ours, jnp.asarray(x))
    np.testing.assert_allclose(got, expected, atol=1e-5)

    # With a cache: a chunked prefill, then the recurrent path one token at a time.
    prefill, steps = PREFILL, X.shape[1] - PREFILL
    cache = DynamicCache(config=config)
    with torch.no_grad():
        expected = [theirs(torch.from_numpy(x[:, :prefill]), cache=cache).numpy()]
        for t in range(prefill, prefill + steps):
            expected.append(theirs(torch.from_numpy(x[:, t : t + 1]), cache=cache).numpy())
    out, state = run(ours, jnp.asarray(x[:, :prefill]))
    got = [out]
    for t in range(prefill, prefill + steps):
        out, state = run(ours, jnp.asarray(x[:, t : t + 1]), state)
        got.append(out)
    np.testing.assert_allclose(np.concatenate(got, 1), np.concatenate(expected, 1), atol=1e-5)
    # transformers keeps the last `kernel` conv inputs, (batch, channels, kernel); eqllm the
    # last kernel - 1, (batch, kernel - 1, channels).
    layer_cache = cache.layers[0]
    np.testing.assert_allclose(state.recurrent, layer_cache.recurrent_states[0].numpy(), atol=1e-5)
    conv = layer_cache.conv_states[0].numpy()[:, :, 1:].transpose(0, 2, 1)
    np.testing.assert_allclose(state.conv, conv, atol=1e-6)
