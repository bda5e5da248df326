"""Time to first token of `eqllm generate` and of `eqllm serve`'s first request, cold and warm.

Writes a random-weight model in Hugging Face format (default smollm-135m's shape, fp32, with a
1024-token BPE trained on a few standard-library files), then, with one fresh persistent
compilation cache, runs each command twice: cold (empty cache) and warm (the cache the first
run filled). For `eqllm generate --prompt ... --max-new-tokens 8 --timings` it prints the
command's own breakdown (startup, load, tokenize, prefill with its trace / lower / XLA compile,
the rest) and its time to first token from the process's start. With `--serve`, it also
starts `eqllm serve` on a free port and reports the time to its ready line (every shape
compiled) and the first streamed request's time to first token.

    PYTHONPATH=$PWD python benchmarks/ttft.py [--model smollm-135m] [--serve]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import jax

import eqllm
from eqllm.data import Tokenizer

PROMPT = "def main(argv):"


def write_model(name: str, folder: Path) -> None:
    texts = [Path(m.__file__).read_text() for m in (os, json, subprocess, threading, argparse)]
    tokenizer = Tokenizer.train_bpe(texts, 1024)
    model = eqllm.zoo.create(name, key=jax.random.key(0))
    eqllm.hub.save_pretrained(model, folder, tokenizer=tokenizer)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}


def time_generate(folder: Path, cache: Path) -> tuple[float, str]:
    """(seconds from spawn to exit, the command's stderr with its --timings breakdown)."""
    command = [sys.executable, "-m", "eqllm.cli", "generate", str(folder), "--prompt", PROMPT]
    command += ["--max-new-tokens", "8", "--timings", "--compile-cache", str(cache)]
    start = time.perf_counter()
    result = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    return time.perf_counter() - start, result.stderr


def time_serve(folder: Path, cache: Path) -> tuple[float, float]:
    """(seconds from spawn to 'ready', seconds to the first streamed token of one request)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "eqllm.cli", "serve", str(folder), "--port", str(port)]
    command += ["--max-batch", "4", "--max-len", "256", "--compile-cache", str(cache)]
    start = time.perf_counter()
    process = subprocess.Popen(command, env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:  # ends when the process does
            if "ready" in line:
                break
        ready = time.perf_counter() - start
        threading.Thread(target=process.stderr.read, daemon=True).start()
        body = {"model": folder.name, "prompt": PROMPT, "max_tokens": 8, "stream": True}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        sent = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            response.readline()
            first = time.perf_counter() - sent
            response.read()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    return ready, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm-135m")
    parser.add_argument("--serve", action="store_true", help="also time eqllm serve")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder, cache = Path(tmp) / "model", Path(tmp) / "jax-cache"
        write_model(args.model, folder)
        print(
            f"{args.model} (random fp32 weights), prompt {PROMPT!r}, load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
        for run in ("cold", "warm"):
            wall, err = time_generate(folder, cache)
            print(f"\neqllm generate, {run}: {wall:.2f} s in all")
            print(err[err.index("timings:") :].rstrip())
        if args.serve:
            for run in ("cold", "warm"):
                ready, first = time_serve(folder, cache)
                print(
                    f"\neqllm serve, {run}: ready after {ready:.2f} s, first request's first "
                    f"token after {first:.2f} s"
                )


if __name__ == "__main__":
    main()
