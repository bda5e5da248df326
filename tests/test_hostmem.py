"""eqllm.hostmem: freed XLA buffers stay mapped, so repeated calls do not page-fault them in."""

import subprocess
import sys

import pytest

# Minor page faults (MiB) per call of a jitted function whose temporaries total ~50 MB.
PROBE = """
import resource, sys
import eqllm  # changes nothing by itself
if sys.argv[1] == "configure":
    eqllm.configure_process()  # the malloc settings, unless EQLLM_KEEP_HOST_MEMORY=0
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sort(jnp.cumsum(x * 2.0))[::-1] + jnp.sort(x))
x = jnp.ones(4_000_000)
jax.block_until_ready(f(x)); jax.block_until_ready(f(x))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    jax.block_until_ready(f(x))
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / 3 / 2**20)
"""


def faulted_mib(keep: str, mode: str = "configure") -> float:
    env = {"EQLLM_KEEP_HOST_MEMORY": keep, "JAX_PLATFORMS": "cpu", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_configure_process_stops_per_call_page_faults_and_import_alone_does_not():
    default, kept = faulted_mib("0"), faulted_mib("1")
    assert default > 60, default  # glibc unmaps XLA's freed temporaries after every call
    assert kept < default / 3, (kept, default)
    imported = faulted_mib("1", mode="import-only")  # `import eqllm` has no side effects
    assert imported > 60 and imported > 2 * kept, (imported, kept)
