"""DeepSeek-V3 and V2 beyond the family contract (tests/test_families.py: logits both ways,
scanned == unrolled, cached decoding, published counts): the settings read (a dense first layer,
query compression on and off, group-limited routing on and off, the correction bias), the latent
cache, multi-token-prediction layers skipped on import, the fp8 release refused, the published
sizes' active parameters counted by transformers on the meta device, the correction bias's
auxiliary-loss-free balancing, and Kimi K2 (DeepSeek-V3 under model_type "kimi_k2", its
tokenizer a tiktoken file with remote code, refused naming the fix).
"""

import dataclasses
import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from safetensors.numpy import load_file, save_file

import eqllm
from eqllm.data import Tokenizer
from eqllm.hub import CheckpointError
from eqllm.hub.folders import load_tokenizer
from eqllm.recipe import load_recipe
from eqllm.recipe.inputs import check_tokenizer
from eqllm.train.step import TrainStep, init_opt_state
from tests.families import params
from tests.hf_parity import TOKENS, logits

transformers = pytest.importorskip("transformers")


@pytest.fixture(
    scope="module", params=params({"deepseek_v3"}, where=lambda t: t.family.startswith("deepseek"))
)
def pair(request, twins):
    """tests/families.py's tiny DeepSeek-V3 (V2 in the slow set): its transformers twin, saved,
    and eqllm's import of it."""
    return twins(request.param)


def test_import_reads_the_family(pair):
    cfg = pair.model.config
    a, moe = cfg.attention, cfg.moe
    assert (a.kind, a.kv_lora_rank, a.qk_rope_head_dim, a.v_head_dim) == ("mla", 12, 6, 10)
    assert (moe.dense_layers, moe.shared_d_ff, moe.shared_gated) == (1, 32, False)
    assert pair.model.dense_blocks is not None and pair.model.blocks.mlp.router.weight.shape[0] == 2
    if pair.name == "deepseek_v3":
        assert (a.q_lora_rank, a.rope_interleave, moe.scoring, moe.score_bias) == (
            16, True, "sigmoid", True)  # fmt: skip
        assert (moe.n_groups, moe.topk_groups, moe.routed_scale) == (4, 2, 2.5)
        bias = pair.model.blocks.mlp.score_bias
        assert np.abs(np.asarray(bias)).max() > 0.05  # the perturbed correction bias was read
    else:
        assert (a.q_lora_rank, moe.scoring, moe.n_groups, moe.norm_topk_prob) == (
            None, "softmax", None, False)  # fmt: skip


def test_the_cache_holds_each_layers_latent_and_rotated_key(pair):
    """Cached decoding keeps the 12-wide latent and the 6 rotated key dims per position, not
    the heads' keys and values (the decoding itself is the contract's)."""
    cache = eqx.filter_eval_shape(lambda m: m.init_cache(40), pair.model)
    assert len(cache) == pair.model.config.n_layers
    assert cache[0].latent.shape == (40, 12) and cache[0].rope_key.shape == (40, 6)


def test_multi_token_prediction_layers_are_skipped_with_a_message(pair, tmp_path, caplog):
    hf = json.loads((pair.folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))
    tensors = load_file(pair.folder / "model.safetensors")
    last = f"model.layers.{hf['num_hidden_layers'] - 1}."
    extra = {k.replace(last, "model.layers.3."): v for k, v in tensors.items() if last in k}
    extra["model.layers.3.eh_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = eqllm.hub.from_pretrained(tmp_path)
    assert "skipping" in caplog.text and "layers [3]" in caplog.text
    np.testing.assert_allclose(logits(model, TOKENS[:30]), pair.ref[:30], atol=1e-4, rtol=0)


def test_the_fp8_release_is_refused_with_the_cast_to_make(pair, tmp_path):
    """DeepSeek-V3 as published stores fp8 weights with a `weight_scale_inv` per 128 x 128
    block: refused by name, with the cast that makes it loadable."""
    (tmp_path / "config.json").write_text((pair.folder / "config.json").read_text())
    tensors = load_file(pair.folder / "model.safetensors")
    scale = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    tensors[scale] = np.ones((1, 1), np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"weight_scale_inv.*fp8_cast_bf16\.py"):
        eqllm.hub.from_pretrained(tmp_path)


def test_other_families_refuse_latent_attention_and_deepseek_routing_on_export():
    mla = dataclasses.asdict(eqllm.zoo.config("deepseek_v3-nano").attention)
    cfg = eqllm.zoo.config("llama-nano").replace(attention=mla)
    with pytest.raises(eqllm.ConfigError, match="attention.kind"):
        eqllm.hub.to_hf_config(cfg)
    routed = eqllm.zoo.config("qwen3_moe-nano").replace(moe={"scoring": "sigmoid"})
    with pytest.raises(eqllm.ConfigError, match="moe.scoring"):
        eqllm.hub.to_hf_config(routed)


# Published sizes ------------------------------------------------------------------------------

PUBLISHED = {
    name: json.loads((Path(__file__).parent / "data" / "hf_configs" / f"{name}.json").read_text())
    for name in ("deepseek-v3", "deepseek-v2-lite")
}


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_total_and_active_parameters_equal_transformers(name):
    """Total: transformers' parameters and its correction-bias buffers on the meta device (the
    multi-token-prediction layer is not built). Active: that, less the routed experts a token
    does not reach, (n_experts - k) / n_experts of each mixture layer's experts."""
    hf_config = dict(PUBLISHED[name])
    hf_config.pop("quantization_config", None)  # the fp8 storage: the same parameters
    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in hf.parameters())
    count += sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    experts = [layer.mlp.experts for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    idle = sum(sum(p.numel() for p in e.parameters()) for e in experts)
    idle = idle * (config.n_routed_experts - config.num_experts_per_tok) // config.n_routed_experts
    assert eqllm.zoo.param_count(name) == count  # the published figure: tests/families.py
    assert eqllm.zoo.active_param_count(name) == count - idle
    assert eqllm.zoo.config(name) == eqllm.hub.from_hf_config(PUBLISHED[name])


# Auxiliary-loss-free balancing ----------------------------------------------------------------


@pytest.mark.slow
def test_the_correction_bias_moves_load_toward_balance():
    """A router with zero weights and a correction bias skewed to experts 0 and 1 sends every
    token there; each step moves the bias by u * sign(mean load - load) (closed form: -u for
    the two loaded experts, +u for the six idle ones), with a learning rate of 0 so that only
    the bias moves, until the idle experts win: with u = 0.04 from 0.3, after the fourth step."""
    u, skew = 0.04, 0.3
    cfg = eqllm.zoo.config(
        "deepseek_v3-nano", vocab_size=64, d_model=32, max_seq_len=32, moe={"bias_update_speed": u}
    )
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    router = model.blocks.mlp.router.weight
    start = jnp.zeros((3, 8)).at[:, :2].set(skew)
    model = eqx.tree_at(
        lambda m: (m.blocks.mlp.router.weight, m.blocks.mlp.score_bias),
        model,
        (jnp.zeros_like(router), start),
    )
    optimizer = optax.sgd(0.0)
    step = TrainStep(optimizer, lambda count: 0.0)
    state = init_opt_state(optimizer, model)
    tokens = np.random.default_rng(0).integers(0, 64, (4, 17))
    loads, biases = [], []
    for _ in range(5):
        model, state, metrics = step(model, state, tokens)
        loads.append(np.asarray(metrics["expert_load"]))
        biases.append(np.asarray(model.blocks.mlp.score_bias))
    skewed = np.tile([0.5, 0.5, 0, 0, 0, 0, 0, 0], (3, 1))
    for k in range(4):  # the first four steps still choose experts 0 and 1
        np.testing.assert_array_equal(loads[k], skewed)
        expected = np.tile([skew - u * (k + 1)] * 2 + [u * (k + 1)] * 6, (3, 1))
        np.testing.assert_allclose(biases[k], expected, atol=1e-6)
    assert (loads[4][:, :2] == 0).all()  # then the idle experts take the tokens
    np.testing.assert_array_equal(np.asarray(model.blocks.mlp.router.weight), 0.0)


@pytest.mark.slow
def test_the_sequence_wise_balance_loss_equals_the_reports_equations():
    """moe.balance_loss = "sequence" against a NumPy transcription of the DeepSeek-V3 report's
    equations 17-20 on random router logits, with a perturbed correction bias choosing the
    experts: per sequence f_i = E / (k T) * (tokens choosing i), P_i = the mean of the scores
    normalised over experts, the loss sum_i f_i P_i, averaged over sequences and layers."""
    moe_cfg = {"n_groups": None, "topk_groups": None, "balance_loss": "sequence"}
    cfg = eqllm.zoo.config("deepseek_v3-nano", vocab_size=64, d_model=32, moe=moe_cfg)
    moe = eqllm.CausalLM(cfg, key=jax.random.key(0)).blocks.mlp
    n, k, seq = cfg.moe.n_experts, cfg.moe.experts_per_token, 9
    rng = np.random.default_rng(0)
    bias = rng.normal(0, 0.3, moe.score_bias.shape).astype(np.float32)
    moe = eqx.tree_at(lambda m: m.score_bias, moe, jnp.asarray(bias))
    router = rng.normal(size=(bias.shape[0], 2, seq, n)).astype(np.float32)
    got = eqllm.nn.sequence_balance_loss(moe, jnp.asarray(router))
    scores = 1 / (1 + np.exp(-router))
    chosen = np.argsort(-(scores + bias[:, None, None]), -1)[..., :k]
    f = (chosen[..., None] == np.arange(n)).any(-2).sum(2) * n / (k * seq)
    p = (scores / scores.sum(-1, keepdims=True)).mean(2)
    np.testing.assert_allclose(got, (f * p).sum(-1).mean(), rtol=1e-6)
    grad = jax.grad(lambda r: eqllm.nn.sequence_balance_loss(moe, r))(jnp.asarray(router))
    assert np.isfinite(grad).all() and np.abs(grad).max() > 0  # it trains the router
    with pytest.raises(eqllm.ConfigError, match="balance_loss"):
        eqllm.zoo.config("deepseek_v3-nano", moe={"balance_loss": "global"})


def test_zoo_show_sizes_deepseek_v3_per_device(capsys):
    from eqllm.cli import main

    assert main(["zoo", "show", "deepseek-v3", "--mesh", "fsdp=8,tensor=8"]) == 0
    out = capsys.readouterr().out
    assert "dense_blocks.mlp.gate.weight" in out and "blocks.mlp.score_bias" in out
    # 671,026,419,200 fp32 parameters split evenly over 64 devices would be 39.06 GiB; what is
    # split over one axis only (the latents' projections) or replicated (norms) adds a little.
    per_device = float(out.split("parameters per device: ")[1].split(" GiB")[0])
    assert 671_026_419_200 * 4 / 64 / 2**30 < per_device < 1.1 * 671_026_419_200 * 4 / 64 / 2**30


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3-nano", "glm4_moe-nano"])
def test_the_nano_trains_and_generates_on_a_cpu(name):
    """deepseek_v3-nano (latent attention) and glm4_moe-nano (grouped-query attention) as their
    recipes build them: the loss falls over a few steps of one batch, the correction bias
    moves, and eqllm.generate decodes from the cache."""
    recipe = load_recipe(name)
    model = eqllm.CausalLM(recipe.model_config(), key=jax.random.key(0))
    assert model.config.moe.bias_update_speed == 0.001
    tokens = np.random.default_rng(0).integers(0, 4096, (4, 33))
    optimizer = optax.adam(3e-3)
    step = TrainStep(optimizer, lambda count: 3e-3)
    state = init_opt_state(optimizer, model)
    losses = []
    for _ in range(5):
        model, state, metrics = step(model, state, tokens)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.5
    assert np.abs(np.asarray(model.blocks.mlp.score_bias)).max() > 0
    out = eqllm.generate(model, tokens[0, :8], max_new_tokens=6, key=jax.random.key(1))
    assert np.asarray(out).shape[-1] >= 6


# Kimi K2 ---------------------------------------------------------------------------------------

_KIMI_REMOTE_CODE = {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
}


def test_kimi_k2_folder_reads_as_deepseek_v3(twins, tmp_path):
    """A checkpoint whose config.json says model_type "kimi_k2" with the auto_map of its remote
    code, as Kimi K2's does, is DeepSeek-V3's: the same config and transformers' logits; an
    export names deepseek_v3, which transformers reads without remote code."""
    pair = twins("deepseek_v3")
    shutil.copytree(pair.folder, tmp_path, dirs_exist_ok=True)
    hf = json.loads((tmp_path / "config.json").read_text())
    kimi = {**hf, "model_type": "kimi_k2", "auto_map": _KIMI_REMOTE_CODE}
    (tmp_path / "config.json").write_text(json.dumps(kimi))
    model = eqllm.hub.from_pretrained(tmp_path)
    assert model.config == pair.model.config
    np.testing.assert_allclose(logits(model, TOKENS), pair.ref, atol=1e-5, rtol=0)
    assert eqllm.hub.to_hf_config(model.config)["model_type"] == "deepseek_v3"


def test_kimi_k2_tiktoken_tokenizer_is_refused_naming_the_fix(tmp_path, caplog):
    """Kimi K2 ships tiktoken.model with tokenization_kimi.py (its pre-tokenizer pattern and
    special tokens live in that code), which eqllm does not run: loading the tokenizer names
    the conversion to tokenizer.json; loading the model folder warns and goes on without one;
    a tokenizer.json beside the tiktoken file is read."""
    (tmp_path / "tiktoken.model").write_text("IQ== 0\nIg== 1\n")  # base64 token, rank
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    fix = r"tiktoken.model with remote code.*TikTokenConverter\(vocab_file='tiktoken.model'"
    with pytest.raises(eqllm.EqllmError, match=fix):
        Tokenizer.load(tmp_path)
    with pytest.raises(eqllm.EqllmError, match=fix):
        Tokenizer.from_spec(str(tmp_path))
    with pytest.raises(eqllm.EqllmError, match=fix):  # as a recipe's data.tokenizer
        check_tokenizer(str(tmp_path))
    with caplog.at_level("WARNING", logger="eqllm.hub"):
        assert load_tokenizer(tmp_path) is None
    assert "TikTokenConverter" in caplog.text
    Tokenizer.bytes().save(tmp_path)
    assert Tokenizer.load(tmp_path).encode("hi") == Tokenizer.bytes().encode("hi")
