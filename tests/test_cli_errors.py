"""``kvrows`` never shows a traceback and never accepts nonsense (issue 22).

Every subcommand with bad values: exit status 2, one line on stderr naming the option,
nothing run. A model path that is not a model says which; a built-in name misspelt lists
the built-in names. Requests the engine rejected are reported, not passed, and exit 1.
Anything else that escapes is one line and exit status 2.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvrows.app import bench, cli
from kvrows.app.demo import run_paged_demo
from kvrows.app.models import tiny_model
from kvrows.errors import InvalidInputError


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may wait on the Hugging Face Hub (the machine has no network)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(cli.TRACEBACK_VARIABLE, raising=False)


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The commands that got past validation (a refusal must come before any work)."""
    calls: list[Any] = []

    def record(args: Any) -> int:
        calls.append(args)
        return 0

    monkeypatch.setattr(cli, "_run", record)
    return calls


def _refused(
    argv: list[str], capsys: pytest.CaptureFixture[str], *fragments: str
) -> str:  # fmt: skip
    """``argv`` exits 2 with one line on stderr holding every fragment (after the stage
    lines of a demo that had started), nothing on stdout."""
    status = cli.main(argv)
    out, err = capsys.readouterr()
    assert status == 2, (argv, out, err)
    assert out == ""
    *stages, line = err.splitlines()
    assert all(re.match(r"kvrows demo \[\d+/\d+\] ", stage) for stage in stages), err
    assert line.startswith("kvrows"), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


BAD_VALUES: list[tuple[list[str], tuple[str, ...]]] = [
    ([], ("command",)),
    (["nosuch"], ("nosuch",)),
    (["example", "--bogus"], ("--bogus",)),
    (["classes", "extra"], ("extra",)),
    (["conform", "--family", "nope"], ("--family", "nope", "plain")),
    (["conform", "--profile", "nope"], ("--profile",)),
    (["conform", "--seed", "x"], ("--seed",)),
    (["bench", "--repeats", "-1"], ("--repeats", ">= 1", "-1")),
    (["bench", "--repeats", "0"], ("--repeats",)),
    (["bench", "--family", "nope"], ("--family",)),
    (["bench", "--family", "delayed", "--kv-start", "-1"], ("--kv-start",)),
    (["bench", "--kv-start", "4"], ("--kv-start", "delayed")),
    (["bench", "--family", "engine", "--contexts", "5-2"], ("--contexts",)),
    (["bench", "--contexts", "1-2"], ("--contexts", "engine")),
    (["bench", "--plot", "latency.png"], ("--plot", "engine")),
    (["demo", "--requests", "-1"], ("--requests", ">= 1")),
    (["demo", "--requests", "0"], ("--requests",)),
    (["demo", "--requests", "x"], ("--requests",)),
    (["demo", "--kv-budget", "-5"], ("--kv-budget",)),
    (["demo", "--kv-budget", "0"], ("--kv-budget",)),
    (["demo", "--max-batch", "0"], ("--max-batch",)),
    (["demo", "--kv-start", "-1"], ("--kv-start",)),
    (["demo", "--speculative", "--draft-tokens", "0"], ("--draft-tokens",)),
    (["demo", "--speculative", "--draft-layers", "0"], ("--draft-layers",)),
    (["demo", "--prefix-store", "DIR", "--prefix-store-bytes", "-1"], ("--prefix-store-bytes",)),
    (["demo", "--prefix-store-bytes", "4096"], ("--prefix-store-bytes", "--prefix-store DIR")),
    (["demo", "--scheme", "bogus"], ("--scheme", "bogus")),
    (["demo", "--model", "/nonexistent/model"], ("--model", "no such directory")),
    (["demo", "--model", "llama3"], ("--model", "did you mean llama", "gemma3", "mamba2")),
    (["demo", "--mla", "--model", "llama"], ("--model", "--mla")),
    (["demo", "--mla", "--prefix-store", "DIR"], ("--prefix-store", "--mla")),
    (["demo", "--mla", "--kv-budget", "4096"], ("--kv-budget", "--mla")),
    (["demo", "--mla", "--scheme", "affine9"], ("--scheme", "affine9", "turbo-v4")),
    (["demo", "--mla", "--paged", "--kv-start", "4"], ("--kv-start", "--mla --paged")),
    (["demo", "--mla", "--paged", "--speculative"], ("--paged", "--speculative")),
    (["demo", "--paged", "--speculative"], ("--paged", "--speculative")),
    (["demo", "--paged", "--prefix-store", "DIR"], ("--prefix-store", "--paged")),
    (["demo", "--paged", "--kv-start", "16"], ("--kv-start", "--paged")),
    (["demo", "--speculative", "--kv-budget", "4096"], ("--kv-budget", "--speculative")),
    (["demo", "--speculative", "--prefix-store", "DIR"], ("--prefix-store", "--speculative")),
    (["demo", "--draft-tokens", "2"], ("--draft-tokens", "--speculative")),
    (["demo", "--draft-layers", "1"], ("--draft-layers", "--speculative")),
    (["demo", "--tensor-parallel", "--mla"], ("--mla", "--tensor-parallel")),
    (
        ["demo", "--tensor-parallel", "--prefix-store", "DIR"],
        ("--prefix-store", "--tensor-parallel"),
    ),
    (["demo", "--tensor-parallel", "--kv-budget", "4096"], ("--kv-budget", "--tensor-parallel")),
    (
        ["serve", "--model", "tiny:llama", "--tensor-parallel", "--queue-timeout", "1"],
        ("--queue-timeout", "--tensor-parallel"),
    ),
    (
        ["serve", "--model", "tiny:llama", "--step-timeout", "5"],
        ("--step-timeout", "--tensor-parallel"),
    ),
]


@pytest.mark.parametrize(("argv", "fragments"), BAD_VALUES, ids=" ".join)
def test_bad_values_are_one_line_before_any_work(
    argv: list[str],
    fragments: tuple[str, ...],
    tmp_path: Path,
    ran: list[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [str(tmp_path) if each == "DIR" else each for each in argv]
    _refused(argv, capsys, *fragments)
    assert ran == []


def test_model_paths_that_are_not_models_say_which(
    tmp_path: Path, ran: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(["demo", "--model", str(empty)], capsys, "not a model directory", "config.json")
    (empty / "config.json").write_text("{}")
    _refused(["demo", "--model", str(empty)], capsys, "not a model directory", "safetensors")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    _refused(["demo", "--model", str(weights)], capsys, "is a file")
    assert ran == []


def test_a_bad_profile_variable_is_refused(
    monkeypatch: pytest.MonkeyPatch, ran: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVROWS_PROFILE", "bogus")
    _refused(["conform"], capsys, "KVROWS_PROFILE", "bogus", "ci")
    assert ran == []


def test_plot_names_the_extra_when_matplotlib_is_missing(
    monkeypatch: pytest.MonkeyPatch, ran: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec: not installed
    argv = ["bench", "--family", "engine", "--plot", "latency.png"]
    _refused(argv, capsys, "--plot", "matplotlib", "kvrows[plot]")
    assert ran == []


def test_a_checkpoint_that_fails_to_load_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory that looks like a checkpoint but is not one: mlx-lm's own error, in
    one line that names the directory."""
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"not weights")
    _refused(["demo", "--model", str(tmp_path), "--quiet"], capsys, "cannot load", str(tmp_path))


def test_too_many_draft_layers_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--speculative", "--model", "llama", "--draft-layers", "9", "--quiet"]
    _refused(argv, capsys, "--draft-layers", "1..4")


def test_an_unexpected_error_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whatever escapes a command (here a read-only store's OSError, and an error with a
    multi-line message) is one line and exit 2; ``KVROWS_TRACEBACK=1`` shows it whole."""
    errors: list[Exception] = [
        OSError(errno.EROFS, "Read-only file system", "/store/entry.lock"),
        RuntimeError("first line\nsecond line"),
    ]

    def fail(args: Any) -> int:
        raise errors[0]

    monkeypatch.setattr(cli, "_run", fail)
    _refused(["example"], capsys, "kvrows example", "/store/entry.lock", "Read-only file system")
    errors.pop(0)
    line = _refused(["classes"], capsys, "RuntimeError", "first line")
    assert "second line" not in line
    monkeypatch.setenv(cli.TRACEBACK_VARIABLE, "1")
    with pytest.raises(RuntimeError):
        cli.main(["classes"])


def test_a_failed_check_that_escapes_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvrows.app.bench.runner import BenchCheckError

    def fail(args: Any) -> int:
        raise BenchCheckError("decode: 3 of 8 values differ")

    monkeypatch.setattr(cli, "_run", fail)
    assert cli.main(["bench"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "BenchCheckError" in line and "3 of 8 values differ" in line


def test_a_store_path_that_cannot_be_a_directory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real failure inside a run, not a mock: the store directory would be under a file."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = ["demo", "--model", "llama", "--scheme", "plain", "--requests", "1", "--quiet"]
    _refused([*argv, "--prefix-store", str(blocker / "store")], capsys, "kvrows demo")
    _refused([*argv, "--prefix-store", str(blocker)], capsys, "--prefix-store", "is a file")


def test_rejected_requests_are_reported_and_not_passed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--kv-budget 10``: no request fits; the run says how many and why, prints no PASS,
    and exits 1. The stage line reaches stderr under ``--quiet``."""
    argv = ["demo", "--model", "llama", "--scheme", "plain", "--requests", "2", "--quiet"]
    assert cli.main([*argv, "--kv-budget", "10"]) == 1
    out, err = capsys.readouterr()
    assert "2 of 2 requests rejected" in out
    assert "budget of 10" in out
    assert "PASS" not in out
    assert "[1/1] llama plain" in err


def _column(table: str, name: str) -> list[str]:
    """A column of a demo table, by its header (cells are split at two spaces)."""
    lines = table.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("model "))
    header = [cell.strip() for cell in lines[at].split("  ") if cell.strip()]
    rows = []
    for line in lines[at + 2 :]:
        if not line.strip():
            break
        rows.append([cell.strip() for cell in line.split("  ") if cell.strip()])
    return [row[header.index(name)] for row in rows]


def test_paged_demo_reports_bytes_per_token_and_rejections(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``demo --paged``: KV B/token is one token's bytes (as the contiguous tables count it:
    keys and values of every layer), not a whole block's; a rejected request fails."""
    llama = tiny_model("llama").args
    per_token = llama.num_hidden_layers * llama.num_key_value_heads * llama.head_dim * 2 * 4
    small: dict[str, Any] = {"system_tokens": 20, "shared_requests": 2, "progress": False}
    status = run_paged_demo(model_path="llama", schemes=["plain"], requests=2, **small)
    out = capsys.readouterr().out
    assert status == 0, out
    assert _column(out, "KV B/token") == [str(per_token)]
    assert _column(out, "invariance") == ["PASS"]
    status = run_paged_demo(
        model_path="llama", schemes=["plain"], requests=2, kv_budget=10, **small
    )
    out = capsys.readouterr().out
    assert status == 1
    assert _column(out, "invariance") == ["REJECTED"]
    assert "2 of 2 requests rejected" in out


def test_bench_refuses_bad_repeats_before_building_a_family(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[str] = []
    monkeypatch.setattr(bench, "family", lambda name, **_: built.append(name))
    with pytest.raises(InvalidInputError, match="--repeats"):
        bench.run("all", repeats=-1)
    assert built == []


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [(["demo", "--model", "llama3"], "did you mean llama"), (["bench", "--repeats", "-1"], "-1")],
)
def test_no_traceback_reaches_a_terminal(argv: list[str], fragment: str) -> None:
    """The real entry point in its own process: one line on stderr, exit 2, quickly."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    environment.pop(cli.TRACEBACK_VARIABLE, None)
    done = subprocess.run(
        [sys.executable, "-m", "kvrows.app.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1 and fragment in done.stderr, done.stderr
