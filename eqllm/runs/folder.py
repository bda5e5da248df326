"""The run folder `eqllm run` writes, and reading one back with nothing but the folder.

A run folder holds (format 1; `FORMAT_VERSION`):

| file | what |
|---|---|
| `run.json` | format version, objective, LoRA settings, prompting (chat turns or text) |
| `config.toml` | the recipe, resolved (every field written out) |
| `model_config.json` | the exact architecture (`ModelConfig`) |
| `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja` | tokenizer, chat template |
| `checkpoints/<step>/` | orbax: `state` (model, optimizer), `meta` (`eqllm.runs.checkpoints`) |
| `heldout.npz` | the held-out tokens the run evaluates on (`eqllm.runs.heldout`) |
| `metrics.jsonl`, `tensorboard/` | the metrics of every logged step and evaluation |
| `summary.json`, `report.md`, `*.png`, `samples.txt`, `samples_before.json` | the end of the run |
| `reference_logps.npz`, `rollouts.npz` | an objective's state, for an exact resume |

Reading one (`RunFolder.load_model`, `tokenizer`, `recipe`) needs nothing outside the folder:
the weights restore into a model built from `model_config.json` and the adapters' settings,
without an optimizer, without the recipe's data or tokenizer sources and wherever the folder
was moved. Folders written before `run.json` existed (format 0: config.toml,
model_config.json, tokenizer.json and checkpoints) read the same way, the adapters taken from
the recipe's `[finetune]`. A folder of a newer format is refused, naming the upgrade.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import jax
import tomllib

from eqllm import lora
from eqllm.config import ModelConfig
from eqllm.data import Tokenizer
from eqllm.data.chat import read_chat_template
from eqllm.model import CausalLM
from eqllm.recipe import Recipe, RecipeError, apply_overrides
from eqllm.runs.checkpoints import Checkpointer
from eqllm.runs.errors import MissingRunFile, NewerRunFormat, RunFolderError
from eqllm.runs.files import atomic_write_text
from eqllm.runs.heldout import HeldOut

FORMAT_VERSION = 1


def _eqllm_version() -> str:
    try:
        return importlib.metadata.version("eqllm")
    except importlib.metadata.PackageNotFoundError:  # a source tree on the path, not installed
        return "unknown"


@dataclasses.dataclass(frozen=True)
class Adapters:
    """The LoRA adapters of a run's model (`eqllm.lora.apply`'s settings)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    def apply(self, model, *, key=None):
        """`model` with these adapters (B = 0: the identity until trained)."""
        return lora.apply(
            model,
            rank=self.rank,
            alpha=self.alpha,
            targets=list(self.targets),
            dropout=self.dropout,
            key=jax.random.key(0) if key is None else key,
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Adapters:
        return cls(
            int(values["rank"]),
            float(values["alpha"]),
            tuple(values["targets"]),
            float(values.get("dropout", 0.0)),
        )

    @classmethod
    def of(cls, recipe: Recipe) -> Adapters | None:
        """The adapters a recipe trains (finetune.method "lora"), else None."""
        f = recipe.finetune
        if f.method != "lora":
            return None
        return cls(f.rank, f.alpha, tuple(f.targets), f.dropout)


class RunFolder:
    """The run folder at `path` (see the module docstring): its files, read and written here.

    Reading never writes; each reader checks the format version first.
    """

    RUN_FILE = "run.json"
    CONFIG_FILE = "config.toml"
    MODEL_CONFIG_FILE = "model_config.json"
    TOKENIZER_FILE = "tokenizer.json"
    HELDOUT_FILE = "heldout.npz"
    METRICS_FILE = "metrics.jsonl"
    TENSORBOARD_DIR = "tensorboard"
    SUMMARY_FILE = "summary.json"
    REPORT_FILE = "report.md"
    SAMPLES_FILE = "samples.txt"
    SAMPLES_BEFORE_FILE = "samples_before.json"
    LOSS_PLOT = "loss.png"
    EXPERT_LOAD_PLOT = "expert_load.png"
    OBJECTIVE_PLOT = "objective.png"
    EMA_DIR = "ema"  # optim.ema: the averaged weights as an eqllm model folder, with tokenizer

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    def file(self, name: str) -> Path:
        """The path of the folder's file `name` (one of the names above, or an objective's own
        state file, e.g. "rollouts.npz")."""
        return self.path / name

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def metrics_file(self) -> Path:
        return self.path / self.METRICS_FILE

    @property
    def report_file(self) -> Path:
        return self.path / self.REPORT_FILE

    @property
    def summary_file(self) -> Path:
        return self.path / self.SUMMARY_FILE

    # Which folders are runs --------------------------------------------------------------------

    @staticmethod
    def is_run(path: str | os.PathLike) -> bool:
        """Whether `path` is a run folder (a recipe and a checkpoints folder)."""
        folder = Path(path).expanduser()
        return (folder / RunFolder.CONFIG_FILE).is_file() and (folder / "checkpoints").is_dir()

    @staticmethod
    def of(spec: str | os.PathLike) -> tuple[RunFolder, int | None] | None:
        """(run folder, step or None) when `spec` names a run folder or one of its checkpoints
        (`RUN/checkpoints/STEP`), else None."""
        path = Path(spec).expanduser()
        if RunFolder.is_run(path):
            return RunFolder(path), None
        if path.parent.name == "checkpoints" and path.name.isdigit():
            if (path.parent.parent / RunFolder.CONFIG_FILE).is_file():
                return RunFolder(path.parent.parent), int(path.name)
        return None

    # Reading ----------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """run.json ({} for a format-0 folder, written before it existed); `NewerRunFormat`
        when a newer eqllm wrote the folder."""
        file = self.file(self.RUN_FILE)
        if not file.is_file():
            return {}
        info = json.loads(file.read_text())
        version = info.get("format")
        if not isinstance(version, int) or version < 1:
            raise RunFolderError(
                f"{file}: 'format' is {version!r}, not a run-folder format version; the file "
                "is damaged: restore it, or delete it to read the folder as an older one"
            )
        if version > FORMAT_VERSION:
            raise NewerRunFormat(
                f"{self.path} is a run folder of format {version}, written by eqllm "
                f"{info.get('eqllm', '(newer)')}; this eqllm ({_eqllm_version()}) reads formats up "
                f"to {FORMAT_VERSION}: upgrade eqllm (pip install -U eqllm) to read it"
            )
        return info

    @property
    def format_version(self) -> int:
        """The folder's format version: 0 for folders written before run.json."""
        return int(self.info().get("format", 0))

    def recipe_values(self) -> dict[str, Any]:
        """config.toml as plain values, unchecked."""
        file = self._require(self.CONFIG_FILE, "the run's recipe")
        try:
            return tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as e:
            raise RunFolderError(f"{file}: not valid TOML ({e}); restore the file") from None

    def recipe(self, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
        """The run's recipe (with `key=value` overrides), checked without the outside world:
        its data and tokenizer sources need not exist here."""
        self.info()
        values = self.recipe_values()
        apply_overrides(values, overrides)
        try:
            return Recipe.from_dict(values, inputs=False)
        except RecipeError as e:
            raise RecipeError(f"{self.file(self.CONFIG_FILE)}: {e}") from None

    def objective(self) -> str:
        """The objective the run trained ("lm", "sft", "dpo", ...)."""
        return self.info().get("objective") or self.recipe().train.objective

    def model_config(self) -> ModelConfig:
        """The exact architecture of the run's model."""
        self.info()
        file = self.path / self.MODEL_CONFIG_FILE
        if not file.is_file():
            raise MissingRunFile(
                f"run folder {self.path} has no {self.MODEL_CONFIG_FILE}: it was written by an "
                "eqllm older than the file, or is incomplete; continue the run once with "
                "`eqllm run RECIPE --out FOLDER --resume` (it writes the file) to read it"
            )
        return ModelConfig.from_dict(json.loads(file.read_text()))

    def adapters(self) -> Adapters | None:
        """The settings of the model's LoRA adapters, None without."""
        info = self.info()
        if info:  # format 1 and later record them
            return Adapters.from_dict(info["adapters"]) if info.get("adapters") else None
        return Adapters.of(self.recipe())

    def prompts_in_chat(self) -> bool:
        """Whether the model is prompted with chat turns (it was trained on chat rows: the
        run's samples ask that way), rather than with plain text."""
        info = self.info()
        if info:
            return info.get("prompts") == "chat"
        # Format 0: instruction and preference data were chat rows.
        return self.recipe().train.objective in ("sft", "dpo", "ipo", "simpo")

    def tokenizer(self) -> Tokenizer:
        """The run's tokenizer, with the chat template its rows were formatted with."""
        self.info()
        self._require(
            self.TOKENIZER_FILE,
            "the tokenizer",
            "it was not written by `eqllm run` or is incomplete (rerun `eqllm run ... --resume` "
            "to complete it)",
        )
        return Tokenizer.load(self.path)

    def chat_template(self) -> str | None:
        """The chat template saved with the tokenizer, None without one."""
        return read_chat_template(self.path)

    def steps(self) -> list[int]:
        """The steps of the run's checkpoints, oldest first."""
        return self._checkpointer_call(lambda c: c.steps())

    def read_meta(self, step: int | None = None) -> dict:
        """The meta of checkpoint `step` (default latest): step, seed, recipe, ..."""
        return self._checkpointer_call(lambda c: c.read_meta(step))

    def load_model(self, step: int | None = None) -> tuple[CausalLM, dict]:
        """(model, checkpoint meta) at `step` (default the latest), adapters included: the
        architecture from model_config.json, the weights from the checkpoint, nothing else."""
        model = CausalLM(self.model_config(), key=jax.random.key(0))
        adapters = self.adapters()
        if adapters is not None:
            model = adapters.apply(model)
        return self._checkpointer_call(lambda c: c.restore_model(model, step))

    def heldout(self) -> HeldOut | None:
        """The held-out tokens the run evaluates on (None in folders written before them)."""
        self.info()
        file = self.file(self.HELDOUT_FILE)
        return HeldOut.read(file) if file.is_file() else None

    def _checkpointer_call(self, read):
        self.info()
        checkpointer = Checkpointer(self.checkpoints, read_only=True)
        try:
            return read(checkpointer)
        finally:
            checkpointer.close()

    def _require(self, name: str, what: str, why: str | None = None) -> Path:
        file = self.path / name
        if not file.is_file():
            raise MissingRunFile(
                f"run folder {self.path} has no {name} ({what}); "
                + (why or "give the --out folder of `eqllm run`, or restore the file")
            )
        return file

    # Writing (by `eqllm run`) -----------------------------------------------------------------

    def write_run(self, *, objective: str, adapters: Adapters | None, chat: bool) -> None:
        """run.json: this format's version, the objective, the adapters' settings and how the
        model is prompted (`chat`: with chat turns, else plain text)."""
        info = {
            "format": FORMAT_VERSION,
            "eqllm": _eqllm_version(),
            "objective": objective,
            "adapters": None if adapters is None else adapters.to_dict(),
            "prompts": "chat" if chat else "text",
        }
        atomic_write_text(self.file(self.RUN_FILE), json.dumps(info, indent=2) + "\n")

    def write_recipe(self, recipe: Recipe) -> None:
        """config.toml: the resolved recipe."""
        atomic_write_text(self.file(self.CONFIG_FILE), recipe.to_toml())

    def write_model_config(self, config: ModelConfig) -> None:
        """model_config.json: the exact architecture, so the checkpoints load without the
        recipe's model.init_from."""
        text = json.dumps(config.to_dict(), indent=2) + "\n"
        atomic_write_text(self.file(self.MODEL_CONFIG_FILE), text)

    def write_tokenizer(self, tokenizer: Tokenizer) -> None:
        """tokenizer.json, tokenizer_config.json and the chat template, as transformers saves
        them."""
        tokenizer.save(self.path)

    def write_heldout(self, heldout: HeldOut) -> None:
        heldout.write(self.file(self.HELDOUT_FILE))


def run_folder_of(spec: str | os.PathLike) -> tuple[RunFolder, int | None] | None:
    """(run folder, step or None) when `spec` names a run folder or one of its checkpoints."""
    return RunFolder.of(spec)
