"""The README's examples run as written: every ```python block on its own (a fresh
namespace, no download), every ``kvrows`` command it shows names a subcommand, options
and families the command line has, and every ``make`` target it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvrows.app.cli import BENCH_FAMILIES, main
from kvrows.conformance.families import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """Each ```python block of ``text`` with the line its code starts on."""
    return [
        (text.count("\n", 0, match.start(1)) + 1, match.group(1))
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    ]


def kvrows_commands(text: str) -> list[str]:
    """Every ``kvrows <subcommand> ...`` the README shows as code: indented lines of its
    command blocks (up to a ``#`` comment) and inline code spans (which may wrap)."""
    lines: list[str] = []
    for line in text.splitlines():
        if not line.startswith("    "):
            continue
        code = line.split("#", 1)[0]
        if code.strip().startswith("[") and lines:  # an option line continues the command
            lines[-1] += " " + code.strip()
        else:
            lines.append(code)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    commands: list[str] = []
    for candidate in [*lines, *spans]:
        # optional VAR=value settings and a path (.venv/bin/) before the command
        match = re.match(r"(?:\w+=\S+ )*(?:\S*/)?kvrows (\w.*)$", candidate.strip())
        if match:
            commands.append(match.group(1).strip())
    return commands


BLOCKS = python_blocks(TEXT)
COMMANDS = kvrows_commands(TEXT)


def test_the_readme_has_examples_and_commands() -> None:
    # the two extractors are not vacuous: a change to the README's markup that hides its
    # examples from them fails here
    assert len(BLOCKS) >= 4, BLOCKS
    assert {command.split()[0] for command in COMMANDS} >= {
        "demo",
        "conform",
        "bench",
        "example",
        "classes",
    }


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_a_python_block_runs_as_written(
    line: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a block may write files (a saved prompt cache)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    exec(compile(code, f"README.md, block at line {line}", "exec"), namespace)


#: A long option, whole (``--kv`` is not ``--kv-start``).
OPTION = r"(?<![\w-])--[a-z][a-z0-9-]*"


def _help(subcommand: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main([subcommand, "--help"])
    assert exited.value.code == 0, f"`kvrows {subcommand}` is not a command"
    return capsys.readouterr().out


def test_every_kvrows_command_shown_exists(capsys: pytest.CaptureFixture[str]) -> None:
    helps: dict[str, str] = {}
    for command in COMMANDS:
        subcommand, *rest = command.split()
        if "--" in rest:  # what follows is another program's command line (kvrows launch)
            rest = rest[: rest.index("--")]
        if subcommand not in helps:
            helps[subcommand] = _help(subcommand, capsys)
        has = set(re.findall(OPTION, helps[subcommand]))
        unknown = [option for option in re.findall(OPTION, " ".join(rest)) if option not in has]
        assert not unknown, f"`kvrows {command}`: kvrows {subcommand} has no {unknown}"
        known = {"bench": set(BENCH_FAMILIES), "conform": set(FAMILIES)}.get(subcommand)
        for listed in re.findall(r"--family[ =]([\w|-]+)", command):
            missing = set(listed.split("|")) - (known or set())
            assert not missing, f"`kvrows {command}`: no {subcommand} family {missing}"


def test_every_make_target_shown_exists() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    shown = set(re.findall(r"(?:^ {4}|`)make ([\w-]+)", TEXT, re.MULTILINE))
    assert {"demo", "test"} <= shown
    assert shown <= targets, shown - targets


def test_the_readme_starts_with_the_two_commands() -> None:
    first = [line.split("#", 1)[0].strip() for line in TEXT.splitlines()[1:6] if line.strip()]
    assert first[:2] == ["make demo", "make test"], first
