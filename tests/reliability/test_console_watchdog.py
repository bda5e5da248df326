"""The pieces of a multi-process run that work without several processes: the split console
and the lost-process watchdog's decisions (against an in-memory key-value store).

The same behaviour with real processes: tests/reliability/test_processes.py (slow).
"""

from __future__ import annotations

import io
import sys

import pytest

from eqllm.commands import run as run_command
from eqllm.errors import EqllmError
from eqllm.train import console, watchdog
from eqllm.train.processes import agree_on_stop, gather


def tee(show_all: bool):
    log, screen = io.StringIO(), io.StringIO()
    return console._Tee(log, screen, show_all=show_all, prefix="[process 1] "), log, screen


def test_other_processes_show_only_warnings_and_errors_prefixed():
    stream, log, screen = tee(show_all=False)
    stream.write("run folder: runs/x\nstep 7: val loss 4.1, bits/byte 5.9\n")
    stream.write("WARNING: checkpoint 9 is damaged\ntrain:  40%|#### | 4/10\rtrain: 50%|")
    stream.write("##### | 5/10\n")
    stream.write('Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad\n')
    stream.write("after\n")
    assert screen.getvalue() == (
        "[process 1] WARNING: checkpoint 9 is damaged\n"
        "[process 1] Traceback (most recent call last):\n"
        '[process 1]   File "x.py", line 1\n'
        "[process 1] ValueError: bad\n"
    )
    lines = log.getvalue().splitlines()
    assert lines[:3] == [
        "run folder: runs/x",
        "step 7: val loss 4.1, bits/byte 5.9",
        "WARNING: checkpoint 9 is damaged",
    ]
    assert lines[3] == "train: 50%|##### | 5/10"  # the bar's last drawing, once
    assert lines[-1] == "after"


def test_process_zero_shows_everything_and_logs_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    screen_out, screen_err = sys.stdout, sys.stderr
    path = console.split_console(tmp_path, 0)
    print("run folder: x")
    print("step 3: val loss 1.0", file=sys.stderr)
    assert screen_out.getvalue() == "run folder: x\n"
    assert screen_err.getvalue() == "step 3: val loss 1.0\n"
    assert path == tmp_path / "logs" / "process-0.log"
    assert path.read_text() == "run folder: x\nstep 3: val loss 1.0\n"


def test_one_process_agrees_with_itself():
    assert gather(5) == [5]
    assert agree_on_stop(None) == (None, None)
    assert agree_on_stop("SIGTERM") == ("SIGTERM", 0)


class FakeClient:
    """The key-value calls the watchdog makes, in memory."""

    def __init__(self):
        self.kv: dict[str, str] = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        if key in self.kv and not allow_overwrite:
            raise RuntimeError("ALREADY_EXISTS")
        self.kv[key] = value

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.kv[key]

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def make_dog(tmp_path, index=0, count=3, lost_after=10.0):
    """A watchdog of process `index` of `count`, its exits recorded instead of taken."""
    exits = []
    dog = watchdog.Watchdog(tmp_path / "checkpoints", lost_after=lost_after, exit=exits.append)
    dog.index, dog.count = index, count
    return dog, exits


def test_a_silent_process_is_lost_after_the_bound(tmp_path):
    dog, _ = make_dog(tmp_path)
    client, seen = FakeClient(), {}
    client.kv.update({"eqllm/processes/alive/1": "1", "eqllm/processes/alive/2": "1"})
    assert dog._lost(client, seen, now=0.0) is None
    client.kv["eqllm/processes/alive/1"] = "2"  # process 1 beats, process 2 does not
    assert dog._lost(client, seen, now=9.0) is None
    client.kv["eqllm/processes/alive/1"] = "3"
    index, why = dog._lost(client, seen, now=10.0)
    assert index == 2 and "no heartbeat for 10 s" in why


def test_done_processes_are_not_waited_for_and_failed_ones_are_lost(tmp_path):
    dog, _ = make_dog(tmp_path)
    client, seen = FakeClient(), {}
    client.kv.update({"eqllm/processes/end/1": "done", "eqllm/processes/alive/2": "7"})
    assert dog._lost(client, seen, now=0.0) is None
    assert dog._lost(client, seen, now=5.0) is None
    client.kv["eqllm/processes/end/2"] = "failed"
    # Not at once: its own error, if it is the same, is this process's to print first.
    assert dog._lost(client, seen, now=6.0) is None
    assert dog._lost(client, seen, now=6.0 + dog.grace) == (
        2,
        "it stopped with an error (see its log)",
    )


def test_the_first_to_notice_records_it_and_the_message_names_the_checkpoint(tmp_path, capsys):
    for step in ("3", "6", "9.damaged"):
        (tmp_path / "checkpoints" / step).mkdir(parents=True)
    (tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp-1").mkdir()
    client = FakeClient()
    first, exits = make_dog(tmp_path, index=0, lost_after=0.1)  # a short grace
    first._fire(client, 2, "no heartbeat for 10 s: killed, crashed or its host lost")
    assert exits == [1]
    message = capsys.readouterr().err.strip()
    assert message.startswith("eqllm: error: process 2 of 3 was lost (no heartbeat for 10 s")
    assert "last complete checkpoint is step 6 in" in message and "--resume" in message
    # Another process reads the record and stops for the same reason.
    other, _ = make_dog(tmp_path, index=1)
    assert other._lost(client, {}, now=0.0) == (
        2,
        "no heartbeat for 10 s: killed, crashed or its host lost",
    )


@pytest.mark.parametrize("lines", [0, 1])
def test_no_checkpoint_yet_is_said(tmp_path, capsys, lines):
    if lines:
        (tmp_path / "checkpoints").mkdir()
    dog, exits = make_dog(tmp_path, lost_after=0.1)
    dog._fire(FakeClient(), 1, "gone")
    assert exits == [1] and "no checkpoint was completed yet" in capsys.readouterr().err


SLURM = {
    "SLURM_JOB_ID": "17",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


@pytest.mark.parametrize("tasks, found", [("2", "SlurmCluster"), ("1", None)])
def test_srun_of_several_tasks_is_detected_without_flags(monkeypatch, tasks, found):
    for key, value in {**SLURM, "SLURM_NTASKS": tasks}.items():
        monkeypatch.setenv(key, value)
    assert run_command.cluster_detected() == found


def test_no_cluster_here_and_bad_flags_are_refused(monkeypatch):
    for key in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(key, raising=False)
    assert run_command.cluster_detected() is None
    with pytest.raises(EqllmError, match="go together"):
        run_command.join_processes("localhost:1", None, None)
    with pytest.raises(EqllmError, match="--lost-after=0"):
        run_command.join_processes(None, None, None, lost_after=0.0)
