"""Everything a run needs before its first step: the run folder, data, model, mesh, optimizer
and objective.

`start_run` checks the run folder (a new run must not overwrite one with checkpoints; a resumed
one must keep the saved recipe), has the objective prepare and check its data, writes the files
a run folder holds from the start (`eqllm.runs.RunFolder`: run.json, config.toml,
model_config.json, the tokenizer, the held-out tokens) and returns a `RunSetup`, restored from
the newest intact checkpoint when resuming.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax

from eqllm import lora
from eqllm.config import ConfigError, ModelConfig
from eqllm.data.instruct import ChatFormat
from eqllm.eval.evaluate import heldout_of, recipe_samples
from eqllm.hub import from_pretrained
from eqllm.model import CausalLM
from eqllm.recipe import Recipe, RecipeError
from eqllm.runs import Adapters, HeldOut, RunFolder
from eqllm.sharding import (
    batch_sharding,
    check_divisible,
    check_fits,
    estimate_memory,
    make_mesh,
    param_shardings,
    shard_model,
)
from eqllm.sharding.dispatch import experts_impl, experts_kernel
from eqllm.train import guards
from eqllm.train.checkpoint import RunCheckpoints
from eqllm.train.metrics import MetricsLog
from eqllm.train.mfu import device_peak_flops, step_flops
from eqllm.train.objectives import Objective, objective_class
from eqllm.train.optim import make_optimizer, schedule
from eqllm.train.pipeline import Pipeline
from eqllm.train.processes import process_zero_first, writes_run_files
from eqllm.train.step import TrainStep, init_opt_state
from eqllm.trees import param_count


def prepare_data(recipe: Recipe, *, progress: bool = True):
    """The run's data, as its objective (train.objective) prepares and checks it."""
    return objective_class(recipe.train.objective).prepare(recipe, progress=progress)


def build_model(recipe: Recipe, tokenizer_vocab: int) -> CausalLM:
    """The recipe's model: `init_from` weights (a Hugging Face folder or repo, or an eqllm run
    folder), or a fresh one sized to the tokenizer; its experts computed as moe.impl chooses
    for this backend and mesh (`with_experts_impl`); with finetune.method "lora", adapted."""
    return _build_model(recipe, tokenizer_vocab)[0]


def _build_model(recipe: Recipe, tokenizer_vocab: int) -> tuple[CausalLM, dict | None]:
    """`build_model` and its experts' {"impl", "why"} (None without experts)."""
    if recipe.model.init_from:
        init_from = recipe.model.init_from
        if RunFolder.is_run(init_from):
            model, _ = RunFolder(init_from).load_model()
        else:
            model = from_pretrained(init_from)
        model = with_overrides(recipe, model)
        model = model.with_config(compute_dtype=recipe.train.precision, remat=recipe.train.remat)
    else:
        cfg = recipe.model_config(vocab_size=tokenizer_vocab)
        model = CausalLM(cfg, key=jax.random.key(recipe.train.seed))
    if model.config.vocab_size < tokenizer_vocab:
        raise RecipeError(
            f"the tokenizer has {tokenizer_vocab} ids but the model's vocab_size is "
            f"{model.config.vocab_size}; use a smaller data.bpe_vocab_size or a larger "
            "model.overrides.vocab_size"
        )
    model, experts = with_experts_impl(recipe, model)
    return with_adapters(recipe, model), experts


def with_overrides(recipe: Recipe, model: CausalLM) -> CausalLM:
    """`init_from`'s weights under the recipe's `model.overrides`: any setting that keeps every
    weight's shape (a training setting such as moe.bias_update_speed, an execution setting, RoPE
    scaling for a longer context); one that changes a shape is refused by name."""
    overrides = dict(recipe.model.overrides)
    if not overrides:
        return model
    try:
        config = model.config.replace(**overrides)
    except ConfigError as e:
        raise RecipeError(f"model.overrides: {e}") from None
    skeleton = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(skeleton)]
    if shapes != [(x.shape, x.dtype) for x in jax.tree.leaves(model)]:
        raise RecipeError(
            f"model.overrides {sorted(overrides)} change the shapes of model.init_from's weights "
            f"({recipe.model.init_from}); drop them, or train from scratch without init_from"
        )
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


def with_experts_impl(recipe: Recipe, model: CausalLM) -> tuple[CausalLM, dict | None]:
    """`model` computing its experts as its moe.impl asks for this backend and the recipe's
    mesh ("auto": `eqllm.config.experts.choose_impl`), and {"impl", "why", "requested"} for the
    run's summary (None without experts)."""
    if model.config.moe is None:
        return model, None
    backend = jax.default_backend()
    if model.config.moe.kernel == "megablox" and backend != "tpu":
        raise RecipeError(
            f"model.overrides.moe.kernel='megablox' is a TPU kernel and this process runs on "
            f"{backend}; set it to 'auto' or 'xla'"
        )
    sizes = recipe.mesh.axis_sizes(len(jax.devices()))
    impl, why = experts_impl(model.config, backend, sizes)
    kernel = experts_kernel(model.config, backend, impl, sizes)
    requested = model.config.moe.impl
    experts = {"impl": impl, "why": why, "requested": requested, "kernel": kernel}
    return model.with_config(moe={"impl": impl, "kernel": kernel}), experts


def with_adapters(recipe: Recipe, model: CausalLM) -> CausalLM:
    """`model` with the recipe's LoRA adapters (finetune.method "lora"), else unchanged."""
    adapters = Adapters.of(recipe)
    if adapters is None:
        return model
    try:
        return adapters.apply(model, key=jax.random.key(recipe.train.seed))
    except lora.LoraError as e:
        raise RecipeError(f"finetune: {e}") from None


def place_on_mesh(recipe: Recipe, model: CausalLM):
    """(mesh, model placed on it, the parameters' shardings) for the recipe's [mesh].

    Fails before any compilation when the mesh does not fit the devices, the heads, the batch or
    the devices' memory, with a message that says which size to change.
    """
    mesh = make_mesh(recipe.mesh)
    check_divisible(model.config, mesh)
    check_batch_split(recipe, mesh)
    t = recipe.train
    estimate = estimate_memory(
        model.config,
        mesh,
        batch_size=t.batch_size,
        seq_len=recipe.data.seq_len,
        grad_accum=t.grad_accum,
        microbatches=t.microbatches,
    )
    check_fits(estimate, mesh.devices.flat[0])
    if mesh.size == 1:  # one device: nothing to place (and no new shardings to trace against)
        return mesh, model, None
    return mesh, shard_model(model, mesh), param_shardings(model, mesh)


def check_batch_split(recipe: Recipe, mesh) -> None:
    """Refuse a batch whose micro-batches do not split over the mesh's data and fsdp axes."""
    t = recipe.train
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = t.batch_size // t.grad_accum // t.microbatches
    if micro % split:
        raise RecipeError(
            f"train.batch_size={t.batch_size} / grad_accum={t.grad_accum} / microbatches="
            f"{t.microbatches} = {micro} rows per micro-batch do not split over data*fsdp="
            f"{split} devices; make it a multiple of {split}"
        )


def pipeline_of(recipe: Recipe, mesh) -> Pipeline | None:
    """The GPipe schedule of the recipe's mesh.pipeline stages and train.microbatches (None when
    both are 1)."""
    stages, microbatches = mesh.shape["pipeline"], recipe.train.microbatches
    if stages == 1 and microbatches == 1:
        return None
    return Pipeline(stages, microbatches, mesh if mesh.size > 1 else None)


def check_run_folder(
    out: Path, recipe: Recipe, *, resume: bool, force: bool, echo: Callable[[str], None]
) -> bool:
    """Whether the run in `out` resumes: refuses to overwrite checkpoints without `resume`, and
    a resume whose recipe changes fields it may not (see `guards.resume_changes`)."""
    folder = RunFolder(out)
    ckpt_dir = folder.checkpoints
    has_ckpt = ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())
    if resume and not has_ckpt:
        if not folder.file(RunFolder.CONFIG_FILE).is_file():
            raise guards.MissingRunFile(
                f"--resume: no checkpoint in {ckpt_dir} to resume from; give the --out folder "
                "of an earlier run, or drop --resume to start a new one"
            )
        echo(f"--resume: {out} has no checkpoint yet; starting the run from step 0")
        return False
    if has_ckpt and not resume:
        raise guards.RunExists(
            f"{out} already holds a run with checkpoints; pass --resume to continue it or "
            "--out to start a new run elsewhere"
        )
    if resume:
        try:  # the saved recipe as it was: its data is checked as the new recipe's
            saved = folder.recipe()
        except (RecipeError, OSError) as e:
            raise RecipeError(
                f"--resume: cannot read the run's recipe {out / 'config.toml'} ({e}); restore "
                "it (the checkpoints' meta holds a copy) or start a new run with another --out"
            ) from None
        where = str(out / "config.toml")
        for change in guards.resume_changes(saved, recipe, force=force, where=where):
            echo(f"--resume --force: {change}")
    return resume


@dataclasses.dataclass
class RunSetup:
    """A run ready for its first step (or its next one, when resumed)."""

    out: Path
    recipe: Recipe
    data: object  # what the objective prepared (`eqllm.train.objectives`)
    objective: Objective
    heldout: HeldOut
    config: ModelConfig
    model: CausalLM | None  # None once `take_state` handed it to the loop
    opt_state: object
    train_step: TrainStep
    checkpoints: RunCheckpoints
    log: MetricsLog
    n_params: int
    n_devices: int
    total: int  # steps in the whole run
    start: int  # the first step this process runs (the checkpoint's step when resumed)
    skipped: int  # non-finite steps skipped before `start` (train.skip_nonfinite)
    flops_per_token: float  # the step's FLOPs per token, for MFU (see eqllm.train.mfu)
    hardware_flops_per_token: float  # the same plus remat's recomputation, for HFU
    peak_flops: float | None  # the device's peak FLOP/s, None when unknown
    peak_source: str  # where `peak_flops` comes from
    experts: dict | None = None  # a mixture of experts' {"impl", "why"} (`with_experts_impl`)

    @property
    def tokens_per_step(self) -> int:
        return self.recipe.train.batch_size * self.recipe.data.seq_len

    @property
    def chat(self) -> ChatFormat | None:
        """The chat format the model is prompted in (samples), None for plain text."""
        if not self.objective.chat:
            return None
        return ChatFormat(self.data.tokenizer, self.data.template)

    def take_state(self) -> tuple[CausalLM, object]:
        """(model, opt_state) for the loop, which owns them from now on: the train step donates
        their buffers, so no other reference to them is kept here."""
        model, opt_state = self.model, self.opt_state
        self.model = self.opt_state = None
        return model, opt_state

    def batch(self, step: int, model: CausalLM | None = None) -> dict:
        """This process's rows of step `step`'s batch (RL rolls out with `model`)."""
        return self.objective.batch(step, model)

    def checkpoint_meta(self, step: int, skipped: int) -> dict:
        """What a checkpoint at `step` records besides the arrays: where the run stands."""
        return {
            "step": step,
            "tokens": step * self.tokens_per_step,
            "data_position": {"seed": self.recipe.train.seed, "next_step": step},
            "seed": self.recipe.train.seed,
            "recipe": self.recipe.to_dict(),
            "metrics_rows": self.log.rows,  # metrics.jsonl is cut back to these rows on resume
            "nonfinite_skipped": skipped,
        }


def start_run(
    recipe: Recipe,
    out: Path,
    *,
    resume: bool,
    progress: bool,
    echo: Callable[[str], None],
    force: bool = False,
) -> RunSetup:
    """Data, model, mesh, optimizer, objective, step, checkpoints and metrics of the run in `out`.

    `resume` (checked by `check_run_folder`) restores the newest intact checkpoint; `force`
    accepts one written without checksums.
    """
    folder = RunFolder(out)
    kind = objective_class(recipe.train.objective)
    with process_zero_first("eqllm: data prepared"):  # one process fills the token cache
        data = kind.prepare(recipe, progress=progress)
    writer = writes_run_files()
    if writer:  # with the chat template the rows were formatted with, as transformers saves it
        tokenizer = data.tokenizer
        if kind.chat:
            tokenizer = tokenizer.with_chat_template(data.template)
        folder.write_tokenizer(tokenizer)
    model, experts = _build_model(recipe, data.tokenizer.vocab_size)
    n_params = param_count(eqx.filter(model, eqx.is_array))
    total = recipe.total_steps(n_params)
    if writer:
        adapters = Adapters.of(recipe)
        folder.write_run(objective=recipe.train.objective, adapters=adapters, chat=kind.chat)
        config = model.config  # as asked: "auto" chooses again where the folder is loaded
        if experts is not None:
            config = config.replace(moe={"impl": experts["requested"]})
        folder.write_model_config(config)  # the checkpoints load without init_from
        folder.write_recipe(recipe)
    # What every evaluation scores, kept in the folder: `eqllm eval` then needs no data.
    heldout = (folder.heldout() if resume else None) or heldout_of(data, recipe)
    if writer:
        folder.write_heldout(heldout)
    objective = kind.start(recipe, data, model, folder, write=writer)  # before any restore
    if writer and recipe.finetune.method != "none" and not resume and recipe.eval.sample_tokens:
        # The same prompts before and after, for the report (adapters start as the identity).
        chat = ChatFormat(data.tokenizer, data.template) if kind.chat else None
        before = []
        if recipe.eval.sample_prompts:
            before = recipe_samples(model, data.tokenizer, recipe, chat)
        folder.file(RunFolder.SAMPLES_BEFORE_FILE).write_text(json.dumps(before, indent=2) + "\n")
    mesh, model, shardings = place_on_mesh(recipe, model)
    if shardings is not None:  # its frozen models on the mesh too
        objective = objective.placed(mesh)
    pipeline = pipeline_of(recipe, mesh)
    optimizer = make_optimizer(recipe.optim, total, model)
    opt_state = init_opt_state(optimizer, model, shardings)
    train_step = TrainStep(
        optimizer,
        schedule(recipe.optim, total),
        objective=objective,
        grad_accum=recipe.train.grad_accum,
        param_shardings=shardings,
        batch_sharding=batch_sharding(mesh) if shardings is not None else None,
        dropout_seed=recipe.train.seed,
        pipeline=pipeline,
    )
    checkpoints = RunCheckpoints(folder.checkpoints, keep=recipe.train.keep_checkpoints)
    meta: dict = {"step": 0}
    if resume:
        model, opt_state, meta = guards.restore_intact(
            checkpoints.checkpointer, model, opt_state, force=force, echo=echo
        )
        checkpoints.last_saved = int(meta["step"])
    log = MetricsLog(
        out, int(meta["step"]) if resume else None, meta.get("metrics_rows"), write=writer
    )
    peak, peak_source = device_peak_flops()  # measured on CPU: once per run
    flops = step_flops(model, recipe.data.seq_len)
    return RunSetup(
        out=out,
        recipe=recipe,
        data=data,
        objective=objective,
        heldout=heldout,
        config=model.config,
        model=model,
        opt_state=opt_state,
        train_step=train_step,
        checkpoints=checkpoints,
        log=log,
        n_params=n_params,
        n_devices=mesh.size,
        total=total,
        start=int(meta["step"]),
        skipped=int(meta.get("nonfinite_skipped", 0)),
        flops_per_token=flops.model,
        hardware_flops_per_token=flops.hardware,
        peak_flops=peak,
        peak_source=peak_source,
        experts=experts,
    )
