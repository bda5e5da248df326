"""Recipe: the frozen, nested description of one training run, read from `recipes/<name>.toml`.

A recipe names a zoo variant (with overrides), the data, the optimizer and schedule, the batch,
the length of training, precision, checkpointing, evaluation and the seed. Everything is checked
when the recipe is loaded, before anything is compiled: an unknown key, a value of the wrong
type, an unknown variant or a missing data path fails with a message that names the key path
(`train.batch_size`) and what is allowed.

    recipe = load_recipe("quickstart", overrides=["train.steps=50"])
    recipe.train.steps  # 50
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import tomllib

from eqllm.config import ConfigError, ModelConfig
from eqllm.errors import EqllmError
from eqllm.resources import data_dir
from eqllm.sharding import MeshConfig

Schedule = Literal["cosine", "linear", "constant", "wsd"]
Precision = Literal["float32", "bfloat16"]
Remat = Literal["none", "full", "dots", "dots_no_batch"]
SourceKind = Literal["stdlib", "files", "jsonl", "hf"]


class RecipeError(EqllmError):
    """An invalid recipe; the message names the key path, the value and what is allowed."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which network to train.

    variant: a zoo name (`eqllm zoo list`).
    overrides: ModelConfig fields to change, e.g. `{ max_seq_len = 128 }`.
    init_from: start from these weights (a Hugging Face folder or hub repo, read with
        `eqllm.hub.from_pretrained`) instead of a random initialisation; "" for none.
    """

    variant: str
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    init_from: str = ""


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """A text source (the fields of `eqllm.data.DataSource`); `name` labels it in reports."""

    kind: SourceKind = "stdlib"
    path: str = ""
    name: str = ""
    config: str = ""
    split: str = "train"
    text_field: str = "text"
    glob: str = ""
    streaming: bool = False
    max_bytes: int = 0
    label: str = ""

    def to_source(self):
        """The `eqllm.data.DataSource` this spec describes (empty strings / 0 mean unset)."""
        from eqllm.data import DataSource

        return DataSource(
            kind=self.kind,
            path=self.path or None,
            text_field=self.text_field,
            name=self.name or None,
            config=self.config or None,
            split=self.split,
            streaming=self.streaming,
            glob=self.glob or None,
            max_bytes=self.max_bytes or None,
        )


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The training corpus and its tokenization.

    source: where the documents come from (default: the Python standard library, offline).
    tokenizer: "bytes", "bpe" (trained on the training split, saved into the run folder), a
        tokenizer.json path or folder, or a hub repo id.
    bpe_vocab_size: ids of the trained BPE; 0 means the variant's vocab_size.
    seq_len: tokens per training sequence (at most the model's max_seq_len).
    val_fraction: share of documents held out for validation (split by document).
    split_seed: seed of that split.
    cache_dir: where token files are cached; "" for $EQLLM_CACHE/tokens or ~/.cache/eqllm/tokens.
    """

    source: SourceSpec = dataclasses.field(default_factory=SourceSpec)
    tokenizer: str = "bpe"
    bpe_vocab_size: int = 0
    seq_len: int = 256
    val_fraction: float = 0.01
    split_seed: int = 0
    cache_dir: str = ""


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """AdamW with a learning-rate schedule and global-norm clipping.

    schedule: "cosine" (warmup, then cosine to lr * min_lr_ratio), "linear" (warmup, then linear
        decay), "constant" (warmup, then flat), "wsd" (warmup, flat, then linear decay over the
        last `decay_fraction` of the steps).
    weight_decay applies to Linear weights only (not to norms, biases or embeddings).
    clip_norm: global gradient-norm clip; 0 disables it.
    """

    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    schedule: Schedule = "cosine"
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """Batch, length of training, precision and the loop's cadence.

    batch_size: sequences per optimizer step (global); split into `grad_accum` micro-batches
        that are accumulated inside the compiled step.
    steps / tokens / tokens_per_param: the length of training; give exactly one (0 = unset).
        tokens_per_param counts the model's parameters (20 is the compute-optimal rule of thumb).
    precision: compute dtype of matmuls and activations; parameters stay float32.
    remat: jax.checkpoint policy per block ("none" keeps every activation).
    log_every, eval_every, checkpoint_every: cadence in steps (0 disables eval / periodic saves).
    keep_checkpoints: how many of the latest checkpoints to keep.
    compile_cache: JAX's persistent compilation cache folder; "" for $EQLLM_CACHE/jax or
        ~/.cache/eqllm/jax, "off" to disable it.
    skip_nonfinite: how many steps with a non-finite loss or gradient to skip (not applied,
        logged) before the run stops at the next one; 0 stops at the first.
    """

    batch_size: int = 16
    grad_accum: int = 1
    steps: int = 0
    tokens: int = 0
    tokens_per_param: float = 0.0
    seed: int = 0
    precision: Precision = "float32"
    remat: Remat = "none"
    log_every: int = 10
    eval_every: int = 200
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    compile_cache: str = ""
    skip_nonfinite: int = 0


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Evaluation during and after training.

    batches: validation batches per evaluation (0 = the whole validation split).
    batch_size: rows per evaluation batch; 0 means train.batch_size.
    extra_sources: more text sources scored at the end (tokenized with the run's tokenizer).
    sample_prompts, sample_tokens, temperature, top_k: text samples written to samples.txt.
    """

    batches: int = 20
    batch_size: int = 0
    extra_sources: tuple[SourceSpec, ...] = ()
    sample_prompts: tuple[str, ...] = ("def ", "import ", "class ")
    sample_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 40


@typing.no_type_check  # validated by `from_dict` with messages that name the key path
@dataclasses.dataclass(frozen=True)
class Recipe:
    """A complete training run. Build with `load_recipe` or `Recipe.from_dict`."""

    model: ModelSpec
    data: DataSpec = dataclasses.field(default_factory=DataSpec)
    optim: OptimSpec = dataclasses.field(default_factory=OptimSpec)
    train: TrainSpec = dataclasses.field(default_factory=TrainSpec)
    eval: EvalSpec = dataclasses.field(default_factory=EvalSpec)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    name: str = ""
    description: str = ""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Recipe:
        recipe = _build(cls, values, "")
        recipe.check()
        return recipe

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def to_toml(self) -> str:
        """The recipe as TOML text (loads back to an equal recipe)."""
        return _dump_toml(self.to_dict())

    def replace(self, path: str, value: Any) -> Recipe:
        """A copy with the field at `path` ("train.steps") set to `value` (checked)."""
        values = self.to_dict()
        _set_path(values, path, value)
        return Recipe.from_dict(values)

    # Derived values ---------------------------------------------------------------------------

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The variant with its overrides, precision and remat applied.

        vocab_size: the tokenizer's size; a model trained from scratch gets it (rounded up to a
        multiple of 64) unless the overrides set vocab_size explicitly.
        """
        from eqllm import zoo

        overrides = dict(self.model.overrides)
        overrides["compute_dtype"] = self.train.precision
        overrides["remat"] = self.train.remat
        if vocab_size is not None and "vocab_size" not in self.model.overrides:
            if not self.model.init_from:
                overrides["vocab_size"] = -(-vocab_size // 64) * 64
        try:
            return zoo.config(self.model.variant, **overrides)
        except KeyError as e:
            raise RecipeError(f"model.variant: {e.args[0]}") from None
        except ConfigError as e:
            raise RecipeError(f"model.overrides: {e}") from None

    def bpe_vocab_size(self) -> int:
        if self.data.bpe_vocab_size:
            return self.data.bpe_vocab_size
        return self.model_config().vocab_size

    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.data.seq_len

    def total_steps(self, n_params: int | None = None) -> int:
        """Optimizer steps: `train.steps`, or the token budget divided by tokens per step."""
        t = self.train
        if t.steps:
            return t.steps
        budget = t.tokens
        if t.tokens_per_param:
            if n_params is None:
                from eqllm import zoo

                n_params = zoo.param_count(self.model_config())
            budget = int(t.tokens_per_param * n_params)
        return max(1, math.ceil(budget / self.tokens_per_step()))

    # Cross-field checks -----------------------------------------------------------------------

    def check(self) -> None:
        """Checks that need several fields or the outside world (zoo, files)."""
        cfg = self.model_config()
        t, d, o, e = self.train, self.data, self.optim, self.eval
        given = [k for k in ("steps", "tokens", "tokens_per_param") if getattr(t, k)]
        _rule(
            len(given) == 1,
            "train.steps",
            given,
            "give exactly one of train.steps, train.tokens, train.tokens_per_param",
        )
        for key in ("batch_size", "grad_accum", "log_every", "keep_checkpoints"):
            _rule(getattr(t, key) > 0, f"train.{key}", getattr(t, key), "must be positive")
        for key in ("steps", "tokens", "tokens_per_param", "seed", "eval_every", "skip_nonfinite"):
            _rule(getattr(t, key) >= 0, f"train.{key}", getattr(t, key), "must be >= 0")
        _rule(t.checkpoint_every >= 0, "train.checkpoint_every", t.checkpoint_every, "must be >= 0")
        _rule(
            t.batch_size % t.grad_accum == 0,
            "train.grad_accum",
            t.grad_accum,
            f"must divide train.batch_size={t.batch_size}",
        )
        _rule(d.seq_len > 0, "data.seq_len", d.seq_len, "must be positive")
        _rule(
            d.seq_len <= cfg.max_seq_len,
            "data.seq_len",
            d.seq_len,
            f"must be at most the model's max_seq_len={cfg.max_seq_len}",
        )
        _rule(0 <= d.val_fraction < 1, "data.val_fraction", d.val_fraction, "must be in [0, 1)")
        _rule(
            d.bpe_vocab_size == 0 or d.bpe_vocab_size >= 257,
            "data.bpe_vocab_size",
            d.bpe_vocab_size,
            "must be 0 (the variant's vocab_size) or at least 257",
        )
        _check_tokenizer(d.tokenizer)
        _check_source(d.source, "data.source")
        for i, extra in enumerate(e.extra_sources):
            _check_source(extra, f"eval.extra_sources[{i}]")
        _rule(o.lr > 0, "optim.lr", o.lr, "must be positive")
        _rule(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
        _rule(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
        _rule(
            0 < o.decay_fraction <= 1, "optim.decay_fraction", o.decay_fraction, "must be in (0, 1]"
        )
        _rule(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
        for key in ("b1", "b2"):
            _rule(0 <= getattr(o, key) < 1, f"optim.{key}", getattr(o, key), "must be in [0, 1)")
        _rule(o.eps > 0, "optim.eps", o.eps, "must be positive")
        _rule(o.clip_norm >= 0, "optim.clip_norm", o.clip_norm, "must be >= 0 (0: no clipping)")
        for key in ("batches", "batch_size", "sample_tokens", "top_k"):
            _rule(getattr(e, key) >= 0, f"eval.{key}", getattr(e, key), "must be >= 0")
        _rule(e.temperature >= 0, "eval.temperature", e.temperature, "must be >= 0 (0: greedy)")


# Loading ------------------------------------------------------------------------------------


def recipe_names() -> list[str]:
    """The recipes shipped in recipes/ (without .toml)."""
    return sorted(p.stem for p in data_dir("recipes").glob("*.toml"))


def recipe_path(name_or_path: str | os.PathLike) -> Path:
    """A path to a .toml file, or the shipped recipe of that name; unknown names list close ones."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"recipe file {str(path)!r} does not exist")
        return path
    shipped = data_dir("recipes") / f"{name_or_path}.toml"
    if shipped.is_file():
        return shipped
    names = recipe_names()
    close = difflib.get_close_matches(str(name_or_path), names, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise FileNotFoundError(
        f"no recipe named {str(name_or_path)!r}; {hint}shipped recipes: {', '.join(names)} "
        "(or give a path to a .toml file)"
    )


def load_recipe(name_or_path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()):
    """Read a recipe by shipped name or path, apply `key=value` overrides, validate it all."""
    path = recipe_path(name_or_path)
    try:
        with path.open("rb") as f:
            values = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML: {e}") from None
    values.setdefault("name", path.stem)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"--set {item!r}: expected key=value, e.g. train.steps=100")
        _set_path(values, key.strip(), parse_value(text.strip()))
    try:
        return Recipe.from_dict(values)
    except RecipeError as e:
        raise RecipeError(f"{path.name}: {e}") from None


def parse_value(text: str) -> Any:
    """A --set value: a TOML literal (100, 3e-4, true, "x", [1, 2], {a = 1}) or a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(values: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node = values
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"{'.'.join(parts[: i + 1])} is not a table; cannot set {path}")
        node = child
    node[parts[-1]] = value


# Typed construction -------------------------------------------------------------------------


def _rule(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise RecipeError(f"{key}={value!r} {rule}")


def _build(cls: type, values: Any, prefix: str):
    where = prefix.rstrip(".") or "the recipe"
    if not isinstance(values, dict):
        raise RecipeError(f"{where} must be a table, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    # Annotations are strings (postponed); typing.get_type_hints ignores @no_type_check classes.
    hints = {
        n: eval(f.type, globals()) if isinstance(f.type, str) else f.type for n, f in fields.items()
    }
    unknown = [k for k in values if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
        hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
        raise RecipeError(
            f"unknown key '{prefix}{key}' in {where}; {hint}allowed: {', '.join(fields)}"
        )
    kwargs = {}
    for name, field in fields.items():
        if name not in values:
            if (
                field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            ):
                raise RecipeError(f"{where} is missing the required key {prefix}{name!r}")
            continue
        kwargs[name] = _convert(values[name], hints[name], f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own validation (e.g. MeshConfig)
        raise RecipeError(f"{where}: {e}") from None


def _type_name(tp) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a table"
    if get_origin(tp) is tuple:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if get_origin(tp) is dict:
        return "a table"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp, key: str):
    origin = get_origin(tp)
    bad = RecipeError(f"{key}={value!r} must be {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    if origin is Literal:
        if value not in get_args(tp):
            raise bad
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad
        item = get_args(tp)[0]
        return tuple(_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported recipe field type {tp}")
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        if not math.isfinite(value):
            raise RecipeError(f"{key}={value!r} must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise TypeError(f"unsupported recipe field type {tp}")


def _check_tokenizer(spec: str) -> None:
    if spec in ("bytes", "bpe"):
        return
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "tokenizer.json").is_file():
            raise RecipeError(f"data.tokenizer={spec!r}: folder has no tokenizer.json")
        return
    looks_like_repo = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    _rule(
        looks_like_repo,
        "data.tokenizer",
        spec,
        "is not 'bytes', 'bpe', an existing tokenizer.json path or folder, or a hub repo id "
        "(org/name)",
    )


def _check_source(spec: SourceSpec, key: str) -> None:
    try:
        spec.to_source()
    except ValueError as e:
        raise RecipeError(f"{key}: {e}") from None
    if spec.kind in ("files", "jsonl"):
        import glob

        if not (Path(spec.path).expanduser().exists() or glob.glob(spec.path)):
            raise RecipeError(
                f"{key}.path={spec.path!r} does not exist; point it at a file, folder or glob "
                "pattern of text"
            )
    _rule(spec.max_bytes >= 0, f"{key}.max_bytes", spec.max_bytes, "must be >= 0 (0: no cap)")


# TOML output --------------------------------------------------------------------------------


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _dump_toml(values: dict, prefix: str = "") -> str:
    lines, tables = [], []
    for key, value in values.items():
        if isinstance(value, dict) and key != "overrides":
            tables.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    out = "\n".join(lines) + ("\n" if lines else "")
    for key, value in tables:
        out += f"\n[{prefix}{key}]\n" + _dump_toml(value, f"{prefix}{key}.")
    return out
