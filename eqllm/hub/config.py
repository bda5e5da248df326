"""Hugging Face config.json <-> ModelConfig, driven by the family files.

`to_hf_config` writes the `config.json` dict transformers expects; `from_hf_config` reads one
back and refuses settings it does not understand, instead of silently building a different
model. What differs between families is in `eqllm/families/<name>.py`.
"""

from __future__ import annotations

import logging
from typing import Any

from eqllm import families
from eqllm.config import ConfigError, ModelConfig
from eqllm.families.base import COMMON_KEYS, is_metadata
from eqllm.families.mamba2 import from_mamba_ssm, is_mamba_ssm

log = logging.getLogger("eqllm.hub")


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers `config.json` contents for `cfg` (raises if HF has no such model)."""
    family = families.get(cfg.family)
    wrong = {k: cfg.at(k) for k, v in family.fixed.items() if cfg.at(k) != v}
    wrong.update(family.check(cfg))
    if wrong:
        raise ConfigError(
            f"this {cfg.family} config has no Hugging Face equivalent: {wrong} differ from what "
            f"{family.architecture} fixes ({family.fixed})"
        )
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": cfg.param_dtype,
        **family.to_hf(cfg),
    }


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a transformers `config.json` dict; unsupported settings are errors.

    A key that the family does not read and that is not metadata (`families.base.is_metadata`:
    token ids, private names, transformers' bookkeeping and generation defaults) is refused,
    naming the key.
    """
    hf = language_model(hf)
    if is_mamba_ssm(hf):  # state-spaces' Mamba-2 releases: mamba_ssm's own config.json
        hf = from_mamba_ssm(hf)
    family = families.for_model_type(hf.get("model_type"))
    # transformers 4's PretrainedConfig writes `pruned_heads` (attention heads removed, per
    # layer) into every full dump of a config; empty, it is bookkeeping like the rest.
    if hf.get("pruned_heads"):
        raise ConfigError(
            f"config.json pruned_heads={hf['pruned_heads']!r} is not supported: eqllm builds "
            "every attention head of every layer; use a checkpoint without pruned heads"
        )
    hf = {k: v for k, v in hf.items() if k != "pruned_heads"}
    known = COMMON_KEYS | family.hf_keys
    unknown = sorted(k for k in hf if k not in known and not is_metadata(k))
    if unknown:
        raise ConfigError(
            f"config.json has {family.name} setting(s) eqllm does not understand: {unknown}; "
            "refusing rather than building a model that may compute something else"
        )
    hf = {**family.defaults, **hf}
    return ModelConfig.from_dict({**family.fixed, **family.from_hf(hf), "family": family.name})


def language_model(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json of a vision-language one whose `model_type` a family
    names as its `wrapper` (its `text_config`, tied as the outer file says where it does not);
    any other `hf` as it is. Says in one line what is left out."""
    wrapped = next((f for f in families.every() if f.wrapper == hf.get("model_type")), None)
    if wrapped is None or not isinstance(hf.get("text_config"), dict):
        return hf
    text = dict(hf["text_config"])
    text.setdefault("model_type", wrapped.model_type)
    if "tie_word_embeddings" in hf:
        text.setdefault("tie_word_embeddings", hf["tie_word_embeddings"])
    left = sorted(k for k in hf if k.endswith("_config") and k != "text_config")
    log.warning(
        "%s config.json: reading the language model (text_config) as %s; left out: %s "
        "(the vision tower)",
        hf["model_type"],
        wrapped.architecture,
        ", ".join(left) or "rest",
    )
    return text
