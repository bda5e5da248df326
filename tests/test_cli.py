"""The command line's error policy: bad input is one line and exit 2, a bug keeps its traceback."""

import pytest

from eqllm import cli, zoo
from eqllm.errors import EqllmError


def test_bad_input_is_one_error_line_and_exit_2(capsys):
    assert cli.main(["zoo", "show", "llama-nano", "--mesh", "data=-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eqllm: error: --mesh data=-1: give every axis a size")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_an_eqllm_error_anywhere_prints_one_line(monkeypatch, capsys):
    def bad_input():
        raise EqllmError("zoo file zoo/x.toml: n_layers='two' must be an int;\nfix the table")

    monkeypatch.setattr(zoo, "names", bad_input)
    assert cli.main(["zoo", "list"]) == 2
    err = capsys.readouterr().err
    expected = "zoo file zoo/x.toml: n_layers='two' must be an int; fix the table"
    assert err == f"eqllm: error: {expected}\n"


@pytest.mark.parametrize("error", [TypeError, KeyError, ValueError, FileNotFoundError])
def test_a_bug_is_not_turned_into_an_error_line(monkeypatch, capsys, error):
    def bug():
        raise error("a bug in eqllm")

    monkeypatch.setattr(zoo, "names", bug)
    with pytest.raises(error, match="a bug in eqllm"):
        cli.main(["zoo", "list"])
    assert "eqllm: error" not in capsys.readouterr().err


def test_the_command_line_configures_the_process_first(monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "configure_process", lambda: calls.append("configure"))
    monkeypatch.setattr(zoo, "names", lambda: calls.append("command") or [])
    assert cli.main(["zoo", "list"]) == 0
    assert calls == ["configure", "command"]


def test_every_documented_subcommand_is_registered():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) >= {"zoo", "run", "eval", "generate", "convert", "bench", "analyze"}


def test_a_skip_fails_in_ci(tmp_path):
    """With CI=true a missing extra is a failure, not a silent skip (tests/ci_strict.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "test_extra.py").write_text(
        'import pytest\nnot_there = pytest.importorskip("no_such_extra_module")\n'
        "def test_x():\n    pass\n"
    )
    tests = str(Path(__file__).parent)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "ci_strict", "-p", "no:cacheprovider"]
    args += ["--rootdir", str(tmp_path), str(tmp_path)]
    # Exit 5: nothing ran (the module skipped); 2: a collection error stopped the run.
    for ci, expected in (("", 5), ("true", 2)):
        env = {**os.environ, "CI": ci, "PYTHONPATH": tests}
        result = subprocess.run(args, env=env, capture_output=True, text=True, cwd=tmp_path)
        assert result.returncode == expected, result.stdout[-2000:]
    assert "module skipped with CI=true" in result.stdout
