"""LoRA adapters in PEFT's format, both ways: `save_adapter` and `load_adapter`.

A PEFT adapter folder holds `adapter_config.json` (`peft_type: "LORA"`, `r`, `lora_alpha`,
`target_modules`, optional per-module `rank_pattern` / `alpha_pattern`) and
`adapter_model.safetensors` with `base_model.model.<module path>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r] per adapted module (scale = alpha / r). The module paths come from the
family's key table (`eqllm.families`), as for the base weights.

A fused Hugging Face module (GPT-2's `c_attn`: q, k and v in one) holds one A and one B. On the
way in, each eqllm projection gets that A and its rows of B. On the way out, adapters whose A
matrices are equal are written the same way; trained apart, they are written exactly as one
adapter of rank k * r (A stacked, B block-diagonal), with `rank_pattern`/`alpha_pattern` saying
so.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from eqllm import families
from eqllm.families import Row
from eqllm.hub.tables import fused_order, stack_layers
from eqllm.lora import LoraError, LoraLinear, adapters, get_path, is_lora, module_names
from eqllm.model import CausalLM
from eqllm.nn import Linear

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
ADAPTER_FILES = [CONFIG_FILE, WEIGHTS_FILE]


def _module_rows(family: str, experts: bool | None = None) -> list[Row]:
    """The key-table rows of linear weights (those `eqllm.lora` can adapt) that are modules of
    their own in transformers: one expert's weight (`experts.{j}.w1`) is a slice of a stacked
    parameter there, which PEFT's LoRA does not adapt."""
    names = module_names(family, experts)
    return [
        r
        for r in families.get(family).table
        if (experts is None or r.experts in (None, experts))
        and r.hf.endswith(".weight")
        and "{j}" not in r.hf
        and tuple(p.removesuffix(".weight") for p in r.eqllm)
        in names.get(r.hf.removesuffix(".weight").rsplit(".", 1)[-1], [])
    ]


def _module(row: Row, family: str) -> str:
    """The module a row's weight belongs to, as transformers names it in the model it builds
    (and PEFT in an adapter): the checkpoint's name, unless the family renames it on load."""
    module = row.hf.removesuffix(".weight")
    return families.get(family).module_renames.get(module, module)


def _instances(row: Row, config) -> list[tuple[int | None, str]]:
    """(index in its stack or None, PEFT module path) for each module a row stands for; a
    layered row fills its own stack (DeepSeek's dense prefix, or the layers after it)."""
    module = _module(row, config.family)
    if row.layered:
        layers = stack_layers(row, config)
        return [(i, _PREFIX + module.format(i=n)) for i, n in enumerate(layers)]
    return [(None, _PREFIX + module)]


def _short(row: Row, family: str) -> str:
    return _module(row, family).rsplit(".", 1)[-1]


def save_adapter(
    model: CausalLM, directory: str | os.PathLike, *, base_model: str | None = None
) -> Path:
    """Write `model`'s adapters as a PEFT folder (`peft.PeftModel.from_pretrained` loads it).

    `base_model` is recorded as `base_model_name_or_path`. Returns the folder.
    """
    found = adapters(model)
    if not found:
        raise LoraError("the model has no LoRA adapters to save (see eqllm.lora.apply)")
    cfg = model.config
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, tuple[int, float]] = {}  # module name -> (rank, alpha)
    covered: set[str] = set()
    for row in _module_rows(cfg.family, cfg.moe is not None):
        paths = [p.removesuffix(".weight") for p in row.eqllm]
        parts = [found.get(p) for p in paths]
        if all(a is None for a in parts):
            continue
        if any(a is None for a in parts) or len({a.scale for a in parts}) != 1:
            raise LoraError(
                f"{_short(row, cfg.family)}: the fused module {paths} must be adapted as a "
                "whole, with one scale; adapt it by its Hugging Face name"
            )
        covered.update(paths)
        a_parts = [np.asarray(a.lora_a.weight, np.float32) for a in parts]
        b_parts = [np.asarray(a.lora_b.weight, np.float32) for a in parts]
        shared = all(np.array_equal(a_parts[0], a) for a in a_parts[1:])
        for i, module in _instances(row, cfg):
            a_s = [a if i is None else a[i] for a in a_parts]
            b_s = [b if i is None else b[i] for b in b_parts]
            if shared:
                a_out, b_out = a_s[0], np.concatenate(b_s, axis=0)
            else:  # exact as one adapter of the summed rank: [A1; A2; ...], diag(B1, B2, ...)
                a_out = np.concatenate(a_s, axis=0)
                b_out = np.zeros((sum(b.shape[0] for b in b_s), a_out.shape[0]), np.float32)
                o = r = 0
                for b in b_s:
                    b_out[o : o + b.shape[0], r : r + b.shape[1]] = b
                    o, r = o + b.shape[0], r + b.shape[1]
            order = fused_order(row, [b.shape[0] for b in b_s], cfg.at(row.heads))
            if order is not None:  # B's rows interleaved per head, as the fused weight's
                b_out = b_out[order]
            tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(a_out)
            tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(b_out)
        rank = a_out.shape[0]
        ranks.setdefault(_short(row, cfg.family), (rank, parts[0].scale * rank))
    missing = sorted(set(found) - covered)
    if missing:
        raise LoraError(f"adapters at {missing} have no Hugging Face module name; merge them")
    (rank, alpha), *_ = ranks.values()
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(ranks),
        "rank_pattern": {k: r for k, (r, _) in ranks.items() if r != rank},
        "alpha_pattern": {k: a for k, (_, a) in ranks.items() if a != alpha},
        "lora_dropout": next(iter(found.values())).dropout,
        "bias": "none",
        "fan_in_fan_out": any(r.conv1d for r in _module_rows(cfg.family, cfg.moe is not None)),
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(model.embed.weight.dtype)
    save_file({k: v.astype(dtype) for k, v in tensors.items()}, str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank/alpha pattern lookup: a key matches the module path's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module.removeprefix(_PREFIX)):
            return value
    return default


def read_adapter_config(folder: Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"{folder} has no {CONFIG_FILE}; give a PEFT adapter folder")
    config = json.loads(file.read_text())
    if config.get("peft_type") != "LORA":
        raise LoraError(f"{file}: peft_type={config.get('peft_type')!r}; eqllm reads only 'LORA'")
    unsupported = {
        "use_dora": (False, None),
        "bias": ("none", None),
        "modules_to_save": (None, []),
        "layers_to_transform": (None,),
    }
    for key, allowed in unsupported.items():
        if config.get(key) not in allowed:
            raise LoraError(
                f"{file}: {key}={config[key]!r} is not supported; eqllm reads plain LoRA "
                f"adapters ({key} one of {list(allowed)})"
            )
    return config


def _check_base_copy(file: Path, name: str, tensors: dict, base: Linear, row: Row) -> None:
    """peft saves the base weights of an adapted output layer (`lm_head`) with the adapter; eqllm
    applies adapters to the model's own weights, so the copy must be those weights."""
    own = np.asarray(base.weight, np.float32)
    copy = tensors[name].astype(np.float32)
    if row.conv1d:
        copy = copy.T
    if copy.shape != own.shape or not np.array_equal(copy, own):
        raise LoraError(
            f"{file}: {name} {list(copy.shape)} is not the base model's {row.hf} "
            f"{list(own.shape)} (an adapter trained with other output weights, a resized "
            "vocabulary?); load it on the base model it was made for"
        )


def load_adapter(model: CausalLM, directory: str | os.PathLike) -> CausalLM:
    """`model` with the PEFT adapter in `directory` applied (any rank, alpha, targets).

    Raises LoraError naming the tensor and both shapes when the adapter does not fit the model,
    and naming the tensors the model has no module for.
    """
    folder = Path(directory)
    config = read_adapter_config(folder)
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise LoraError(f"{folder} has no {WEIGHTS_FILE}")
    tensors = load_file(str(file))
    tensors = {re.sub(r"\.lora_([AB])\.default\.", r".lora_\1.", k): v for k, v in tensors.items()}
    cfg = model.config
    for old, new in families.get(cfg.family).module_renames.items():  # older transformers' name
        was = re.compile(re.escape(f"{_PREFIX}{old}."))
        tensors = {was.sub(f"{_PREFIX}{new}.", k, count=1): v for k, v in tensors.items()}
    used: set[str] = set()
    replace: dict[str, LoraLinear] = {}
    for row in _module_rows(cfg.family, cfg.moe is not None):
        instances = _instances(row, cfg)
        present = [f"{m}.lora_A.weight" in tensors for _, m in instances]
        if not any(present):
            continue
        if not all(present):
            missing = [m for (_, m), p in zip(instances, present, strict=True) if not p][:3]
            raise LoraError(f"{file}: adapter covers only some layers; missing {missing} ...")
        bases: list[Linear] = [get_path(model, p.removesuffix(".weight")) for p in row.eqllm]
        if not all(isinstance(b, Linear | LoraLinear) for b in bases):
            raise LoraError(
                f"{file}: {instances[0][1]} adapts a module this model does not have "
                f"({row.eqllm}; a tied head, say)"
            )
        if any(is_lora(b) for b in bases):
            raise LoraError(f"the model already has adapters at {row.eqllm}; merge them first")
        a_layers, b_layers = [], []
        for _, module in instances:
            a, b = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
            used.update({f"{module}.lora_A.weight", f"{module}.lora_B.weight"})
            if f"{module}.base_layer.weight" in tensors and len(bases) == 1 and not row.layered:
                _check_base_copy(file, f"{module}.base_layer.weight", tensors, bases[0], row)
                used.add(f"{module}.base_layer.weight")
            d_in = bases[0].weight.shape[-1]
            d_out = sum(x.weight.shape[-2] for x in bases)
            if a.ndim != 2 or b.ndim != 2 or a.shape[1] != d_in or b.shape != (d_out, a.shape[0]):
                raise LoraError(
                    f"{file}: {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not "
                    f"fit the base weight [{d_out}, {d_in}] (expected A [r, {d_in}], "
                    f"B [{d_out}, r]); the adapter was trained for another base model"
                )
            a_layers.append(a)
            b_layers.append(b)
        rank = a_layers[0].shape[0]
        module = instances[0][1]
        alpha = _pattern(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
        scale = alpha / (rank**0.5 if config.get("use_rslora") else rank)
        a_all, b_all = np.stack(a_layers), np.stack(b_layers)
        order = fused_order(row, [b.weight.shape[-2] for b in bases], cfg.at(row.heads))
        if order is not None:  # B's rows interleaved per head -> the parts one after the other
            b_all = np.take(b_all, np.argsort(order), axis=-2)
        if not row.layered:
            a_all, b_all = a_all[0], b_all[0]
        offset = 0
        for path, base in zip(row.eqllm, bases, strict=True):
            rows_out = base.weight.shape[-2]
            b_part = b_all[..., offset : offset + rows_out, :]
            offset += rows_out
            dtype = base.weight.dtype
            adapter = LoraLinear(base, rank=rank, alpha=scale * rank, key=jax.random.key(0))
            adapter = eqx.tree_at(
                lambda m: (m.lora_a.weight, m.lora_b.weight),
                adapter,
                (jnp.asarray(a_all, dtype), jnp.asarray(b_part, dtype)),
            )
            replace[path.removesuffix(".weight")] = adapter
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise LoraError(
            f"{file}: tensors {unexpected[:4]} match no linear module of this {cfg.family} "
            f"model ({len(unexpected)} in all); the adapter was made for another architecture"
        )
    if not replace:
        raise LoraError(f"{file} holds no LoRA tensors")
    return eqx.tree_at(lambda m: [get_path(m, p) for p in replace], model, list(replace.values()))
