"""Everything a run needs before its first step: the run folder, data, model, mesh, optimizer.

`start_run` checks the run folder (a new run must not overwrite one with checkpoints; a resumed
one must keep the saved recipe), writes the files a run folder holds from the start
(config.toml, model_config.json, tokenizer.json) and returns a `RunSetup`, restored from the
newest intact checkpoint when resuming.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax

from eqllm import lora
from eqllm.config import ModelConfig
from eqllm.data import MixtureData, TokenData, Tokenizer, prepare
from eqllm.data.chat import read_chat_template
from eqllm.data.instruct import InstructionData
from eqllm.data.prompts import PromptData
from eqllm.eval.evaluate import recipe_samples
from eqllm.hub import from_pretrained, load_tokenizer, resolve
from eqllm.model import CausalLM, param_count
from eqllm.recipe import Recipe, RecipeError, load_recipe
from eqllm.sharding import (
    batch_sharding,
    check_divisible,
    check_fits,
    estimate_memory,
    make_mesh,
    param_shardings,
    shard_model,
)
from eqllm.train import guards
from eqllm.train.checkpoint import Checkpointer, RunCheckpoints
from eqllm.train.data_setup import document_masking, prepare_sources, token_batch
from eqllm.train.metrics import MetricsLog
from eqllm.train.mfu import cache_root, device_peak_flops, step_flops
from eqllm.train.optim import make_optimizer, schedule
from eqllm.train.pipeline import Pipeline
from eqllm.train.post import GrpoRun, PreferenceRun, prepare_rows, start_post_training
from eqllm.train.processes import process_zero_first, writes_run_files
from eqllm.train.step import TrainStep, init_opt_state


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


def prepare_data(
    recipe: Recipe, *, progress: bool = True
) -> TokenData | MixtureData | InstructionData | PromptData:
    """The run's tokens: data.source's text or data.sources' mixture; or finetune.data's
    instruction examples, preference.data's pairs or rl.data's prompts (tokenized with the base
    model's tokenizer and chat template)."""
    d = recipe.data
    if recipe.finetune.data or recipe.preference.data or recipe.rl.data:
        return prepare_rows(recipe, *base_tokenizer(recipe))  # instructions, pairs or prompts
    if d.sources:
        return prepare_sources(recipe, progress=progress)
    return prepare(
        d.source.to_source(),
        d.tokenizer,
        cache_dir=d.cache_dir or None,
        val_fraction=d.val_fraction,
        seed=d.split_seed,
        bpe_vocab_size=recipe.bpe_vocab_size(),
        progress=progress,
        workers=d.workers,
    )


def is_run_folder(path: str) -> bool:
    folder = Path(path).expanduser()
    return (folder / "config.toml").is_file() and (folder / "checkpoints").is_dir()


def base_tokenizer(recipe: Recipe) -> tuple[Tokenizer, str | None]:
    """(tokenizer, chat template or None) of the base model `model.init_from`; data.tokenizer
    when the base folder has no tokenizer.json."""
    init_from = recipe.model.init_from
    folder = Path(init_from).expanduser() if is_run_folder(init_from) else resolve(init_from)
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        tokenizer = Tokenizer.from_spec(recipe.data.tokenizer)
    return tokenizer, read_chat_template(folder) or tokenizer.chat_template


def build_model(recipe: Recipe, tokenizer_vocab: int) -> CausalLM:
    """The recipe's model: `init_from` weights (a Hugging Face folder or repo, or an eqllm run
    folder), or a fresh one sized to the tokenizer; with finetune.method "lora", adapted."""
    if recipe.model.init_from:
        init_from = recipe.model.init_from
        if is_run_folder(init_from):
            model, _ = load_run_model(Path(init_from).expanduser())
        else:
            model = from_pretrained(init_from)
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
    return with_adapters(recipe, model)


def with_adapters(recipe: Recipe, model: CausalLM) -> CausalLM:
    """`model` with the recipe's LoRA adapters (finetune.method "lora"), else unchanged."""
    f = recipe.finetune
    if f.method != "lora":
        return model
    try:
        return lora.apply(
            model,
            rank=f.rank,
            alpha=f.alpha,
            targets=list(f.targets),
            dropout=f.dropout,
            key=jax.random.key(recipe.train.seed),
        )
    except lora.LoraError as e:
        raise RecipeError(f"finetune: {e}") from None


def load_run_model(run_dir: Path, step: int | None = None, recipe: Recipe | None = None):
    """(model, checkpoint meta) of a run folder at `step` (default latest), adapters included."""
    recipe = recipe or load_recipe(run_dir / "config.toml")
    config_file = run_dir / "model_config.json"
    config = ModelConfig.from_dict(json.loads(config_file.read_text()))
    model = with_adapters(recipe, CausalLM(config, key=jax.random.key(0)))
    return restore_model(run_dir / "checkpoints", model, recipe, step)


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


def restore_model(ckpt_dir: Path, model: CausalLM, recipe: Recipe, step: int | None = None):
    """(model, meta) from a run's checkpoint folder; the optimizer state is read and dropped."""
    optimizer = make_optimizer(recipe.optim, 1, model)
    checkpointer = Checkpointer(ckpt_dir, keep=recipe.train.keep_checkpoints, async_save=False)
    try:
        model, _, meta = checkpointer.restore(model, init_opt_state(optimizer, model), step)
    finally:
        checkpointer.close()
    return model, meta


def check_run_folder(
    out: Path, recipe: Recipe, *, resume: bool, force: bool, echo: Callable[[str], None]
) -> bool:
    """Whether the run in `out` resumes: refuses to overwrite checkpoints without `resume`, and
    a resume whose recipe changes fields it may not (see `guards.resume_changes`)."""
    ckpt_dir = out / "checkpoints"
    has_ckpt = ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())
    if resume and not has_ckpt:
        if not (out / "config.toml").is_file():
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
        try:
            saved = load_recipe(out / "config.toml")
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
    data: TokenData | MixtureData | InstructionData | PromptData
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
    post: PreferenceRun | GrpoRun | None = None  # post-training batches and evaluation

    @property
    def tokens_per_step(self) -> int:
        return self.recipe.train.batch_size * self.recipe.data.seq_len

    def take_state(self) -> tuple[CausalLM, object]:
        """(model, opt_state) for the loop, which owns them from now on: the train step donates
        their buffers, so no other reference to them is kept here."""
        model, opt_state = self.model, self.opt_state
        self.model = self.opt_state = None
        return model, opt_state

    def batch(self, step: int, model: CausalLM | None = None):
        """This process's rows of step `step`'s global batch ((tokens, loss mask) for
        instruction data, a dict for post-training; RL rolls out with `model`)."""
        if self.post is not None:
            if jax.process_count() > 1:
                raise RecipeError("preference.data and rl.data run on one process only for now")
            return self.post.batch(step, model)
        if isinstance(self.data, InstructionData):
            if jax.process_count() > 1:
                raise RecipeError("finetune.data runs on one process only for now")
            return self.data.batch_at(
                step, seed=self.recipe.train.seed, batch_size=self.recipe.train.batch_size
            )
        return token_batch(self.data, self.recipe, step)

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
    """Data, model, mesh, optimizer, step, checkpoints and metrics of the run in `out`.

    `resume` (checked by `check_run_folder`) restores the newest intact checkpoint; `force`
    accepts one written without checksums.
    """
    with process_zero_first("eqllm: data prepared"):  # one process fills the token cache
        data = prepare_data(recipe, progress=progress)
    writer = writes_run_files()
    if writer:  # with the chat template the rows were formatted with, as transformers saves it
        tokenizer = data.tokenizer
        if isinstance(data, InstructionData):
            tokenizer = tokenizer.with_chat_template(data.template)
        tokenizer.save(out)
    model = build_model(recipe, data.tokenizer.vocab_size)
    n_params = param_count(eqx.filter(model, eqx.is_array))
    total = recipe.total_steps(n_params)
    if writer:
        # The exact architecture, so the run's checkpoints load without the recipe's init_from.
        config_text = json.dumps(model.config.to_dict(), indent=2) + "\n"
        (out / "model_config.json").write_text(config_text)
        guards.atomic_write_text(out / "config.toml", recipe.to_toml())
    seq_len = recipe.data.seq_len
    if data.train.shape[0] <= seq_len:
        raise RecipeError(
            f"data.seq_len={seq_len} needs more than {seq_len} training tokens; the corpus has "
            f"{data.train.shape[0]} (use more data or a shorter seq_len)"
        )

    if writer and recipe.finetune.method != "none" and not resume and recipe.eval.sample_tokens:
        # The same prompts before and after, for the report (adapters start as the identity).
        before = recipe_samples(model, data, recipe) if recipe.eval.sample_prompts else []
        (out / "samples_before.json").write_text(json.dumps(before, indent=2) + "\n")
    post = start_post_training(recipe, data, model, out, write=writer)  # before any restore
    mesh, model, shardings = place_on_mesh(recipe, model)
    pipeline = pipeline_of(recipe, mesh)
    optimizer = make_optimizer(recipe.optim, total, model)
    opt_state = init_opt_state(optimizer, model, shardings)
    train_step = TrainStep(
        optimizer,
        schedule(recipe.optim, total),
        grad_accum=recipe.train.grad_accum,
        param_shardings=shardings,
        batch_sharding=batch_sharding(mesh) if shardings is not None else None,
        dropout_seed=recipe.train.seed,
        pipeline=pipeline,
        **document_masking(recipe, data),
        objective=None if post is None else post.objective,
    )
    checkpoints = RunCheckpoints(out / "checkpoints", keep=recipe.train.keep_checkpoints)
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
    flops = step_flops(model, seq_len)
    return RunSetup(
        out=out,
        recipe=recipe,
        data=data,
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
        post=post,
    )
