"""The import layers: `import eqllm.nn` stays light, `import eqllm` loads its parts on demand.

The full layer order is checked by import-linter (`lint-imports`, contract in pyproject.toml);
these tests check what a user importing the package sees.
"""

import subprocess
import sys

LOADED = (
    "import sys, {what}; print(' '.join(sorted(m for m in sys.modules if m.startswith('eqllm'))))"
)


def loaded_after(what: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", LOADED.format(what=what)], capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


def under(modules: set[str], package: str) -> set[str]:
    return {m for m in modules if m == package or m.startswith(package + ".")}


def test_import_nn_loads_no_training_evaluation_hub_or_recipe_code():
    loaded = loaded_after("eqllm.nn")
    assert "eqllm.nn.attention" in loaded  # the check itself works
    for package in (
        "eqllm.train",
        "eqllm.eval",
        "eqllm.hub",
        "eqllm.recipe",
        "eqllm.data",
        "eqllm.generation",
        "eqllm.sharding",
        "eqllm.zoo",
        "eqllm.model",
    ):
        assert not under(loaded, package), (
            f"import eqllm.nn loaded {sorted(under(loaded, package))}"
        )


def test_import_eqllm_loads_parts_on_first_use():
    assert loaded_after("eqllm") == {"eqllm"}
    loaded = loaded_after("eqllm; eqllm.zoo.names()")
    assert "eqllm.zoo" in loaded and not under(loaded, "eqllm.train")
