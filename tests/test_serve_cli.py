"""`eqllm serve` as a process: it says what memory its KV cache reserved, lists and compiles its
shapes before saying ready, binds to 127.0.0.1, and on SIGTERM finishes the stream in flight
and exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.serve_helpers import free_port, tiny_folder  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_serve_lists_shapes_then_drains_on_sigterm_and_exits_0(tmp_path):
    folder = tiny_folder(tmp_path / "model", context=64)
    port = free_port()
    command = [sys.executable, "-m", "eqllm.cli", "serve", str(folder), "--port", str(port)]
    command += ["--max-batch", "2", "--max-len", "64", "--prefill-chunk", "16"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True).start()
    try:
        for _ in range(1200):  # bounded: 10 minutes for loading and compiling
            if any("ready" in line for line in lines) or process.poll() is not None:
                break
            time.sleep(0.5)
        assert any("ready" in line for line in lines), "".join(lines)
        log = "".join(lines)
        assert "decode: 2 slots x 64 positions" in log and "prefill: 1 prompts x 16 tokens" in log
        assert re.search(r"KV cache: [0-9,]+ blocks of 16 positions .* GiB reserved", log)
        assert log.index("prefill: ") < log.index("ready")
        assert f"127.0.0.1:{port}" in log
        body = {"model": "model", "prompt": [5], "max_tokens": 60, "stream": True}
        body["ignore_eos"] = True
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            first = response.readline()
            assert first.startswith(b"data: ")
            process.send_signal(signal.SIGTERM)  # mid-stream
            rest = response.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
