"""Progress off a terminal: a plain line every N steps, never a carriage-return redraw."""

import io
import re

from tqdm.auto import tqdm

from eqllm.progress import LineProgress, progress_bar


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_file_gets_a_line_every_n_steps():
    out = io.StringIO()
    bar = progress_bar(total=25, desc="train", unit="step", every=10, file=out)
    assert isinstance(bar, LineProgress)
    for step in range(25):
        bar.set_postfix({"loss": f"{3 - step / 10:.2f}"})
        bar.update(1)
        if step == 11:
            bar.write("eval at 12")
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("train")] == [
        "10/25",
        "20/25",
        "25/25",
    ]
    assert lines[1] == "eval at 12"
    assert "(40%) loss=2.10 |" in lines[0] and "step/s" in lines[0]


def test_a_resumed_run_counts_from_its_step():
    out = io.StringIO()
    bar = progress_bar(total=100, initial=95, desc="train", unit="step", every=10, file=out)
    bar.update(3)
    bar.close()
    assert out.getvalue().split()[1] == "98/100"


def test_disabled_writes_nothing_and_a_terminal_gets_tqdm():
    out = io.StringIO()
    bar = progress_bar(total=5, every=1, disable=True, file=out)
    bar.update(5)
    bar.close()
    assert out.getvalue() == ""
    assert isinstance(progress_bar(total=5, file=_Terminal()), tqdm)


def test_tokenizing_to_a_log_file_writes_a_line_per_tenth(tmp_path, capsys):
    """eqllm.data.prepare off a terminal (stderr captured here): plain lines, at most one per
    tenth of the bytes, ending at the total. Progress moves shard by shard, so the corpus is
    cut into shards of about 2 kB (a dozen)."""
    from eqllm.data import DataSource, prepare

    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(40):
        (folder / f"{i}.txt").write_text(f"document {i} " * 50)
    cache = tmp_path / "cache"
    prepare(DataSource.files(folder), "bytes", cache_dir=cache, chunk_bytes=1000, shard_bytes=2000)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("tokenizing")]
    assert 2 <= len(lines) <= 11
    done, total = re.search(r"\) (\d+)/(\d+) B", lines[-1]).groups()  # "...) n/total B"
    assert done == total
