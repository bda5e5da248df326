"""Where the shipped data folders (zoo/, recipes/) live: inside the wheel or the source tree."""

from pathlib import Path


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
