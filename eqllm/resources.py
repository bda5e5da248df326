"""Where eqllm's files live: the shipped data folders (zoo/, recipes/) and the caches."""

import os
from pathlib import Path

import jax


def data_dir(name: str) -> Path:
    """`eqllm/_data/<name>` in an installed wheel, else `<repo>/<name>` in a source checkout."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "_data" / name, package.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"eqllm's '{name}' folder was not found next to the package ({package}); "
        "reinstall eqllm (pip install eqllm, or pip install -e . from a checkout)"
    )


def cache_root() -> Path:
    """``$EQLLM_CACHE`` if set, else ``~/.cache/eqllm``."""
    root = os.environ.get("EQLLM_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "eqllm"


def setup_compile_cache(setting: str) -> Path | None:
    """Turn on JAX's persistent compilation cache ("" = default folder, "off" = disabled)."""
    if setting == "off":
        return None
    path = Path(setting).expanduser() if setting else cache_root() / "jax"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Every program, however quick to compile: the first token of `eqllm generate` needs about
    # a dozen small ones (under 0.1 s each), which a threshold would compile again each run.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
