"""Every `eqllm ...` command line the README and docs/ show is one the command line accepts.

Concrete command lines (in fenced code blocks) are parsed with `eqllm.cli.build_parser()`; a
synopsis line (`eqllm run RECIPE [--out DIR] ...`) cannot be parsed, so each of its `--options`
must be an option of its subcommand. Broken links and anchors are caught by the strict site
build (`mkdocs build --strict`, in .ci/run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from eqllm.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(\s*)(```+|~~~+)")
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*\s+")


def fenced_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a fenced code block."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and fence is None:
            fence = m.group(2)[0] * 3
        elif m and line.strip().startswith(fence):
            fence = None
        elif fence is not None:
            out.append((number, line))
    return out


def command_lines(page: Path) -> list[tuple[str, str]]:
    """(page:line, command) of every `eqllm ...` command in the page's code blocks, with its
    indented continuation lines joined, a shell prompt, leading VAR=value assignments and the
    commands before `&&` or `;` removed."""
    lines = fenced_lines(page.read_text())
    found = []
    for i, (number, line) in enumerate(lines):
        text = line.strip().removeprefix("$ ")
        for part in re.split(r"&&|;", text):
            part = ENV.sub("", part.strip())
            if not part.startswith("eqllm "):
                continue
            j = i + 1
            while j < len(lines) and lines[j][0] == lines[j - 1][0] + 1:
                nxt = lines[j][1]
                if not nxt[:1].isspace() or not nxt.strip().startswith(("[", "--")):
                    break
                part = part.removesuffix("\\").rstrip() + " " + nxt.strip()  # shell continuation
                j += 1
            found.append((f"{page.relative_to(ROOT)}:{number}", part))
    return found


def inline_commands(page: Path) -> list[tuple[str, str]]:
    """(page:line, command) of every `eqllm ...` code span outside the code blocks."""
    lines = page.read_text().splitlines()
    for number, _ in fenced_lines(page.read_text()):
        lines[number - 1] = ""
    text = "\n".join(lines)
    return [
        (f"{page.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}", m.group(1))
        for m in re.finditer(r"(?<!`)`(eqllm [^`]+)`(?!`)", text)
    ]


COMMANDS = [c for page in PAGES for c in command_lines(page)]
MENTIONS = [c for page in PAGES for c in inline_commands(page)]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of a parser and of its nested subcommands."""
    found = set(parser._option_string_actions)
    for sub in subparsers(parser).values():
        found |= options(sub)
    return found


def is_synopsis(argv: list[str]) -> bool:
    return any(("[" in a or "|" == a or a.endswith("...")) for a in argv)


def test_the_pages_show_commands():
    # The collectors themselves work.
    assert len(COMMANDS) >= 15 and len(MENTIONS) >= 15, (COMMANDS, MENTIONS)
    assert any(where.startswith("README.md") for where, _ in COMMANDS)


def check_options(where: str, command: str, argv: list[str]) -> None:
    commands = subparsers(build_parser())
    assert argv and argv[0] in commands, f"{where}: unknown subcommand in `{command}`"
    known = options(commands[argv[0]])
    shown = {re.match(r"--[\w-]+", a.strip("[]|")) for a in argv}
    unknown = sorted({m.group(0) for m in shown if m} - known)
    assert not unknown, f"{where}: `eqllm {argv[0]}` has no option {unknown}: `{command}`"


@pytest.mark.parametrize(("where", "command"), MENTIONS, ids=[w for w, _ in MENTIONS])
def test_a_command_in_the_text_names_real_options(where, command):
    """A command quoted in a sentence may leave out what it needs (`eqllm run --resume`)."""
    check_options(where, command, shlex.split(command)[1:])


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_shown_command_line_parses(where, command):
    argv = shlex.split(command, comments=True)[1:]
    # A shell variable stands for a value the reader supplies (`--process-id $RANK`).
    argv = ["0" if a.startswith("$") else a for a in argv]
    parser = build_parser()
    check_options(where, command, argv)
    if is_synopsis(argv):
        return
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `{command}` does not parse: {err.getvalue().strip()}")


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (mkdocs) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_the_readme_links_resolve():
    """README.md is outside the site's strict build: its relative links are checked here."""
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), f"README.md links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.MULTILINE)
            assert anchor in {slug(h) for h in headings}, f"README.md: no #{anchor} in {path}"


EXPERIMENTS = sorted(
    p for p in (ROOT / "docs" / "experiments").rglob("*.md") if p.name != "README.md"
)


@pytest.mark.parametrize("page", EXPERIMENTS, ids=[p.name for p in EXPERIMENTS])
def test_an_experiments_page_names_its_command_and_commit(page):
    """A figure can be checked only against the command that produced it and the code it ran."""
    text = page.read_text()
    named = re.search(r"^(Regenerate|Command|Tools):.*`[^`]+`", text, re.MULTILINE)
    assert named or command_lines(page), f"{page.relative_to(ROOT)}: no 'Regenerate: `command`'"
    if "(pending)" in text.splitlines()[0]:
        return  # a page of figures not yet measured has no commit to name
    assert re.search(r"commit:? `?[0-9a-f]{7,40}", text), (
        f"{page.relative_to(ROOT)}: no 'commit: `<hash>`' naming the code its figures ran"
    )


def test_the_at_scale_page_is_what_its_results_file_writes(monkeypatch):
    """docs/experiments/at_scale.md is `benchmarks/at_scale.py --write` of at_scale.json: no
    figure on it was edited by hand or left behind by a change to the script's words."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import at_scale

    text = at_scale.write_page(at_scale.load_results())
    assert text == (ROOT / "docs" / "experiments" / "at_scale.md").read_text()
