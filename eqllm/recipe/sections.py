"""The sections of a recipe: frozen pydantic dataclasses that refuse unknown keys and wrong types.

Scalars are strict (no "3" -> 3, no 3.0 -> 3, no 1 -> True; an int is accepted for a float),
lists become tuples, and ranges are declared on the fields, so a message can state them.
Checks that need several sections or the outside world live in `Recipe.check`. Built directly
(`TrainSpec(steps=-1)`), a bad value raises a RecipeError naming `TrainSpec.steps`; inside a
recipe the path is `train.steps`. The optimizer's section is `eqllm.recipe.optim`.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, Strict, ValidationError

from eqllm.config import RematPolicy, validated
from eqllm.data import DataSource
from eqllm.recipe.errors import RecipeError, recipe_error

Precision = Literal["float32", "bfloat16"]
SourceKind = Literal["stdlib", "files", "jsonl", "hf"]
FinetuneMethod = Literal["none", "lora", "full"]
PackMethod = Literal["none", "first-fit", "best-fit"]
# What a run trains (`eqllm.train.objectives`); "" in a recipe: the one its data sections imply.
ObjectiveName = Literal["", "lm", "sft", "dpo", "ipo", "simpo", "grpo", "distill"]
PREFERENCE_LOSSES = ("dpo", "ipo", "simpo")

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
Positive = Annotated[Int, Field(gt=0)]
Count = Annotated[Int, Field(ge=0)]  # 0 is allowed and usually means "off"
Fraction = Annotated[Float, Field(ge=0, lt=1)]


# Not strict as a whole: a TOML list must become a tuple, a table a section.
CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)


def _section_error(error: ValidationError, cls: type) -> RecipeError:
    return recipe_error(error, cls, f"{cls.__name__}.")


section = validated(CONFIG, _section_error)


@typing.no_type_check  # pydantic checks the fields
@section
class ModelSpec:
    """Which network to train.

    variant: a zoo name (`eqllm zoo list`).
    overrides: ModelConfig settings to change, by name or dotted path, e.g.
        `{ max_seq_len = 128, attention.n_kv_heads = 2 }` (not `remat` or `compute_dtype`:
        those are train.remat and train.precision).
    init_from: start from these weights (a Hugging Face folder or hub repo, read with
        `eqllm.hub.from_pretrained`, or an eqllm run folder) instead of a random
        initialisation; "" for none.
    parametrization: "sp", "mup" or "completep" (docs/scaling-laws.md), "" for the variant's;
        under muP, optim.lr is the learning rate of the base model (overrides.base_d_model).
    """

    variant: Str
    overrides: dict[str, Any] = Field(default_factory=dict)
    init_from: Str = ""
    parametrization: Literal["", "sp", "mup", "completep"] = ""


@typing.no_type_check  # pydantic checks the fields
@section
class SourceSpec:
    """A text source (the fields of `eqllm.data.DataSource`); `label` names it in reports;
    `weight` is its share of the training rows in a mixture (`data.sources`)."""

    kind: SourceKind = "stdlib"
    path: Str = ""
    name: Str = ""
    config: Str = ""
    split: Str = "train"
    text_field: Str = "text"
    glob: Str = ""
    streaming: Bool = False
    max_bytes: Count = 0
    label: Str = ""
    weight: Float = 1.0

    def to_source(self) -> DataSource:
        """The `eqllm.data.DataSource` this spec describes (empty strings / 0 mean unset)."""
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


@typing.no_type_check  # pydantic checks the fields
@section
class WeightStage:
    """A stage of a mixture's weight schedule: from `step` on, rows are drawn with `weights`
    (one per `data.sources` entry, in order; each >= 0, not all 0)."""

    step: Positive
    weights: tuple[Annotated[Float, Field(ge=0)], ...]


@typing.no_type_check  # pydantic checks the fields
@section
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
    workers: processes that tokenize the corpus's shards (1: the run's own process); the token
        files are the same for any number (`eqllm.data.prepare`).
    document_mask: attention stays inside each document of a training window (segments open
        at every end-of-text token); the tokens a step sees are unchanged.
    reset_positions: positions restart at 0 at each document (with document_mask, or with
        packed finetune.data).
    sources: a weighted mixture in place of `source`: each source tokenized into its own
        cache, its `weight` its share of the training rows (`eqllm.data.MixtureData`), its
        validation loss logged apart as val/<label>/loss.
    weight_schedule: stages `{ step = 1000, weights = [0.5, 0.5] }` that replace the sources'
        weights from their step on (increasing steps; `MixtureData.stages`).
    """

    source: SourceSpec = Field(default_factory=SourceSpec)
    tokenizer: Str = "bpe"
    bpe_vocab_size: Count = 0
    seq_len: Positive = 256
    val_fraction: Fraction = 0.01
    split_seed: Count = 0
    cache_dir: Str = ""
    workers: Positive = 1
    document_mask: Bool = False
    reset_positions: Bool = False
    sources: tuple[SourceSpec, ...] = ()
    weight_schedule: tuple[WeightStage, ...] = ()


@typing.no_type_check  # pydantic checks the fields
@section
class FinetuneSpec:
    """Fine-tuning of the `model.init_from` weights (docs/finetune.md).

    method: "lora" (low-rank adapters; the base frozen: no gradients, no optimizer state),
        "full" (every weight trained), "none" (not a fine-tuning run).
    rank, alpha, dropout, targets: the adapters (`eqllm.lora.apply`): rank, PEFT's lora_alpha
        (scale alpha / rank), dropout on the adapters' input, Hugging Face module names.
    data: a JSON/JSONL file of instruction examples (Alpaca or chat form); training then uses
        it instead of data.source, with the loss on the responses only. A relative path is
        looked up in the working directory, then among the recipes shipped with eqllm. "" keeps
        data.source (plain text).
    pack: "none" pads each example to its own row; "first-fit" / "best-fit" pack examples
        into full rows with segment ids (attention stays inside each example; losses and masks
        per example unchanged; `eqllm.data.pack_examples`).
    """

    method: FinetuneMethod = "none"
    rank: Positive = 8
    alpha: Annotated[Float, Field(gt=0)] = 16.0
    dropout: Fraction = 0.0
    targets: tuple[Str, ...] = ("q_proj", "v_proj")
    data: Str = ""
    pack: PackMethod = "none"


@typing.no_type_check  # pydantic checks the fields
@section
class PreferenceSpec:
    """Preference optimisation of the `model.init_from` weights (docs/post-training.md).

    data: a JSONL file of pairs (`prompt`, `chosen`, `rejected`: strings or chat messages),
        looked up like finetune.data; or a Hugging Face dataset: "hf:NAME" (a hub id or a local
        folder of data files, through `datasets.load_dataset`), a folder written by
        `save_to_disk`, or a .parquet / .arrow file; "" for none. Needs finetune.method "lora"
        (the reference is the base with the adapters off) or "full" (reference
        log-probabilities computed once before training, cached in the run folder).
    split: the dataset's split to read (datasets only).
    prompt_field, chosen_field, rejected_field: the columns (or JSON keys) holding the prompt
        and the two responses.
    loss: "dpo", "ipo" or "simpo": the same as train.objective, which names it ("" follows
        train.objective; a recipe that sets neither trains "dpo").
    beta: the losses' inverse temperature (IPO's tau).
    label_smoothing: conservative DPO's (and SimPO's) probability that a label is flipped.
    gamma: SimPO's target reward margin.
    """

    data: Str = ""
    split: Str = "train"
    prompt_field: Str = "prompt"
    chosen_field: Str = "chosen"
    rejected_field: Str = "rejected"
    loss: Literal["", "dpo", "ipo", "simpo"] = ""
    beta: Annotated[Float, Field(gt=0)] = 0.1
    label_smoothing: Annotated[Float, Field(ge=0, lt=0.5)] = 0.0
    gamma: Annotated[Float, Field(ge=0)] = 0.5


@typing.no_type_check  # pydantic checks the fields
@section
class RLSpec:
    """Reinforcement learning with verifiable rewards (GRPO; docs/post-training.md).

    data: a JSONL file of rows with a `prompt` (a string, continued as it is, or chat messages,
        rendered with the chat template) and any other fields, handed to the reward; "" for none.
    reward: "exact_match", "format", "close_brackets" or "module:function" (eqllm.train.rewards).
    pattern: the regular expression of "format", or the answer's extraction for "exact_match".
    answer_field: the row field "exact_match" compares with.
    group_size: completions sampled per prompt; train.batch_size counts completions.
    kl_coef: weight of the k3 KL penalty against the starting model (0: none, no reference pass).
    epsilon, epsilon_high: the ratio's clip range [1 - epsilon, 1 + epsilon_high] (0: epsilon).
    normalization: "sequence" (GRPO), "token" (DAPO) or "constant" (Dr. GRPO).
    max_new_tokens, temperature: sampling of the rollouts.
    inner_updates: optimizer steps per batch of rollouts.
    """

    data: Str = ""
    algorithm: Literal["grpo"] = "grpo"
    reward: Str = "exact_match"
    pattern: Str = ""
    answer_field: Str = "answer"
    group_size: Annotated[Int, Field(ge=2)] = 8
    kl_coef: Annotated[Float, Field(ge=0)] = 0.0
    epsilon: Annotated[Float, Field(gt=0, lt=1)] = 0.2
    epsilon_high: Annotated[Float, Field(ge=0)] = 0.0
    normalization: Literal["sequence", "token", "constant"] = "sequence"
    max_new_tokens: Positive = 16
    temperature: Annotated[Float, Field(gt=0)] = 1.0
    inner_updates: Positive = 1


@typing.no_type_check  # pydantic checks the fields
@section
class DistillSpec:
    """Knowledge distillation from a teacher (train.objective "distill"; docs/post-training.md).

    teacher: any model eqllm loads (a run folder, an eqllm or Hugging Face folder, a hub repo
        id, a zoo name) with the student's tokenizer; "" for none.
    temperature: both distributions are softened by it; the KL term is multiplied by its
        square, so its gradient keeps its scale (Hinton et al., 2015).
    ce_weight: the share of the data's cross entropy in the loss (0: the KL term alone).
    top_k: take the KL over the teacher's k most likely tokens (teacher renormalised over
        them); 0: the whole vocabulary.
    """

    teacher: Str = ""
    temperature: Annotated[Float, Field(gt=0)] = 1.0
    ce_weight: Annotated[Float, Field(ge=0, le=1)] = 0.0
    top_k: Count = 0


@typing.no_type_check  # pydantic checks the fields
@section
class TrainSpec:
    """Batch, length of training, precision and the loop's cadence.

    batch_size: sequences per optimizer step (global); split into `grad_accum` micro-batches
        that are accumulated inside the compiled step.
    microbatches: pipeline microbatches each of those is split into (GPipe): with
        mesh.pipeline > 1 stages, the bubble fraction is (stages - 1) / (microbatches + stages - 1).
    steps / tokens / tokens_per_param: the length of training; give exactly one (0 = unset).
        tokens_per_param counts the model's parameters (20 is the compute-optimal rule of thumb).
        A `--set` of one of them replaces the one the recipe file gives.
    precision: compute dtype of matmuls and activations; parameters stay float32.
    remat: jax.checkpoint policy per block ("none" keeps every activation).
    log_every, eval_every, checkpoint_every: cadence in steps (0 disables eval / periodic saves).
    keep_checkpoints: how many of the latest checkpoints to keep.
    compile_cache: JAX's persistent compilation cache folder; "" for $EQLLM_CACHE/jax or
        ~/.cache/eqllm/jax, "off" to disable it.
    skip_nonfinite: how many steps with a non-finite loss or gradient to skip (not applied,
        logged) before the run stops at the next one; 0 stops at the first.
    objective: what the run minimises: "lm" (next-token cross entropy on data.source), "sft"
        (finetune.data), "dpo" / "ipo" / "simpo" (preference.data), "grpo" (rl.data),
        "distill" (distill.teacher on data.source). Left out, the recipe's data sections name
        it (rl.data: grpo, preference.data: its loss, finetune.data: sft, else lm), and the
        run folder's config.toml records it.
    """

    batch_size: Positive = 16
    grad_accum: Positive = 1
    microbatches: Positive = 1
    steps: Count = 0
    tokens: Count = 0
    tokens_per_param: Annotated[Float, Field(ge=0)] = 0.0
    seed: Count = 0
    precision: Precision = "float32"
    remat: RematPolicy = "none"
    log_every: Positive = 10
    eval_every: Count = 200
    checkpoint_every: Count = 500
    keep_checkpoints: Positive = 3
    compile_cache: Str = ""
    skip_nonfinite: Count = 0
    objective: ObjectiveName = ""


@typing.no_type_check  # pydantic checks the fields
@section
class PlanSpec:
    """The TPU slice the recipe is sized for: `eqllm plan RECIPE` compiles its step there
    (with train.batch_size, data.seq_len, [mesh] and train.remat as they are).

    topology: a Cloud TPU slice name ("v5p-128": 64 chips, "v5e-256", "v6e-64") or a JAX
        topology name ("v5p:4x4x4"); "" for none.
    slices: how many such slices the run spans, joined over the data-center network.
    """

    topology: Str = ""
    slices: Positive = 1


@typing.no_type_check  # pydantic checks the fields
@section
class EvalSpec:
    """Evaluation during and after training.

    batches: validation batches per evaluation (0 = the whole validation split).
    batch_size: rows per evaluation batch; 0 means train.batch_size.
    extra_sources: more text sources scored at the end (tokenized with the run's tokenizer).
    sample_prompts, sample_tokens, temperature (0: greedy), top_k (0: all): text samples
        written to samples.txt.
    """

    batches: Count = 20
    batch_size: Count = 0
    extra_sources: tuple[SourceSpec, ...] = ()
    sample_prompts: tuple[Str, ...] = ("def ", "import ", "class ")
    sample_tokens: Count = 200
    temperature: Annotated[Float, Field(ge=0)] = 0.8
    top_k: Count = 40
