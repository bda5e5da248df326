"""The training loop behind `eqllm run`: step, non-finite handling, logging, evaluation, saving.

A run is a function of its recipe: the batch of step s is `batch_at(train, step=s, seed=seed)`,
so resuming from a checkpoint (model, optimizer state, step) continues exactly as an
uninterrupted run would. SIGINT/SIGTERM set a flag checked after every step (by all processes of
a multi-process run together, so that a signal to any one stops all after the same step): the
loop saves a checkpoint, waits for it, and returns. A non-finite loss is never applied (see
`TrainStep`); the loop stops at it and leaves the last good checkpoint as it was.

Set-up lives in `eqllm.train.setup`, measurements in `eqllm.train.metrics`, the end of a run
(final evaluation, summary, report) in `eqllm.train.report`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax

from eqllm import lora
from eqllm.eval.evaluate import evaluate_heldout
from eqllm.progress import progress_bar
from eqllm.recipe import Recipe
from eqllm.resources import setup_compile_cache
from eqllm.train.balance import METRICS as BALANCE_METRICS
from eqllm.train.metrics import Throughput
from eqllm.train.mfu import mfu
from eqllm.train.processes import agree_on_stop, barrier
from eqllm.train.report import finish_run, summarize
from eqllm.train.setup import (
    RunSetup,
    build_model,
    check_run_folder,
    place_on_mesh,
    prepare_data,
    start_run,
)
from eqllm.train.skips import NonFiniteLoss, RunState, skip_or_stop, spike
from eqllm.train.stability import ema_model
from eqllm.trees import param_count

__all__ = [
    "NonFiniteLoss",
    "RunResult",
    "RunState",
    "build_model",
    "place_on_mesh",
    "prepare_data",
    "run",
]


@dataclasses.dataclass
class RunResult:
    """What `run` did: the folder, the last step, the summary, and why it stopped early."""

    out_dir: Path
    step: int
    total_steps: int
    summary: dict
    interrupted: str | None = None  # "SIGINT" / "SIGTERM" / "stop_after" / "watch"


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
    watch: Callable[[int, float], bool] | None = None,
) -> RunResult:
    """Train `recipe`, writing the run folder `out_dir` (default runs/<recipe name>).

    resume: continue from the folder's newest intact checkpoint (damaged newer ones are
        reported and moved aside to `<step>.damaged`); the recipe must equal the saved one
        except for fields in `guards.FORCE_OK`, which change only with `force`. A folder with a
        run but no checkpoint yet starts over. A run resumed at its last step only finishes
        what is missing (final evaluation, samples, summary, report).
    stop_after: stop (with a checkpoint) once this many steps are done, as if interrupted; the
        schedule still spans the recipe's full length.
    watch: called with (step, loss) after every step; when it returns True the run stops there
        (with a checkpoint, `interrupted="watch"`): how a sweep stops a diverging point.
    Raises `NonFiniteLoss` when a step's loss is not finite (after `train.skip_nonfinite`
    skipped ones), `guards.CheckpointWriteError` when a checkpoint cannot be written.
    """
    t_start = time.perf_counter()
    out = Path(out_dir) if out_dir is not None else Path("runs") / (recipe.name or "run")
    resume = check_run_folder(out, recipe, resume=resume, force=force, echo=echo)
    barrier("eqllm: run folder checked")  # by every process, before process 0 writes to it
    out.mkdir(parents=True, exist_ok=True)
    cache = setup_compile_cache(recipe.train.compile_cache)
    setup = start_run(recipe, out, resume=resume, progress=progress, echo=echo, force=force)
    _announce(setup, echo, resume=resume)
    state = RunState(step=setup.start, skipped=setup.skipped)
    meter = Throughput(setup.tokens_per_step)
    model, opt_state = _train(
        setup, state, meter, stop_after=stop_after, progress=progress, watch=watch
    )

    if state.interrupted:
        setup.log.close()
        by = state.interrupted_by
        echo(
            f"{state.interrupted}"
            + (f" (received by process {by})" if by is not None and jax.process_count() > 1 else "")
            + f": saved checkpoint at step {state.step} in "
            f"{setup.checkpoints.directory}; "
            f"continue with `eqllm run {recipe.name or out / 'config.toml'} --out {out} --resume`"
        )
        return RunResult(out, state.step, setup.total, {"step": state.step}, state.interrupted)
    summary = summarize(
        setup, meter, step=state.step, traces=setup.train_step.n_traces, cache=cache
    )
    if state.spikes is not None:
        summary["spikes_skipped"] = state.spikes
    summary = finish_run(
        setup,
        model,
        summary,
        ema=ema_model(model, opt_state),
        final_eval=final_eval,
        progress=progress,
        t_start=t_start,
        echo=echo,
    )
    return RunResult(out, state.step, setup.total, summary)


def _train(
    setup: RunSetup,
    state: RunState,
    meter: Throughput,
    *,
    stop_after: int | None,
    progress: bool,
    watch: Callable[[int, float], bool] | None = None,
):
    """Steps from `state.step` to the end (or a signal, or `stop_after`), then a checkpoint of
    the last step; returns the trained model and its optimizer state. Updates `state` and
    `meter` as it goes."""
    recipe = setup.recipe
    model, opt_state = setup.take_state()
    total, saver = setup.total, setup.checkpoints
    bar = progress_bar(  # off a terminal: a line every log_every steps, no redrawn bar
        total=total,
        initial=state.step,
        desc="train",
        unit="step",
        every=recipe.train.log_every,
        disable=not progress,
    )
    try:
        with _Signals() as signals:
            if state.step == 0 and setup.objective.held_out and recipe.train.eval_every:
                with meter.paused():  # the starting model on held-out data: the curve's origin
                    _held_out(setup, state, model, bar)
            if state.step < total:
                with meter.loading():
                    batch = setup.batch(state.step, model)
            while state.step < total:
                t_step = time.perf_counter()
                model, opt_state, metrics = setup.train_step(model, opt_state, batch)
                if state.step + 1 < total:  # build the next batch while the device computes
                    with meter.loading():
                        batch = setup.batch(state.step + 1, model)
                loss, finite = float(metrics["loss"]), bool(metrics["finite"])
                state.step += 1
                compile_row = meter.stepped(time.perf_counter() - t_step)
                if compile_row is not None:
                    setup.log.log({"step": state.step, **compile_row})
                if not finite:
                    skip_or_stop(setup, state, loss, bar)
                elif "spike" in metrics:
                    spike(setup, state, loss, metrics, bar)
                if watch is not None and watch(state.step, loss) and state.step < total:
                    state.interrupted = "watch"
                    break
                bar.update(1)
                if finite and (state.step % recipe.train.log_every == 0 or state.step == total):
                    _log_train(setup, state, meter, metrics, bar)
                if _due(recipe.train.eval_every, state.step, total):
                    with meter.paused():  # evaluation is not train time
                        _evaluate(setup, state, model, bar, opt_state)
                if _due(recipe.train.checkpoint_every, state.step, total):
                    meta = setup.checkpoint_meta(state.step, state.skipped)
                    saver.save(state.step, model, opt_state, meta)
                received, by = agree_on_stop(signals.received)  # the same on every process
                if received or (stop_after is not None and state.step >= stop_after):
                    if state.step < total:
                        state.interrupted, state.interrupted_by = received or "stop_after", by
                        break
            bar.close()
            if saver.last_saved != state.step:
                meta = setup.checkpoint_meta(state.step, state.skipped)
                saver.save(state.step, model, opt_state, meta, wait=True)
            saver.wait()
    finally:
        bar.close()
        saver.close(failing=sys.exc_info()[1] is not None)

    return model, opt_state


def _due(every: int, step: int, total: int) -> bool:
    """Whether a periodic action (every `every` steps, 0 = never) is due after `step`; the
    last step is left to the end of the run."""
    return bool(every) and step % every == 0 and step < total


def _announce(setup: RunSetup, echo, *, resume: bool) -> None:
    recipe, cfg, data = setup.recipe, setup.config, setup.data
    tokens = setup.total * setup.tokens_per_step
    echo(f"run folder: {setup.out}")
    echo(
        f"model: {recipe.model.variant} ({cfg.family}), {setup.n_params:,} parameters, "
        f"vocab {cfg.vocab_size}, context {cfg.max_seq_len}"
    )
    f = recipe.finetune
    if f.method == "lora" and setup.model is not None:
        trained = param_count(eqx.filter(setup.model, lora.trainable(setup.model)))
        echo(
            f"finetune: LoRA rank {f.rank}, alpha {f.alpha:g} on {', '.join(f.targets)}: "
            f"{trained:,} trainable parameters ({100 * trained / setup.n_params:.2f}%), base frozen"
        )
    elif f.method == "full":
        echo(f"finetune: every weight from {recipe.model.init_from}")
    echo(
        f"data: {data.meta['train_tokens']:,} training / {data.meta['val_tokens']:,} validation "
        f"tokens ({data.tokenizer.kind} tokenizer, {data.tokenizer.vocab_size} ids, "
        f"{data.bytes_per_token('train'):.2f} bytes/token)"
    )
    for line in setup.objective.setup_lines():
        echo(line)
    echo(
        f"training: {setup.total:,} steps x {setup.tokens_per_step:,} tokens = {tokens:,} "
        f"tokens ({tokens / setup.n_params:.1f} per parameter)"
        + (f", resuming at step {setup.start}" if resume else "")
    )
    if setup.train_step.pipeline is not None:
        echo(setup.train_step.pipeline.describe(cfg))


def _log_train(setup: RunSetup, state: RunState, meter: Throughput, metrics, bar) -> None:
    """One metrics row for the step just taken, and the progress bar's loss / tok/s / MFU."""
    tokens_per_s = meter.rate()
    m = jax.device_get(metrics)
    util = mfu(tokens_per_s, setup.flops_per_token, setup.peak_flops, setup.n_devices)
    loss = float(m["loss"])
    objective = setup.objective
    setup.log.log(
        {
            "step": state.step,
            "tokens": state.step * setup.tokens_per_step,
            "loss": loss,
            "grad_norm": float(m["grad_norm"]),
            "lr": float(m["lr"]),
            "update_norm": float(m["update_norm"]),
            "param_norm": float(m["param_norm"]),
            "tokens_per_s": tokens_per_s,
            "step_s": meter.recent_step_s(meter.first_step_s or 0.0),
            **({"mfu": util} if util is not None else {}),
            **{k: [float(x) for x in m[k]] for k in ("grad_norm/layer",) if k in m},
            # A mixture of experts' load-balancing loss and per-layer expert load.
            **{k: m[k].tolist() for k in BALANCE_METRICS if k in m},
            **{k: m[k].tolist() for k in ("z_loss", "spikes") if k in m},  # optim.z_loss, skips
            # The objective's own metrics (eqllm.train.objectives).
            **{k: float(m[k]) for k in objective.metrics if k in m},
        }
    )
    postfix = {"loss": f"{loss:.3f}"}
    postfix |= {k: f"{float(m[k]):.3f}" for k in objective.console if k in m}
    postfix["tok/s"] = f"{tokens_per_s:,.0f}"
    if util is not None:
        postfix["mfu"] = f"{util:.1%}"
    bar.set_postfix(postfix, refresh=False)
    meter.next_window()


def _held_out(setup: RunSetup, state: RunState, model, bar) -> None:
    """The objective's own metrics on held-out data (one metrics row), if any."""
    held_out = setup.objective.evaluate(model)
    if held_out:
        tokens = state.step * setup.tokens_per_step
        setup.log.log({"step": state.step, "tokens": tokens, **held_out})
        bar.write(f"step {state.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in held_out.items()))


def _evaluate(setup: RunSetup, state: RunState, model, bar, opt_state) -> None:
    """Validation loss and bits per byte during training (one metrics row), on the run's
    held-out tokens (each mixture source's too), and the objective's own held-out metrics; with
    optim.ema those of the averaged weights too ("ema/val/...")."""
    _held_out(setup, state, model, bar)
    result = evaluate_heldout(model, setup.heldout, setup.recipe)
    if "val" not in result:
        return
    rep = {k: v for k, v in result["val"].items() if k != "tokens"}  # loss, perplexity, bpb
    per_source = {}
    for label, r in result.get("sources", {}).items():  # each source's own validation loss
        per_source |= {f"val/{label}/{k}": v for k, v in r.items() if k != "tokens"}
    ema = ema_model(model, opt_state)
    if ema is not None:
        averaged = evaluate_heldout(ema, setup.heldout, setup.recipe)["val"]
        per_source |= {f"ema/val/{k}": v for k, v in averaged.items() if k != "tokens"}
    setup.log.log(
        {
            "step": state.step,
            "tokens": state.step * setup.tokens_per_step,
            **{f"val/{k}": v for k, v in rep.items()},
            **per_source,
        }
    )
    bar.write(
        f"step {state.step}: val loss {rep['loss']:.4f}, bits/byte {rep['bpb']:.4f}",
        file=sys.stderr,
    )
