"""Run mlx-lm's own cache and model tests twice: on mlx-lm's classes, then on kvrows'.

Usage (``make mlxlm-tests`` runs the first)::

    .venv/bin/python tools/mlxlm_tests/run.py               # the installed version's sdist
    .venv/bin/python tools/mlxlm_tests/run.py -k batch      # pytest's -k, passed through
    .venv/bin/python tools/mlxlm_tests/run.py --files tests/test_prompt_cache.py

mlx-lm's tests are in its source distribution, not in its wheel. The sdist of the
installed mlx-lm version is downloaded once (``pip download --no-binary :all: --no-deps``)
into ``build/mlxlm-tests/`` (ignored by git: mlx-lm's test code is never copied into the
repository), its test files unpacked next to it, and pytest runs them against the
installed mlx-lm with the plugin ``kvrows_mlxlm_plugin`` (this folder): once on mlx-lm's
classes (the baseline), once with ``--kvrows-rebind`` (kvrows' drop-ins). The script prints
both outcomes per test, the first failure line of each test whose outcomes differ and the
totals, and exits 1 when a test passes on mlx-lm's classes only, unless it is a documented
divergence (:data:`DIVERGENCES`, ``spec/mlx-lm-drop-in.md`` §5).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORK = ROOT / "build" / "mlxlm-tests"
TEST_FILES = ("tests/test_prompt_cache.py", "tests/test_models.py", "tests/test_generate.py")
#: Tests that pass on mlx-lm's classes and deliberately not on kvrows' (the reasons are
#: ``spec/mlx-lm-drop-in.md`` §5); any other such test makes the script exit 1.
DIVERGENCES: dict[str, str] = {
    "TestPromptCache::test_batch_rotating_kv_cache": "its last assertion is mlx-lm's B9 mask",
    "TestPromptCache::test_save_load_batch_caches": "4 rows into a 2-row cache are refused",
    "TestPromptCache::test_arrays_cache_advance": "advance before the planes are written is refused",
}


def _version() -> str:
    import mlx_lm

    return str(mlx_lm.__version__)


def _sdist(version: str) -> Path:
    """The installed version's sdist, downloaded once."""
    WORK.mkdir(parents=True, exist_ok=True)
    found = sorted(WORK.glob(f"mlx_lm-{version}.tar.gz"))
    if not found:
        print(f"-- downloading the mlx-lm {version} sdist into {WORK}", flush=True)
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:"),
                *("--no-deps", "-d", str(WORK), f"mlx-lm=={version}"),
            ],
            check=True,
        )
        found = sorted(WORK.glob(f"mlx_lm-{version}.tar.gz"))
    if not found:
        raise SystemExit(f"no mlx_lm-{version}.tar.gz in {WORK} after pip download")
    return found[0]


def _unpack(sdist: Path, version: str, files: tuple[str, ...]) -> Path:
    """The test files, unpacked into ``build/mlxlm-tests/tests-<version>/``."""
    folder = WORK / f"tests-{version}"
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as archive:
        for relative in files:
            member = archive.getmember(f"mlx_lm-{version}/{relative}")
            stream = archive.extractfile(member)
            if stream is None:
                raise SystemExit(f"{relative} is not a file in {sdist}")
            (folder / Path(relative).name).write_bytes(stream.read())
    (folder / "pytest.ini").write_text("[pytest]\n")
    return folder


def _outcomes(report: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Test id -> ``pass`` / ``fail`` / ``error`` / ``skip`` from a JUnit XML report, and
    test id -> the first line of its failure message."""
    results: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = "pass"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "fail", "error": "error", "skipped": "skip"}[child.tag]
                if child.tag != "skipped":
                    messages[name] = ((child.get("message") or "").splitlines() or [""])[0][:160]
        results[name] = outcome
    return results, messages


def _run(
    folder: Path, files: tuple[str, ...], rebind: bool, extra: list[str]
) -> tuple[dict[str, str], dict[str, str]]:
    report = folder / ("kvrows.xml" if rebind else "mlx-lm.xml")
    report.unlink(missing_ok=True)
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
        "-p", "kvrows_mlxlm_plugin", *(["--kvrows-rebind"] if rebind else []),
        "--rootdir", str(folder), "-c", str(folder / "pytest.ini"), f"--junitxml={report}",
        *extra, *(str(folder / Path(f).name) for f in files),
    ]  # fmt: skip
    label = "kvrows' classes" if rebind else "mlx-lm's classes"
    print(f"-- running with {label} ...", flush=True)
    subprocess.run(command, cwd=folder, env=env, check=False, capture_output=True)
    if not report.exists():
        raise SystemExit(f"pytest wrote no report for the run with {label}")
    return _outcomes(report)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--files", nargs="+", default=list(TEST_FILES), help="sdist test files")
    args = parser.parse_args()

    version = _version()
    files = tuple(args.files)
    folder = _unpack(_sdist(version), version, files)
    extra = ["-k", args.keyword] if args.keyword else []
    baseline, baseline_messages = _run(folder, files, rebind=False, extra=extra)
    rebound, rebound_messages = _run(folder, files, rebind=True, extra=extra)

    print(f"\nmlx-lm {version}'s tests ({', '.join(files)}), from its sdist\n")
    names = sorted(set(baseline) | set(rebound))
    width = max((len(n) for n in names), default=4)
    print(f"{'test':<{width}}  {'mlx-lm':<7} kvrows")
    for name in names:
        ours, theirs = rebound.get(name, "-"), baseline.get(name, "-")
        marker = "  <-- differs" if ours != theirs else ""
        print(f"{name:<{width}}  {theirs:<7} {ours}{marker}")
    for label, results in (("mlx-lm's classes", baseline), ("kvrows' classes", rebound)):
        counts = {
            o: sum(1 for v in results.values() if v == o) for o in ("pass", "fail", "error", "skip")
        }
        print(
            f"{label}: {len(results)} tests, {counts['pass']} passed, {counts['fail']} failed, "
            f"{counts['error']} errors, {counts['skip']} skipped"
        )
    for name in names:
        for label, messages in (("mlx-lm", baseline_messages), ("kvrows", rebound_messages)):
            if name in messages:
                print(f"  {name} [{label}]: {messages[name]}")
    regressions = [n for n in names if baseline.get(n) == "pass" and rebound.get(n) != "pass"]
    for name in regressions:
        reason = DIVERGENCES.get(name)
        print(f"pass with mlx-lm's classes only: {name} ({reason or 'NOT EXPECTED'})")
    return 1 if any(n not in DIVERGENCES for n in regressions) else 0


if __name__ == "__main__":
    raise SystemExit(main())
