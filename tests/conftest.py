"""Shared fixtures: tiny configs of every family, built once per session.

The suite runs with jaxtyping + beartype checking eqllm's annotations (see pyproject's
`--jaxtyping-packages`), in fp32 with the highest matmul precision so comparisons are tight.
"""

import gc
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
# No persistent compilation cache in the test process: an in-process run (`eqllm.train.loop.run`)
# would point JAX at one for the rest of the process, and every later test would write what it
# compiles to disk. Runs started as subprocesses keep their cache.
jax.config.update("jax_enable_compilation_cache", False)

import eqllm  # noqa: E402

# libtpu (the `tpu` extra) is installed for `eqllm plan`: keep JAX's TPU probe quiet here.
eqllm.configure_process()

pytest_plugins = ["ci_strict"]  # with CI=true a skip fails (tests/ci_strict.py)

# Checks repeated over every family, stack or case that cost the default run the most: it keeps
# each one's first case and leaves the others to the slow set (`python -m pytest -m slow`, which
# CI runs too), so every kind of check still runs by default within the suite's time budget.
FIRST_CASE_ONLY = {
    "tests/reliability/test_checkpoint_faults.py::test_damaged_checkpoint_falls_back_loudly_and_is_kept",
    "tests/reliability/test_checkpoint_faults.py::test_failed_save_is_a_clear_error_and_the_previous_checkpoint_survives",
    "tests/test_attention_backend.py::test_each_attention_feature_gives_the_models_logits_through_the_fused_arguments",
    "tests/test_attention_backend.py::test_fused_arguments_give_the_models_attention",
    "tests/test_generate.py::test_cached_decode_matches_full_forward",
    "tests/test_generate.py::test_greedy_equals_argmax_chain",
    "tests/test_gguf.py::test_import_equals_transformers_loader",
    "tests/test_gpt_oss.py::test_other_families_refuse_gpt_oss_settings_on_export",
    "tests/test_grpo.py::test_one_update_without_clipping_is_reinforce_with_a_group_baseline",
    "tests/test_harness_chat.py::test_chat_formatted_requests_equal_hf",
    "tests/test_hub.py::test_import_gives_transformers_logits",
    "tests/test_lora.py::test_adapter_saved_by_eqllm_loads_in_peft_and_merges",
    "tests/test_model.py::test_batch_call_equals_vmap_and_one_by_one",
    "tests/test_model.py::test_scanned_equals_unrolled",
    "tests/test_model.py::test_shapes_and_dtypes",
    "tests/test_moe.py::test_grouped_experts_equal_dense_ones",
    "tests/test_nn.py::test_in_order_attention_equals_full_masked_attention",
    "tests/test_packing.py::test_document_mask_step_trains_on_each_document_alone",
    "tests/test_packing.py::test_packed_loss_equals_padded_loss",
    "tests/test_parametrization.py::test_base_size_equals_sp_bit_for_bit",
    "tests/test_preference.py::test_dpo_and_ipo_loss_and_gradient_equal_trl",
    "tests/test_quantize.py::test_every_linear_is_quantized_and_equals_its_dequantized_weights",
    "tests/test_rope_scaling.py::test_cached_decoding_equals_the_full_forward",
    "tests/test_rope_scaling.py::test_import_and_export_equal_transformers",
    "tests/test_segments.py::test_packed_documents_have_their_logits_alone",
    "tests/test_train.py::test_resume_at_the_last_step_finishes_the_run_folder",
}


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    seen = set()
    for item in items:
        test = item.nodeid.split("[")[0]
        if test in FIRST_CASE_ONLY and test in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(test)


TINY = {
    "vocab_size": 97,
    "d_model": 32,
    "n_layers": 2,
    "attention.n_heads": 4,
    "mlp.d_ff": 64,
    "max_seq_len": 64,
}

TINY_CONFIGS = {
    "gpt2": eqllm.zoo.config("gpt2-nano", **TINY),
    "llama": eqllm.zoo.config("llama-nano", **TINY, attention={"n_kv_heads": 2}),
    "mistral": eqllm.zoo.config(
        "mistral-7b", **TINY, attention={"n_kv_heads": 2, "sliding_window": 5}
    ),
    "qwen2": eqllm.zoo.config("qwen2.5-0.5b", **TINY, attention={"n_kv_heads": 1}),
    "gemma": eqllm.zoo.config("gemma-2b", **TINY, attention={"n_kv_heads": 1}),
    "llama3": eqllm.zoo.config(
        "llama3.2-1b",
        **TINY,
        attention={"n_kv_heads": 2},
        positions={"scaling": {"original_max_seq_len": 16}},
    ),
    "qwen3": eqllm.zoo.config("qwen3-0.6b", **TINY, attention={"n_kv_heads": 2, "head_dim": 16}),
    # Windows shorter than the test sequences; caps small enough that tanh bends the values.
    "gemma2": eqllm.zoo.config(
        "gemma2-2b",
        **TINY,
        attention={
            "n_kv_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 12,
            "sliding_window": 5,
            "softcap": 1.0,
        },
        final_softcap=2.0,
    ),
    "gemma3": eqllm.zoo.config(
        "gemma3-1b",
        **{**TINY, "n_layers": 3},
        attention={
            "n_kv_heads": 1,
            "head_dim": 8,
            "query_pre_attn_scalar": 12,
            "sliding_window": 5,
            "global_every": 2,
        },
    ),
    "phi3": eqllm.zoo.config(
        "phi3-mini-4k",
        **TINY,
        attention={"n_kv_heads": 2, "sliding_window": 6},
        positions={"fraction": 0.5},
    ),
    "olmo2": eqllm.zoo.config("olmo2-1b", **TINY, attention={"n_kv_heads": 2}),
    # Mixtures of experts: 4 experts, 2 per token (tests/test_moe.py: the grouped product).
    "mixtral": eqllm.zoo.config(
        "mixtral-8x7b", **TINY, attention={"n_kv_heads": 2}, moe={"n_experts": 4}
    ),
    "qwen2_moe": eqllm.zoo.config(
        "qwen1.5-moe-a2.7b",
        **TINY,
        attention={"n_kv_heads": 2},
        moe={"n_experts": 4, "experts_per_token": 2, "d_ff": 16, "shared_d_ff": 24},
    ),
    "olmoe": eqllm.zoo.config("olmoe-1b-7b", **TINY, moe={"n_experts": 4, "experts_per_token": 2}),
}


def cached_logits(model, tokens, prefill: int) -> np.ndarray:
    """The logits after positions prefill-1 .. len-2 of `tokens` computed through the KV cache:
    prefill tokens[:prefill], then decode one token per step in one compiled scan. They equal
    the full forward's [prefill - 1 : -1] when cached decoding is right."""
    tokens = jnp.asarray(tokens)
    length = tokens.shape[0]

    @eqx.filter_jit
    def run(model, tokens):
        cache = model.init_cache(length)
        first, cache = model.prefill(tokens[:prefill], jnp.arange(prefill), cache)

        def step(cache, i):
            logits, cache = model.decode(tokens[i], i, cache)
            return cache, logits

        rest = jax.lax.scan(step, cache, jnp.arange(prefill, length - 1))[1]
        return jnp.concatenate([first[None], rest])

    return np.asarray(run(model, tokens))


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def family_model(request):
    """(name, model) for a tiny model of each family."""
    name = request.param
    return name, eqllm.CausalLM(TINY_CONFIGS[name], key=jax.random.key(0))


# The 8-device tests need XLA_FLAGS set before jax starts: tests/test_sharding.py runs them in a
# subprocess with EQLLM_MULTIDEVICE=1.
collect_ignore = [] if os.environ.get("EQLLM_MULTIDEVICE") else ["multidevice"]


@pytest.fixture(scope="module", autouse=True)
def _compiled_programs_stay_with_their_module():
    """Drop every compiled program after each test module. XLA maps each CPU executable's code
    into memory; the whole suite in one process compiles enough of them to pass the kernel's
    limit on memory mappings (vm.max_map_count, 65530 by default: test_moe alone leaves about
    7,000), and the next compilation then aborts the process."""
    yield
    jax.clear_caches()
    gc.collect()
