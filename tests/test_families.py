"""The family contract, written once and run over tests/families.py's list of tiny models.

Each entry's twin is transformers' model of the same config, every parameter perturbed (so that
a norm, bias or row mapped to the wrong place shows up), saved and imported by eqllm
(tests/hf_parity.py). Against it, every family:

- imports with transformers' logits (<= 1e-5) and the config it was written from;
- is causal;
- exports to a folder transformers loads with the same logits (<= 1e-5) and the very tensors,
  which eqllm reads back bit for bit;
- runs its scanned stack as its unrolled layer loop;
- decodes through its cache as its full forward does (longer inputs in the slow set), and
  greedy-decodes as transformers' `generate` does;
- takes LoRA adapters that peft reads and writes with the same logits;
- is written as GGUF where eqllm writes its architecture, read by transformers' GGUF loader;
- has the parameter counts its releases publish.

The default run checks every family's import, export, causality, scanned stack and cache; the
slow set adds the variants (a second case of a family) and the costlier checks on every family.
What is particular to one family stays in its own file (tests/test_gpt_neox.py, ...).
"""

import json
import warnings

import jax
import numpy as np
import pytest
from safetensors import safe_open

import eqllm
from eqllm import families, lora
from eqllm.errors import EqllmError
from tests.conftest import cached_logits
from tests.families import BY_NAME, FAMILIES, params
from tests.hf_parity import TOKENS, check_greedy_generate, hf_logits, logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=params())
def twin(request, twins):
    return twins(request.param)


# The list itself ---------------------------------------------------------------------------


def test_every_family_has_an_entry_in_the_default_run():
    listed = {t.family for t in FAMILIES if not t.variant}
    missing = sorted(set(families.names()) - listed)
    assert not missing, (
        f"families {missing} (eqllm/families/) have no entry in tests/families.py: add one line "
        "to FAMILIES there (a name, a tiny config and what it supports)"
    )
    assert len(BY_NAME) == len(FAMILIES), "two entries share a name"
    for tiny in FAMILIES:
        assert tiny.config.vocab_size == 97 and tiny.config.d_model == 32, tiny.name  # tiny


def test_the_list_says_which_families_are_written_as_gguf():
    """An entry's `gguf` is what eqllm does (a model it does not write is refused by name), so
    the GGUF check below runs on every model eqllm writes."""
    wrong = []
    for tiny in FAMILIES:
        try:
            eqllm.hub.gguf.check_exportable(tiny.config, "f32")
            written = True
        except eqllm.ConfigError as error:
            assert tiny.family in str(error) or "GGUF" in str(error), error
            written = False
        if written != tiny.gguf:
            wrong.append(tiny.name)
    assert not wrong, f"{wrong}: gguf= in tests/families.py differs from what eqllm writes"


# Transformers' logits, both ways -------------------------------------------------------------


def test_import_gives_transformers_logits(twin):
    model = twin.model
    assert families.for_model_type(twin.hf.config.model_type).name == twin.tiny.family
    assert model.config == twin.config  # every setting read back as it was written
    ours = logits(model, TOKENS)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, twin.ref, atol=twin.tiny.atol, rtol=0)


def test_causality(twin):
    """Changing token t changes no logit before t, and does change logits from t on."""
    t = 100
    changed = TOKENS.copy()
    changed[t] = (changed[t] + 1) % 97
    a, b = logits(twin.model, TOKENS), logits(twin.model, changed)
    np.testing.assert_array_equal(a[:t], b[:t])
    assert not np.allclose(a[t:], b[t:])


def _tensor_names(folder) -> set[str]:
    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="numpy") as f:
            names |= set(f.keys())
    return names


def test_export_loads_in_transformers_with_the_same_logits(twin, tmp_path):
    """Sharded, with transformers' tensor names, loaded by transformers with the same logits
    and the very tensors of the original; eqllm reads its export back bit for bit."""
    eqllm.hub.save_pretrained(twin.model, tmp_path, max_shard_size=30_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    # The tensors transformers itself writes, by name: a tied head is not written twice.
    assert set(index["weight_map"]) == _tensor_names(twin.folder)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reloaded).__name__ == families.get(twin.tiny.family).architecture
    exported = hf_logits(reloaded.eval(), TOKENS)
    np.testing.assert_allclose(exported, logits(twin.model, TOKENS), atol=twin.tiny.atol, rtol=0)
    state = reloaded.state_dict()
    for name, p in twin.hf.state_dict().items():
        np.testing.assert_array_equal(state[name].numpy(), p.numpy(), name)
    again = eqllm.hub.from_pretrained(tmp_path)
    assert again.config == twin.model.config
    for a, b in zip(jax.tree.leaves(twin.model), jax.tree.leaves(again), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# The stack and the cache ---------------------------------------------------------------------


def test_scanned_equals_unrolled(twin):
    """The scan carries per-layer differences (windows, RoPE bases, NoPE layers, a dense prefix)
    as data; the unrolled loop knows them as Python values."""
    unrolled = twin.model.with_config(scan_layers=False)
    np.testing.assert_allclose(
        logits(unrolled, TOKENS), logits(twin.model, TOKENS), atol=twin.tiny.scan_atol, rtol=0
    )


@pytest.mark.parametrize(
    "prefill, length", [(20, 48), pytest.param(200, 240, marks=pytest.mark.slow)]
)
def test_cached_decoding_equals_the_full_forward(twin, prefill, length):
    """Prefill, then one token at a time (past every window): each step's logits equal the full
    forward's. The long case runs past Llama 3's and YaRN's original contexts; a hybrid's
    linear-attention layers carry their recurrent state from the prefill to the last token.
    A model whose cache cannot carry its state (`generates` False) is refused by name."""
    if not twin.tiny.generates:
        with pytest.raises(EqllmError, match=twin.tiny.family):
            cached_logits(twin.model, TOKENS[:length], prefill)
        return
    full = logits(twin.model, TOKENS)  # causal: its first rows are those of any prefix
    cached = cached_logits(twin.model, TOKENS[:length], prefill)
    want = full[prefill - 1 : length - 1]
    np.testing.assert_allclose(cached, want, atol=twin.tiny.cached_atol, rtol=0)


def _decodes_as_transformers(tiny) -> bool:
    """transformers' Mamba-2 decode step (as mamba_ssm's `step`) leaves dt unclamped by
    time_step_limit, which its prefill applies; eqllm clamps at every token, so its cached
    decoding equals its full forward (above). No release sets a limit."""
    return tiny.generates and tiny.config.at("linear.dt_max") is None


# By default: learned positions, a ring-buffer cache that wraps, alternating windowed layers,
# a hybrid's and Mamba-2's recurrent state.
@pytest.mark.parametrize(
    "name",
    params(
        {"gpt2", "mistral", "gemma2", "qwen3_5", "mamba2", "falcon_h1"},
        where=_decodes_as_transformers,
    ),
)
def test_greedy_equals_transformers_generate(twins, name):
    """eqllm.generate's greedy continuation is the one transformers' generate picks."""
    check_greedy_generate(twins(name))


# LoRA against peft ---------------------------------------------------------------------------


def _targets(pair) -> list[str]:
    available = lora.available_targets(pair.model)
    targets = list(pair.tiny.lora or available)
    assert set(targets) <= set(available), (pair.tiny.name, targets, available)
    return targets


def _fresh_hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _float64(model):
    """`model` (a peft model) in float64, the reference fp32 results are held to; torch's
    grouped_mm experts have no float64 kernel, so a mixture of experts runs its eager loop."""
    inner = model.get_base_model()
    if getattr(inner.config, "_experts_implementation", None) not in (None, "eager"):
        inner.set_experts_implementation("eager")
    return model.double()


def _no_key_warnings(caught) -> list[str]:
    """peft only warns about missing or unexpected keys and leaves B at zero."""
    return [str(w.message) for w in caught if "keys" in str(w.message).lower()]


@pytest.mark.parametrize("name", params({"gpt2", "llama"}))
def test_adapter_made_with_peft_loads_with_peft_logits(twins, name, tmp_path):
    """peft's own adapter on every target (random non-zero B, rsLoRA's alpha / sqrt(r), one
    target at another rank and alpha) read by eqllm gives peft's logits."""
    peft = pytest.importorskip("peft")
    pair = twins(name)
    targets = _targets(pair)
    base = _fresh_hf(pair.folder)
    conv1d = any(isinstance(m, transformers.pytorch_utils.Conv1D) for m in base.modules())
    config = peft.LoraConfig(
        r=4,
        lora_alpha=12,
        target_modules=targets,
        init_lora_weights=False,  # random, non-zero B
        rank_pattern={targets[-1]: 2},
        alpha_pattern={targets[-1]: 3},
        fan_in_fan_out=conv1d,  # GPT-2's Conv1D stores (in, out)
        use_rslora=True,
    )
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(base, config).eval()
    peft_model.save_pretrained(tmp_path)
    model = eqllm.hub.from_pretrained(pair.folder, adapter=tmp_path)
    assert len(lora.adapters(model)) > 0
    expected = hf_logits(peft_model, TOKENS)
    assert np.abs(expected - pair.ref).max() > 1e-3  # the adapters change the function
    # peft's random B at rsLoRA's scale (12 / sqrt(4)) moves the logits far from the base
    # model's, and torch's own fp32 rounding with them (1.6e-4 from float64 on deepseek_v3,
    # eqllm's 1.1e-4): eqllm's fp32 logits are held to peft's in float64, relative to their size.
    truth = hf_logits(_float64(peft_model), TOKENS)
    scale = max(1.0, np.abs(truth).max())
    np.testing.assert_allclose(logits(model, TOKENS), truth, atol=1e-4 * scale, rtol=0)


@pytest.mark.parametrize("name", params({"llama", "gpt_neox"}))
def test_adapter_saved_by_eqllm_loads_in_peft_and_merges(twins, name, tmp_path):
    """eqllm's adapters on every target, trained-like (every B non-zero; a fused module's parts
    with different A), saved in peft's format: peft gives the same logits with no key warning;
    merged, the model gives them too and transformers loads the merged export; eqllm reads its
    own adapter back."""
    peft = pytest.importorskip("peft")
    pair = twins(name)
    adapted = lora.apply(pair.model, rank=3, alpha=6, targets=_targets(pair), key=jax.random.key(0))
    leaves, treedef = jax.tree.flatten(adapted)
    keys = iter(jax.random.split(jax.random.key(1), len(leaves)))
    mask = jax.tree.leaves(lora.trainable(adapted))
    leaves = [
        x + 0.05 * jax.random.normal(next(keys), x.shape) if m else x
        for x, m in zip(leaves, mask, strict=True)
    ]
    adapted = jax.tree.unflatten(treedef, leaves)
    ours = logits(adapted, TOKENS)
    assert np.abs(ours - pair.ref).max() > 1e-3  # the adapters change the function

    eqllm.hub.save_adapter(adapted, tmp_path / "adapter")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = peft.PeftModel.from_pretrained(_fresh_hf(pair.folder), tmp_path / "adapter")
    assert not _no_key_warnings(caught)
    np.testing.assert_allclose(hf_logits(peft_model.eval(), TOKENS), ours, atol=1e-4, rtol=0)

    merged = lora.merge(adapted)
    assert not lora.adapters(merged)
    np.testing.assert_allclose(logits(merged, TOKENS), ours, atol=1e-4, rtol=0)
    eqllm.hub.save_pretrained(merged, tmp_path / "merged")
    np.testing.assert_allclose(
        hf_logits(_fresh_hf(tmp_path / "merged"), TOKENS), ours, atol=1e-4, rtol=0
    )
    again = eqllm.hub.from_pretrained(pair.folder, adapter=tmp_path / "adapter")
    np.testing.assert_allclose(logits(again, TOKENS), ours, atol=1e-5, rtol=0)


# GGUF ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", params(where=lambda t: t.gguf))
def test_gguf_file_equals_the_model_in_transformers(twins, name, tmp_path):
    """eqllm's f32 GGUF file, read by transformers' GGUF loader where it reads the
    architecture (not the hybrids: tests/test_gguf_hybrid.py checks them against llama.cpp's
    converter), gives eqllm's logits (within 1e-5 of the largest); eqllm reads it back to the
    same model."""
    pytest.importorskip("gguf")
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    pair = twins(name)
    file = tmp_path / "model.gguf"
    eqllm.hub.save_gguf(pair.model, file, type="f32")
    ours = logits(pair.model, TOKENS)
    back = eqllm.hub.from_pretrained(file)
    # llama.cpp's files hold some weights transformed (1 + w norms, -exp(A_log)): their
    # rounding, run through a recurrence over the sequence, is why this is not bit-exact.
    np.testing.assert_allclose(logits(back, TOKENS), ours, atol=1e-5 * np.abs(ours).max(), rtol=0)
    arch = families.get(pair.model.config.family).gguf
    # Gemma 4: transformers' loader reads few of the file's settings; tests/test_gguf_gemma4.py
    # gives it the others.
    if arch not in GGUF_SUPPORTED_ARCHITECTURES or arch == "gemma4":
        return
    # transformers' GGUF loader leaves head_dim at its config's default (Qwen3's: 128) whatever
    # the file's attention.key_length says; eqllm's reading of it is checked below.
    config = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file=file.name)
    if hasattr(config, "head_dim"):
        config.head_dim = pair.model.config.head_dim
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=file.name, config=config, dtype=torch.float32
    ).eval()
    error = np.abs(hf_logits(theirs, TOKENS) - ours).max() / np.abs(ours).max()
    assert error <= 1e-5


# Published parameter counts ------------------------------------------------------------------


def _as_published(count: int, figure: int | str) -> int | str:
    """`count` as `figure` gives it: exact (an int) or in billions, rounded as the string is."""
    if isinstance(figure, int):
        return count
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    return f"{count / 1e9:.{decimals}f}"


@pytest.mark.parametrize(
    "name, size",
    [(t.name, size) for t in FAMILIES for size in t.published],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_published_sizes_have_the_published_counts(name, size):
    """The zoo's count of a released size is the one its release publishes (transformers'
    count of every zoo size is tests/test_zoo.py's)."""
    figure = BY_NAME[name].published[size]
    total, active = figure if isinstance(figure, tuple) else (figure, None)
    assert _as_published(eqllm.zoo.param_count(size), total) == total
    if active is not None:
        assert _as_published(eqllm.zoo.active_param_count(size), active) == active
