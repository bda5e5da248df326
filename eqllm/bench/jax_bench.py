"""The eqllm side of `eqllm bench`: the real `TrainStep` + `make_optimizer`, timed.

The step measured is the one `eqllm run` runs: forward, backward, AdamW update and metrics in
one compiled call, with the model and optimizer state donated.
"""

from __future__ import annotations

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqllm.config import ModelConfig
from eqllm.model import CausalLM
from eqllm.recipe import OptimSpec
from eqllm.train.optim import make_optimizer, schedule
from eqllm.train.step import TrainStep, init_opt_state
from eqllm.trees import param_count


def random_tokens(vocab_size: int, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    """A (batch, seq + 1) int32 batch of uniform token ids: timing does not depend on the text."""
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, seq + 1), dtype=np.int32)


def bench_config(
    cfg: ModelConfig, seq: int, dtype: str = "float32", remat: str = "none"
) -> ModelConfig:
    """`cfg` set up to be benchmarked: compute dtype, remat, context at least `seq`.

    The layer loop stays as the variant sets it (`scan_layers`; `--set scan_layers=...`).
    """
    return cfg.replace(compute_dtype=dtype, remat=remat, max_seq_len=max(cfg.max_seq_len, seq))


class JaxBench:
    """A compiled eqllm training step on a fixed batch, ready to be timed step by step.

    Arguments:
        config: the model (already through `bench_config`).
        tokens: the (batch, seq + 1) batch, shared with the other frameworks.
        optim: AdamW hyperparameters (the torch side uses the same).
        total_steps: length of the schedule (only shapes the learning rate).
        document_length: packed documents of this many tokens, masked from each other
            (segment ids; `eqllm.data.segments`); None: one document per row, no mask.
    """

    framework = "eqllm (jax)"

    def __init__(
        self,
        config: ModelConfig,
        tokens: np.ndarray,
        *,
        optim: OptimSpec | None = None,
        total_steps: int = 1000,
        seed: int = 0,
        document_length: int | None = None,
    ):
        optim = optim or OptimSpec()
        self.config = config
        self.model = CausalLM(config, key=jax.random.key(seed))
        self.params = param_count(self.model)
        params = eqx.filter(self.model, eqx.is_inexact_array)
        optimizer = make_optimizer(optim, total_steps, params)
        self.train_step = TrainStep(optimizer, schedule(optim, total_steps))
        self.opt_state = init_opt_state(optimizer, self.model)
        self.batch = jnp.asarray(tokens)
        self.segment_ids = None
        if document_length is not None:
            ids = np.arange(tokens.shape[1], dtype=np.int32) // document_length
            self.segment_ids = jnp.asarray(np.broadcast_to(ids, tokens.shape))
        self.compiled = None
        self.lower_s = self.compile_s = None
        self.memory_bytes: int | None = None
        self.memory_source = "-"
        self.xla_flops: float | None = None

    def compile(self) -> float:
        """Trace, lower and compile the step; returns the seconds it took (both phases)."""
        t0 = time.perf_counter()
        lowered = self.train_step.lower(
            self.model, self.opt_state, self.batch, segment_ids=self.segment_ids
        )
        t1 = time.perf_counter()
        self.compiled = lowered.compile()
        t2 = time.perf_counter()
        self.lower_s, self.compile_s = t1 - t0, t2 - t1
        self._memory(self.compiled.compiled)
        return t2 - t0

    def _memory(self, compiled) -> None:
        try:
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            self.xla_flops = float(cost["flops"]) if cost and "flops" in cost else None
        except Exception:  # cost analysis is best-effort and backend-dependent
            self.xla_flops = None
        try:
            m = compiled.memory_analysis()
            self.memory_bytes = int(
                m.argument_size_in_bytes
                + m.output_size_in_bytes
                + m.temp_size_in_bytes
                - m.alias_size_in_bytes
            )
            self.memory_source = "XLA buffer assignment (arguments + outputs + temporaries)"
        except Exception:
            self.memory_bytes = None

    def step(self) -> float:
        """Run one training step; returns its wall time (seconds, synchronised)."""
        if self.compiled is None:
            self.compile()
        t0 = time.perf_counter()
        self.model, self.opt_state, metrics = self.compiled(
            (self.batch, None, self.segment_ids), self.model, self.opt_state
        )
        metrics["loss"].block_until_ready()
        jax.block_until_ready(self.model)
        return time.perf_counter() - t0

    def device_peak_memory(self) -> int | None:
        """Peak bytes in use on the accelerator (None on CPU, where the XLA figure is used)."""
        stats = jax.devices()[0].memory_stats() if jax.devices()[0].platform != "cpu" else None
        if stats and "peak_bytes_in_use" in stats:
            self.memory_source = "device allocator peak (memory_stats)"
            return int(stats["peak_bytes_in_use"])
        return None


class MatmulProbe:
    """The CPU's fp32 matmul peak, re-measured between steps so that it sees the same load."""

    def __init__(self, size: int = 2048):
        self.size = size
        self.x = jnp.ones((size, size), jnp.float32)
        self._mm = jax.jit(lambda a: a @ a)
        self._mm(self.x).block_until_ready()
        self.best: float = 0.0

    def measure(self) -> float:
        t0 = time.perf_counter()
        self._mm(self.x).block_until_ready()
        flops = 2 * self.size**3 / (time.perf_counter() - t0)
        self.best = max(self.best, flops)
        return flops
