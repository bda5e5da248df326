"""The PyTorch side of `eqllm bench`: Hugging Face transformers' model of the same architecture.

The model is `AutoModelForCausalLM.from_config` on `eqllm.hub.to_hf_config(cfg)` (GPT2LMHeadModel,
LlamaForCausalLM, ...), trained with `torch.optim.AdamW` under the same hyperparameters as the
eqllm step: learning-rate schedule, betas, eps, weight decay on matrices only (not embeddings,
norms or biases), global-norm clipping; the loss is the mean next-token cross entropy over the
same batch. Eager, or with `torch.compile` on the model (forward + backward).
torch and transformers are imported lazily: they are the optional `torch` extra.
"""

from __future__ import annotations

import os
import time

import numpy as np

from eqllm.config import ModelConfig
from eqllm.errors import EqllmError
from eqllm.hub import to_hf_config
from eqllm.recipe import OptimSpec
from eqllm.train.optim import schedule

INSTALL_HINT = "install the torch extra: pip install 'eqllm[torch]'"


class MissingTorch(EqllmError, ImportError):
    """PyTorch or transformers is not installed (the optional `torch` extra)."""


def import_torch():
    """(torch, transformers), or `MissingTorch` (an ImportError) that says how to install them."""
    try:
        import torch
        import transformers
    except ImportError as e:
        message = f"--vs-torch needs PyTorch and transformers ({e}); {INSTALL_HINT}"
        raise MissingTorch(message) from e
    return torch, transformers


def cpu_threads() -> int:
    """The CPUs this process may run on (what XLA's CPU client uses too)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class TorchBench:
    """One transformers training step on a fixed batch, ready to be timed step by step.

    Arguments:
        config: the model (already through `bench_config`; its compute_dtype picks autocast).
        tokens: the (batch, seq + 1) batch shared with the eqllm side.
        optim, total_steps: as for `JaxBench`.
        compiled: wrap the model in `torch.compile`.
    """

    def __init__(
        self,
        config: ModelConfig,
        tokens: np.ndarray,
        *,
        optim: OptimSpec | None = None,
        total_steps: int = 1000,
        compiled: bool = False,
        seed: int = 0,
    ):
        torch, transformers = import_torch()
        optim = optim or OptimSpec()

        self.torch = torch
        self.framework = "transformers + torch.compile" if compiled else "transformers eager"
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(cpu_threads())
        torch.manual_seed(seed)
        hf = to_hf_config(config)
        model_type = hf.pop("model_type")
        hf.pop("architectures", None)
        hf.pop("torch_dtype", None)
        hf_config = transformers.AutoConfig.for_model(model_type, **hf)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        model.to(self.device).train()
        self.params = sum(p.numel() for p in model.parameters())
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        decay = [p for p in model.parameters() if p.ndim >= 2 and id(p) not in embeddings]
        no_decay = [p for p in model.parameters() if p.ndim < 2 or id(p) in embeddings]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": optim.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=optim.lr,
            betas=(optim.b1, optim.b2),
            eps=optim.eps,
        )
        # The same schedule as the eqllm step, evaluated once up front.
        lr_of = schedule(optim, total_steps)
        self.lrs = [float(lr_of(i)) for i in range(min(total_steps, 10_000))]
        self.clip_norm = optim.clip_norm
        self.model = model
        self.forward = torch.compile(model, dynamic=False) if compiled else model
        self.compiled = compiled
        self.autocast_dtype = torch.bfloat16 if config.compute_dtype == "bfloat16" else None
        t = torch.from_numpy(np.asarray(tokens, np.int64)).to(self.device)
        self.inputs, self.targets = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        self.n_steps = 0

    def _loss(self):
        torch = self.torch
        logits = self.forward(input_ids=self.inputs).logits
        return torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), self.targets.reshape(-1)
        )

    def step(self) -> float:
        """Run one training step; returns its wall time (seconds, synchronised)."""
        torch = self.torch
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lrs[min(self.n_steps, len(self.lrs) - 1)]
        if self.autocast_dtype is not None:
            with torch.autocast(self.device, dtype=self.autocast_dtype):
                loss = self._loss()
        else:
            loss = self._loss()
        loss.backward()
        if self.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.n_steps += 1
        return time.perf_counter() - t0

    def device_peak_memory(self) -> int | None:
        """Peak bytes allocated on the GPU (None on CPU)."""
        if self.device != "cuda":
            return None
        return int(self.torch.cuda.max_memory_allocated())
