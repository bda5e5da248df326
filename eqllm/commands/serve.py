"""`eqllm serve`: an OpenAI-compatible server for any model eqllm loads.

The model is loaded (optionally cast to bfloat16 or quantized to int8 weights), the KV cache's
size is logged (a pool of blocks sized by `--kv-cache-memory`, by default a share of the free
memory), the engine's compiled shapes are listed and compiled, and only then does the server
listen, on 127.0.0.1 unless `--host` says otherwise. `--mesh tensor=N` splits the weights and
the KV cache over N devices (`data=D` also splits the slots over D replicas). SIGTERM or Ctrl-C
stops accepting connections, lets the requests in flight finish, and exits 0. `--speculate K`
decodes speculatively, K guesses per round from prompt lookup or from `--draft MODEL`.
`--adapter name=path` (repeatable) serves LoRA adapters over the one base: a request's `model`
field picks one. See docs/serve.md.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading
import time
from pathlib import Path

import jax
import uvicorn

from eqllm import loading
from eqllm.data import Tokenizer
from eqllm.data.instruct import ChatFormat
from eqllm.errors import EqllmError
from eqllm.generation.placement import serving_mesh
from eqllm.nn import quantize
from eqllm.resources import setup_compile_cache
from eqllm.serve import Engine
from eqllm.serve.adapters import load_adapters, parse_specs
from eqllm.serve.app import Service, create_app


def chat_format_of(spec: str, tokenizer: Tokenizer | None) -> ChatFormat | None:
    """The model's chat format: the chat template of its folder (or run folder), else eqllm's
    default; None without a tokenizer. The same reading as `eqllm generate --chat`."""
    if tokenizer is None:
        return None
    return loading.chat_format_of(spec, tokenizer)


def _host():
    """The CPU device, where a model is loaded before it is split over a mesh."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # JAX started without its CPU backend: load on the default device
        return None


def run(args: argparse.Namespace) -> int:
    """The `eqllm serve` command."""
    log = logging.getLogger("eqllm.serve")
    handler = logging.StreamHandler()  # our own: libraries may have configured the root logger
    handler.setFormatter(logging.Formatter("eqllm serve: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    if args.draft is not None and args.speculate is None:
        raise EqllmError("--draft needs --speculate K (guesses per round, e.g. --speculate 4)")
    if args.api_key is not None and not args.api_key:
        raise EqllmError("--api-key is empty; give a key or leave the option out")
    mesh = None if args.mesh is None else serving_mesh(args.mesh)
    name = args.served_model_name or Path(args.model.rstrip("/")).name
    specs = parse_specs(args.adapter, name)
    setup_compile_cache(args.compile_cache)
    start = time.perf_counter()
    # On a mesh the weights go from host memory straight to their shards: a model larger
    # than one accelerator never sits whole on one.
    with contextlib.nullcontext() if mesh is None else jax.default_device(_host()):
        model, tokenizer = loading.load(args.model, dtype=args.dtype, seed=args.seed)
        if specs:
            model = load_adapters(model, specs)
        if args.quantize is not None:
            model = quantize(model, args.quantize)
    if args.tokenizer is not None:
        tokenizer = Tokenizer.from_spec(args.tokenizer)
    draft = _draft(args)
    engine = Engine(
        model,
        max_batch=args.max_batch,
        max_len=args.max_len,
        prefill_chunk=args.prefill_chunk,
        max_queue=args.max_queue,
        mesh=mesh,
        block_size=args.block_size,
        kv_memory=None if args.kv_cache_memory is None else parse_size(args.kv_cache_memory),
        prefix_cache=not args.no_prefix_cache,
        decode_steps=args.decode_steps,
        speculate=args.speculate,
        draft=draft,
    )
    del model, draft  # the engine holds the weights it runs on (sliced into layers)
    log.info("loaded %s in %.1f s", args.model, time.perf_counter() - start)
    if specs:
        log.info("adapters: %s", ", ".join(f"{n} ({p})" for n, p in specs))
    log.info("%s", engine.describe())
    log.info("compiling:")
    for line in engine.shapes():
        log.info("  %s", line)
    warm = time.perf_counter()
    engine.warm()
    log.info("compiled in %.1f s", time.perf_counter() - warm)
    service = Service(
        engine,
        tokenizer,
        model_name=name,
        chat_format=chat_format_of(args.model, tokenizer),
        api_key=args.api_key,
        adapters=[n for n, _ in specs],
    )
    config = uvicorn.Config(
        create_app(service),
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    # uvicorn handles SIGTERM / SIGINT (stop accepting, drain, return), then raises the signal
    # again for the handler in place before it: a no-op one, so a clean shutdown exits 0.
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: None)
    server = uvicorn.Server(config)
    ready = f"ready: model {name!r} on http://{args.host}:{args.port}/v1"
    threading.Thread(target=_announce, args=(server, log, ready), daemon=True).start()
    server.run()
    log.info("stopped")
    return 0


def _draft(args: argparse.Namespace):
    """The draft model `--draft` names (loaded as the target is), or None."""
    if args.draft is None:
        return None
    draft, _ = loading.load(args.draft, dtype=args.dtype, seed=args.seed)
    return draft


def parse_size(text: str) -> int:
    """Bytes from '4GiB', '512MiB', '2GB', '1.5G' or a plain number of bytes."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    units |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    number = text.strip().lower().removesuffix("b")
    digits = number.rstrip("kmgti")
    try:
        value = float(digits) * units[number[len(digits) :]]
    except (ValueError, KeyError):
        raise EqllmError(
            f"--kv-cache-memory {text!r} is not a size; give e.g. 4GiB, 512MiB or 2GB"
        ) from None
    if value <= 0:
        raise EqllmError(f"--kv-cache-memory {text!r} must be positive")
    return int(value)


def _announce(server: uvicorn.Server, log: logging.Logger, line: str) -> None:
    """Log `line` once the server listens: a client that connects on "ready" is answered."""
    while not server.started and not server.should_exit:
        time.sleep(0.02)
    if server.started:
        log.info("%s", line)


def add_parser(commands) -> None:
    """Register `eqllm serve` on the CLI's subcommands."""
    p = commands.add_parser(
        "serve", help="an OpenAI-compatible server (continuous batching)", description=__doc__
    )
    p.add_argument("model", help="a zoo name, HF folder or repo id, eqllm folder or run folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=32, help="requests decoded together")
    p.add_argument("--max-len", type=int, default=None, help="prompt + output tokens per request")
    p.add_argument(
        "--prefill-chunk", type=int, default=128, help="prompt tokens prefilled per round"
    )
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    p.add_argument(
        "--kv-cache-memory",
        default=None,
        help="memory for the paged KV cache, e.g. 4GiB (default: 90%% of a GPU's or TPU's free "
        "memory; on a CPU half the available memory, at most 4 GiB)",
    )
    p.add_argument("--block-size", type=int, default=16, help="positions per KV cache block")
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="compute every prompt in full (default: reuse the cached blocks of equal prefixes)",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=1,
        help="tokens a decode call runs on device while no prompt waits (default 1)",
    )
    p.add_argument(
        "--speculate",
        type=int,
        default=None,
        metavar="K",
        help="speculative decoding: verify K guessed tokens per round in one forward; the "
        "guesses come from --draft, else from prompt lookup (n-gram matches in the prompt and "
        "output); greedy output is unchanged, sampled output keeps its distribution",
    )
    p.add_argument(
        "--draft",
        default=None,
        metavar="MODEL",
        help="a smaller model sharing the tokenizer that guesses for --speculate (a zoo name, "
        "folder or repo id, as MODEL); default: prompt lookup",
    )
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve a LoRA adapter (a PEFT folder or an eqllm LoRA run folder) as model NAME "
        "over the one base model; repeat for more; requests for different adapters share a batch",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--quantize", choices=["int8"], default=None, help="int8 weights")
    p.add_argument(
        "--mesh",
        default=None,
        help="split the model over devices, e.g. tensor=4 (heads, MLP units and KV cache) or "
        "data=2,tensor=4 (also the slots over 2 replicas); default: one device",
    )
    p.add_argument(
        "--compile-cache",
        default="",
        help="JAX's persistent compilation cache folder (default: $EQLLM_CACHE/jax or "
        "~/.cache/eqllm/jax; 'off' disables it): a restart compiles less",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None, help="the model id clients send")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec: bytes, a path or org/name")
    p.add_argument("--seed", type=int, default=0, help="weights of a zoo name")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain")
    p.set_defaults(func=run)
