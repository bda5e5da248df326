"""The training loop behind `eqllm run`: data, model, compiled step, logs, checkpoints, report.

A run is a function of its recipe: the batch of step s is `batch_at(train, step=s, seed=seed)`,
so resuming from a checkpoint (model, optimizer state, step) continues exactly as an
uninterrupted run would. SIGINT/SIGTERM set a flag checked after every step: the loop saves a
checkpoint, waits for it, and returns. A non-finite loss is never applied (see `TrainStep`); the
loop stops at it and leaves the last good checkpoint as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from tqdm.auto import tqdm

from eqllm.data import TokenData, batch_at, prepare
from eqllm.eval.evaluate import eval_batch_size, evaluate_run, format_eval
from eqllm.eval.harness import evaluate_tokens, loss_report
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
from eqllm.train import mfu as mfu_lib
from eqllm.train.checkpoint import Checkpointer
from eqllm.train.optim import make_optimizer, schedule
from eqllm.train.report import write_loss_plot, write_report
from eqllm.train.step import TrainStep, init_opt_state


class NonFiniteLoss(RuntimeError):
    """The loss or gradient norm became inf/NaN; the step was not applied."""


@dataclasses.dataclass
class RunResult:
    """What `run` did: the folder, the last step, the summary, and why it stopped early."""

    out_dir: Path
    step: int
    total_steps: int
    summary: dict
    interrupted: str | None = None  # "SIGINT" / "SIGTERM" / "stop_after"


def setup_compile_cache(setting: str) -> Path | None:
    """Turn on JAX's persistent compilation cache ("" = default folder, "off" = disabled)."""
    if setting == "off":
        return None
    path = Path(setting).expanduser() if setting else mfu_lib.cache_root() / "jax"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def prepare_data(recipe: Recipe, *, progress: bool = True) -> TokenData:
    d = recipe.data
    return prepare(
        d.source.to_source(),
        d.tokenizer,
        cache_dir=d.cache_dir or None,
        val_fraction=d.val_fraction,
        seed=d.split_seed,
        bpe_vocab_size=recipe.bpe_vocab_size(),
        progress=progress,
    )


def build_model(recipe: Recipe, tokenizer_vocab: int) -> CausalLM:
    """The recipe's model: `init_from` weights, or a fresh one sized to the tokenizer."""
    if recipe.model.init_from:
        from eqllm import hub

        model = hub.from_pretrained(recipe.model.init_from)
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
    return model


def place_on_mesh(recipe: Recipe, model: CausalLM):
    """(mesh, model placed on it, the parameters' shardings) for the recipe's [mesh].

    Fails before any compilation when the mesh does not fit the devices, the heads, the batch or
    the devices' memory, with a message that says which size to change.
    """
    mesh = make_mesh(recipe.mesh)
    check_divisible(model.config, mesh)
    t = recipe.train
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = t.batch_size // t.grad_accum
    if micro % split:
        raise RecipeError(
            f"train.batch_size={t.batch_size} / grad_accum={t.grad_accum} = {micro} rows per "
            f"micro-batch do not split over data*fsdp={split} devices; make it a multiple "
            f"of {split}"
        )
    estimate = estimate_memory(
        model.config,
        mesh,
        batch_size=t.batch_size,
        seq_len=recipe.data.seq_len,
        grad_accum=t.grad_accum,
    )
    check_fits(estimate, mesh.devices.flat[0])
    if mesh.size == 1:  # one device: nothing to place (and no new shardings to trace against)
        return mesh, model, None
    return mesh, shard_model(model, mesh), param_shardings(model, mesh)


def restore_model(ckpt_dir: Path, model: CausalLM, recipe: Recipe, step: int | None = None):
    """(model, meta) from a run's checkpoint folder; the optimizer state is read and dropped."""
    params = eqx.filter(model, eqx.is_inexact_array)
    optimizer = make_optimizer(recipe.optim, 1, params)
    checkpointer = Checkpointer(ckpt_dir, keep=recipe.train.keep_checkpoints, async_save=False)
    try:
        model, _, meta = checkpointer.restore(model, init_opt_state(optimizer, model), step)
    finally:
        checkpointer.close()
    return model, meta


class _Signals:
    """SIGINT/SIGTERM set `self.received`; a second SIGINT interrupts at once."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class MetricsLog:
    """Rows to metrics.jsonl and scalars to TensorBoard event files in the run folder."""

    def __init__(self, out_dir: Path, resume_step: int | None, keep_rows: int | None = None):
        """resume_step / keep_rows: keep the rows written before the checkpoint resumed from
        (its first `keep_rows` rows, else those up to `resume_step`); the rest are redone."""
        self.path = out_dir / "metrics.jsonl"
        self.rows = 0
        if resume_step is not None and self.path.is_file():
            rows = []
            for line in self.path.read_text(errors="replace").splitlines():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line torn by a kill; never a complete row
                    continue
            if keep_rows is not None:
                kept = rows[:keep_rows]
            else:
                kept = [r for r in rows if r.get("step", 0) <= resume_step]
            guards.atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
            self.rows = len(kept)
        elif self.path.exists():
            self.path.unlink()
        self.file = self.path.open("a")
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        except ImportError:  # tensorboardX is a dependency; tolerate its absence anyway
            self.tb = None

    def log(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        self.rows += 1
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def peak_memory() -> tuple[float, str]:
    """(peak bytes, what was measured): device peak where JAX reports it, else host RSS."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return float(stats["peak_bytes_in_use"]), "device peak bytes in use"
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss_kb) * 1024, "peak host RSS"


def run(
    recipe: Recipe,
    out_dir: str | os.PathLike | None = None,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    progress: bool = True,
    final_eval: bool = True,
    force: bool = False,
    echo=print,
) -> RunResult:
    """Train `recipe`, writing the run folder `out_dir` (default runs/<recipe name>).

    resume: continue from the folder's newest intact checkpoint (damaged newer ones are
        reported and moved aside to `<step>.damaged`); the recipe must equal the saved one
        except for fields in `guards.FORCE_OK`, which change only with `force`. A folder with a
        run but no checkpoint yet starts over.
    stop_after: stop (with a checkpoint) once this many steps are done, as if interrupted; the
        schedule still spans the recipe's full length.
    Raises `NonFiniteLoss` when a step's loss is not finite (after `train.skip_nonfinite`
    skipped ones), `guards.CheckpointWriteError` when a checkpoint cannot be written.
    """
    t_start = time.perf_counter()
    out = Path(out_dir) if out_dir is not None else Path("runs") / (recipe.name or "run")
    ckpt_dir = out / "checkpoints"
    has_ckpt = ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())
    if resume and not has_ckpt:
        if not (out / "config.toml").is_file():
            raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir} to resume from")
        echo(f"--resume: {out} has no checkpoint yet; starting the run from step 0")
        resume = False
    if has_ckpt and not resume:
        raise FileExistsError(
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
        for change in guards.resume_changes(
            saved, recipe, force=force, where=str(out / "config.toml")
        ):
            echo(f"--resume --force: {change}")
    out.mkdir(parents=True, exist_ok=True)
    cache = setup_compile_cache(recipe.train.compile_cache)

    data = prepare_data(recipe, progress=progress)
    data.tokenizer.save(out)
    model = build_model(recipe, data.tokenizer.vocab_size)
    cfg = model.config
    # The exact architecture, so the run's checkpoints load without the recipe's init_from.
    (out / "model_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    n_params = param_count(eqx.filter(model, eqx.is_array))
    total = recipe.total_steps(n_params)
    guards.atomic_write_text(out / "config.toml", recipe.to_toml())
    seq_len, batch_size = recipe.data.seq_len, recipe.train.batch_size
    tokens_per_step = batch_size * seq_len
    if data.train.shape[0] <= seq_len:
        raise RecipeError(
            f"data.seq_len={seq_len} needs more than {seq_len} training tokens; the corpus has "
            f"{data.train.shape[0]} (use more data or a shorter seq_len)"
        )

    mesh, model, shardings = place_on_mesh(recipe, model)
    params = eqx.filter(model, eqx.is_inexact_array)
    optimizer = make_optimizer(recipe.optim, total, params)
    opt_state = init_opt_state(optimizer, model, shardings)
    train_step = TrainStep(
        optimizer,
        schedule(recipe.optim, total),
        grad_accum=recipe.train.grad_accum,
        param_shardings=shardings,
        batch_sharding=batch_sharding(mesh) if shardings is not None else None,
    )
    checkpointer = Checkpointer(ckpt_dir, keep=recipe.train.keep_checkpoints)
    start = 0
    skipped = 0  # non-finite steps skipped so far (train.skip_nonfinite)
    meta: dict = {}
    if resume:
        model, opt_state, meta = guards.restore_intact(checkpointer, model, opt_state, echo=echo)
        start = int(meta["step"])
        skipped = int(meta.get("nonfinite_skipped", 0))
    last_saved = start if resume else None
    log = MetricsLog(out, start if resume else None, meta.get("metrics_rows"))

    flops_per_token = cfg.flops_per_token(seq_len)
    peak, peak_source = mfu_lib.device_peak_flops()
    n_devices = mesh.size

    echo(f"run folder: {out}")
    echo(
        f"model: {recipe.model.variant} ({cfg.family}), {n_params:,} parameters, "
        f"vocab {cfg.vocab_size}, context {cfg.max_seq_len}"
    )
    echo(
        f"data: {data.meta['train_tokens']:,} training / {data.meta['val_tokens']:,} validation "
        f"tokens ({data.tokenizer.kind} tokenizer, {data.tokenizer.vocab_size} ids, "
        f"{data.bytes_per_token('train'):.2f} bytes/token)"
    )
    echo(
        f"training: {total:,} steps x {tokens_per_step:,} tokens = {total * tokens_per_step:,} "
        f"tokens ({total * tokens_per_step / n_params:.1f} per parameter)"
        + (f", resuming at step {start}" if resume else "")
    )

    def meta_for(step: int) -> dict:
        return {
            "step": step,
            "tokens": step * tokens_per_step,
            "data_position": {"seed": recipe.train.seed, "next_step": step},
            "seed": recipe.train.seed,
            "recipe": recipe.to_dict(),
            "metrics_rows": log.rows,  # metrics.jsonl is cut back to these rows on resume
            "nonfinite_skipped": skipped,
        }

    def make_batch(step: int) -> np.ndarray:
        """This process's rows of step `step`'s global batch."""
        return batch_at(
            data.train,
            step=step,
            seed=recipe.train.seed,
            batch_size=batch_size,
            seq_len=seq_len,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    def save(step: int, wait: bool = False) -> None:
        nonlocal last_saved
        m, s = model, opt_state
        if jax.devices()[0].platform == "cpu":
            # The next step donates these buffers; on CPU hand orbax host copies of its own.
            m = jax.tree.map(lambda x: np.array(x) if eqx.is_array(x) else x, m)
            s = jax.tree.map(lambda x: np.array(x) if eqx.is_array(x) else x, s)
        try:  # the previous (background) save: its errors surface here
            checkpointer.wait()
        except Exception as e:
            raise_save_error(e, last_saved)
        try:
            checkpointer.save(step, m, s, meta_for(step), wait=wait)
        except Exception as e:  # disk full, read-only folder, ...
            raise_save_error(e, step)
        last_saved = step

    def raise_save_error(e: Exception, step: int):
        checkpointer.manager.reload()
        intact = checkpointer.latest_step()
        raise guards.CheckpointWriteError(guards.save_error(e, step, ckpt_dir, intact)) from e

    bar = tqdm(
        total=total,
        initial=start,
        desc="train",
        unit="step",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    loader_s = 0.0
    loader_tokens = 0
    step_times: list[float] = []
    compile_s = None
    first_step_s = None
    window_t0 = time.perf_counter()
    window_tokens = 0
    interrupted = None
    summary: dict = {}
    last_train: dict = {}
    step = start
    tokens_per_s = 0.0
    try:
        with _Signals() as signals:
            t0 = time.perf_counter()
            batch = make_batch(start) if start < total else None
            loader_s += time.perf_counter() - t0
            loader_tokens += tokens_per_step
            while step < total:
                t_step = time.perf_counter()
                model, opt_state, metrics = train_step(model, opt_state, batch)
                if step + 1 < total:  # build the next batch while the device computes
                    t0 = time.perf_counter()
                    batch = make_batch(step + 1)
                    loader_s += time.perf_counter() - t0
                    loader_tokens += tokens_per_step
                loss = float(metrics["loss"])
                finite = bool(metrics["finite"])
                dt = time.perf_counter() - t_step
                step += 1
                window_tokens += tokens_per_step
                if first_step_s is None:
                    first_step_s = dt
                    window_t0, window_tokens = time.perf_counter(), 0
                else:
                    step_times.append(dt)
                    if compile_s is None:
                        compile_s = max(first_step_s - dt, 0.0)
                        log.log(
                            {"step": step, "compile_s": compile_s, "first_step_s": first_step_s}
                        )
                if not finite and skipped < recipe.train.skip_nonfinite:
                    skipped += 1
                    log.log({"step": step, "loss": loss, "finite": False, "skipped": skipped})
                    bar.write(
                        f"step {step}: non-finite loss ({loss}) or gradient norm; the update was "
                        f"not applied and the batch skipped ({skipped} of "
                        f"train.skip_nonfinite={recipe.train.skip_nonfinite})",
                        file=sys.stderr,
                    )
                elif not finite:
                    where = (
                        f"the last good checkpoint is step {last_saved} in {ckpt_dir}"
                        if last_saved is not None
                        else "no checkpoint was saved before it"
                    )
                    log.log({"step": step, "loss": loss, "finite": False})
                    skip = (
                        f"after skipping {skipped} (train.skip_nonfinite="
                        f"{recipe.train.skip_nonfinite})"
                        if skipped
                        else "set train.skip_nonfinite=K to skip up to K such steps"
                    )
                    raise NonFiniteLoss(
                        f"non-finite loss ({loss}) or gradient norm at step {step}; the update "
                        f"was not applied and the run stopped ({skip}). {where}. Lower "
                        "optim.lr, raise optim.warmup_steps or check the data."
                    )
                bar.update(1)
                if finite and (step % recipe.train.log_every == 0 or step == total):
                    elapsed = time.perf_counter() - window_t0
                    if window_tokens and elapsed > 0:
                        tokens_per_s = window_tokens / elapsed
                    m = jax.device_get(metrics)
                    util = mfu_lib.mfu(tokens_per_s, flops_per_token, peak, n_devices)
                    last_train = {
                        "step": step,
                        "tokens": step * tokens_per_step,
                        "loss": loss,
                        "grad_norm": float(m["grad_norm"]),
                        "lr": float(m["lr"]),
                        "update_norm": float(m["update_norm"]),
                        "param_norm": float(m["param_norm"]),
                        "tokens_per_s": tokens_per_s,
                        "step_s": float(np.median(step_times[-50:])) if step_times else dt,
                        **({"mfu": util} if util is not None else {}),
                        "grad_norm/layer": [float(x) for x in m["grad_norm/layer"]],
                    }
                    log.log(last_train)
                    postfix = {"loss": f"{loss:.3f}", "tok/s": f"{tokens_per_s:,.0f}"}
                    if util is not None:
                        postfix["mfu"] = f"{util:.1%}"
                    bar.set_postfix(postfix, refresh=False)
                    window_t0, window_tokens = time.perf_counter(), 0
                ev = recipe.train.eval_every
                if ev and step % ev == 0 and step < total and data.val.shape[0] > seq_len:
                    t_eval = time.perf_counter()
                    vloss, _ = evaluate_tokens(
                        model,
                        data.val,
                        batch_size=eval_batch_size(recipe),
                        seq_len=seq_len,
                        max_batches=recipe.eval.batches or None,
                    )
                    rep = loss_report(vloss, data.bytes_per_token("val"))
                    log.log(
                        {
                            "step": step,
                            "tokens": step * tokens_per_step,
                            **{f"val/{k}": v for k, v in rep.items()},
                        }
                    )
                    bar.write(
                        f"step {step}: val loss {vloss:.4f}, bits/byte {rep['bpb']:.4f}",
                        file=sys.stderr,
                    )
                    window_t0 += time.perf_counter() - t_eval  # evaluation is not train time
                ce = recipe.train.checkpoint_every
                if ce and step % ce == 0 and step < total:
                    save(step)
                if signals.received or (stop_after is not None and step >= stop_after):
                    if step < total:
                        interrupted = signals.received or "stop_after"
                        break
            bar.close()
            if last_saved != step:
                save(step, wait=True)
            try:
                checkpointer.wait()
            except Exception as e:
                raise_save_error(e, last_saved)
    finally:
        bar.close()
        failing = sys.exc_info()[1] is not None
        try:
            checkpointer.close()
        except Exception as e:
            if not failing:  # else the error already in flight is the one to report
                raise_save_error(e, last_saved)

    if interrupted:
        log.close()
        echo(
            f"{interrupted}: saved checkpoint at step {step} in {ckpt_dir}; continue with "
            f"`eqllm run {recipe.name or out / 'config.toml'} --out {out} --resume`"
        )
        return RunResult(out, step, total, {"step": step}, interrupted)

    step_s = float(np.median(step_times)) if step_times else (first_step_s or 0.0)
    step_tokens_per_s = tokens_per_step / step_s if step_s else 0.0
    mem, mem_kind = peak_memory()
    summary = {
        "variant": recipe.model.variant,
        "params": n_params,
        "steps": step,
        "tokens": step * tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
        "step_tokens_per_s": step_tokens_per_s,
        "loader_tokens_per_s": loader_tokens / loader_s if loader_s else float("inf"),
        "mfu": mfu_lib.mfu(step_tokens_per_s, flops_per_token, peak, n_devices),
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "flops_per_token": flops_per_token,
        "compile_s": compile_s if compile_s is not None else first_step_s,
        "compile_cache": str(cache) if cache else "off",
        "traces": train_step.n_traces,
        "peak_memory_bytes": mem,
        "peak_memory_kind": mem_kind,
        "device": jax.devices()[0].device_kind,
        "final_train_loss": last_train.get("loss"),
    }
    if final_eval:
        t_eval = time.perf_counter()
        result = evaluate_run(model, data, recipe, progress=progress)
        summary["eval_s"] = time.perf_counter() - t_eval
        summary.update({k: v for k, v in result.items() if k != "samples"})
        if "val" in result:
            log.log(
                {
                    "step": step,
                    "tokens": step * tokens_per_step,
                    **{f"val/{k}": v for k, v in result["val"].items() if k != "tokens"},
                    "unigram/bpb": result["unigram"]["bpb"],
                }
            )
        samples = result.get("samples", [])
        if samples:
            sep = "\n" + "=" * 72 + "\n"
            (out / "samples.txt").write_text(sep.join(samples) + "\n")
        summary["samples"] = samples
    summary["wall_s"] = time.perf_counter() - t_start
    log.close()
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    write_loss_plot(out)
    write_report(out, recipe, summary)
    for line in format_summary(summary):
        echo(line)
    echo(f"report: {out / 'report.md'}")
    return RunResult(out, step, total, summary)


def format_summary(s: dict) -> list[str]:
    lines = format_eval(s)
    util = f", MFU {s['mfu']:.1%}" if s.get("mfu") is not None else ""
    lines.append(
        f"throughput: {s['step_tokens_per_s']:,.0f} tokens/s per train step{util} "
        f"(loader {s['loader_tokens_per_s']:,.0f} tokens/s); compile {s['compile_s']:.1f} s; "
        f"wall {s['wall_s']:.0f} s"
    )
    return lines


def run_command(args: argparse.Namespace) -> int:
    """`eqllm run RECIPE_OR_PATH [--out DIR] [--set key=value ...] [--resume]`."""
    recipe = load_recipe(args.recipe, args.set or [])
    join_processes(args.coordinator, args.num_processes, args.process_id)
    out = args.out
    if out is None and args.resume is False:
        out = Path("runs") / recipe.name
    try:
        result = run(
            recipe, out, resume=args.resume, progress=not args.no_progress, force=args.force
        )
    except (NonFiniteLoss, guards.CheckpointWriteError, guards.DamagedCheckpoint) as e:
        print(f"eqllm: error: {e}", file=sys.stderr)
        return 1
    if result.interrupted == "SIGINT":
        return 130
    if result.interrupted == "SIGTERM":
        return 143
    return 0


def join_processes(coordinator: str | None, num_processes: int | None, process_id: int | None):
    """Start JAX's multi-host runtime when asked (flags or JAX's environment variables)."""
    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise ValueError(
            "--coordinator, --num-processes and --process-id go together: give all three "
            "(or none, and let the environment variables say)"
        )
    if all(given):
        jax.distributed.initialize(coordinator, num_processes, process_id)
    elif os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize()


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a shipped recipe name (recipes/NAME.toml) or a path")
    parser.add_argument("--out", type=Path, default=None, help="run folder (runs/<recipe>)")
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a recipe field, e.g. --set train.steps=100 (repeatable)",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument(
        "--force",
        action="store_true",
        help="with --resume: accept changes to the length of training, cadence and evaluation",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    hosts = parser.add_argument_group(
        "several hosts",
        "join a multi-host run (jax.distributed.initialize); the environment "
        "variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (or SLURM, "
        "Open MPI) work too",
    )
    hosts.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    hosts.add_argument("--num-processes", type=int, help="how many processes take part")
    hosts.add_argument("--process-id", type=int, help="this process's index, 0..N-1")
