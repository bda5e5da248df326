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


pytest_plugins = ["ci_strict"]  # with CI=true a skip fails (tests/ci_strict.py)

# The tiny model of every family (tests/families.py holds the one list).
from tests.families import NO_DEFAULT_CASE, TINY, TINY_CONFIGS  # noqa: E402, F401


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    """Record the parametrised tests whose every case is slow only through its parameters: the
    default run would never run them (tests/test_suite.py fails naming them). Cases are marked
    slow on their parameters (`pytest.param(..., marks=pytest.mark.slow)`, tests/families.py's
    `params`), never selected by test-id strings, so a rename cannot change what runs."""
    named = [arg.split("::")[0] for arg in config.args if "[" in arg]  # some cases picked by id
    cases: dict[str, list[bool]] = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or any(item.nodeid.startswith(path) for path in named):
            continue
        whole = [m for m in getattr(item.function, "pytestmark", []) if m.name == "slow"]
        if whole or any(item.parent.iter_markers("slow")):
            continue  # the whole test is slow, which is said where it is written
        test = f"{item.parent.nodeid}::{item.originalname}"
        cases.setdefault(test, []).append(any(m.name == "slow" for m in callspec.marks))
    config.stash[NO_DEFAULT_CASE] = sorted(test for test, slow in cases.items() if all(slow))


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


@pytest.fixture(scope="session")
def twins(tmp_path_factory):
    """`twins(name)`: the transformers twin of tests/families.py's entry `name` and eqllm's
    import of it (tests/hf_parity.py's `twin`), built on first use and kept for the session, so
    the family contract and the tests particular to one family share one build."""
    from tests import hf_parity  # torch and transformers load only for tests that use them
    from tests.families import BY_NAME

    built = {}

    def get(name: str):
        if name not in built:
            built[name] = hf_parity.twin(BY_NAME[name], tmp_path_factory.mktemp(f"hf-{name}"))
        return built[name]

    return get


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
