"""`eqllm serve BASE --adapter name=path ...`: the adapters a server holds beside its base model.

Each `path` is a PEFT LoRA folder (`adapter_config.json` and `adapter_model.safetensors`, read
by `eqllm.hub.load_adapter`) or a LoRA run folder written by `eqllm run` (its latest
checkpoint). They are stacked over the one copy of the base weights
(`eqllm.generation.adapters`); a request names one by its `model` field. Anything that cannot
be served fails here, at start-up, in one line naming the option.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from eqllm import loading
from eqllm.errors import EqllmError
from eqllm.generation.adapters import stack_adapters
from eqllm.hub import load_adapter
from eqllm.hub.adapters import CONFIG_FILE
from eqllm.lora import adapters
from eqllm.model import CausalLM

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


def parse_specs(specs: Sequence[str], base_name: str) -> list[tuple[str, str]]:
    """(name, path) of each `name=path`; EqllmError for a malformed, duplicated or base name."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not path or not NAME.fullmatch(name):
            raise EqllmError(
                f"--adapter {spec!r}: give name=path, e.g. --adapter sql=./sql-lora (a name of "
                "letters, digits and ._:/- and a PEFT folder or eqllm LoRA run folder)"
            )
        if name == base_name or name in (n for n, _ in out):
            raise EqllmError(
                f"--adapter {spec!r}: the name {name!r} is already taken "
                f"({'the base model' if name == base_name else 'another adapter'}); "
                "give each adapter its own name"
            )
        out.append((name, path))
    return out


def load_adapters(base: CausalLM, specs: Sequence[tuple[str, str]]) -> CausalLM:
    """`base` with every adapter of `specs` stacked over it (adapter i + 1 is specs[i])."""
    models = []
    for name, path in specs:
        try:
            models.append(_load(base, Path(path)))
        except EqllmError as e:
            raise EqllmError(f"--adapter {name}={path}: {e}") from None
    try:
        return stack_adapters(base, models, [name for name, _ in specs])
    except EqllmError as e:
        raise EqllmError(f"--adapter: {e}") from None


def _load(base: CausalLM, path: Path) -> CausalLM:
    if not path.exists():
        raise EqllmError("no such file or folder; give a PEFT adapter folder or a LoRA run folder")
    if loading.run_folder_of(path) is not None:
        model, _ = loading.load(path)
        if not adapters(model):
            raise EqllmError("this run trained no LoRA adapters (finetune.method is not 'lora')")
        return model
    if (path / CONFIG_FILE).is_file():
        return load_adapter(base, path)
    raise EqllmError(
        f"neither a PEFT adapter folder (no {CONFIG_FILE}) nor an eqllm run folder; give one"
    )
