"""The contract package stays below everything else: no MLX, no implementation, no app.

Every module in the ``kvrows/`` folder is parsed (not imported) and each ``import`` /
``from ... import`` in it, at any depth (inside functions and ``TYPE_CHECKING`` blocks
too), is resolved to an absolute module name and checked against the forbidden roots.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "kvrows"

#: Module roots the contract package may not import.
FORBIDDEN = (
    "mlx",
    "mlx_lm",
    "kvrows.reference",
    "kvrows.optimized",
    "kvrows.conformance",
    "kvrows.app",
)


def _package(path: Path) -> str:
    """The dotted package a module of the ``kvrows/`` folder lives in."""
    parts = ["kvrows", *path.relative_to(CORE).parent.parts]
    return ".".join(parts)


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # ``from kvrows import optimized`` imports a submodule: check ``kvrows.optimized``.
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
            found.append((node.lineno, module))
    return found


def forbidden(module: str) -> bool:
    return any(module == root or module.startswith(root + ".") for root in FORBIDDEN)


def _violations(path: Path) -> list[str]:
    return [
        f"{path.relative_to(CORE.parent)}:{line}: imports {module}"
        for line, module in imported_modules(path.read_text(), _package(path))
        if forbidden(module)
    ]


def test_the_resolver_sees_every_import_form() -> None:
    source = (
        "import mlx.core as mx\n"
        "from kvrows import optimized\n"
        "def f():\n"
        "    from ..app import cli\n"
        "    from . import table\n"
        "import numpy\n"
    )
    modules = {m for _, m in imported_modules(source, "kvrows.sub")}
    assert {"mlx.core", "kvrows.optimized", "kvrows.app.cli", "kvrows.sub.table"} <= modules
    assert [m for m in sorted(modules) if forbidden(m)] == [
        "kvrows.app",
        "kvrows.app.cli",
        "kvrows.optimized",
        "mlx.core",
    ]
    assert not forbidden("numpy") and not forbidden("mlxfoo") and not forbidden("kvrows.table")


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_imports_no_mlx_implementation_or_app(path: Path) -> None:
    assert _violations(path) == []


# -- the application: public names only (issue 23, spec/contract.md §0.10) -----------------

ROOT = CORE.parent

#: The application's folders and the packages they install as.
APPLICATION = {"app": "kvrows.app", "persist": "kvrows.persist"}

#: The implementations whose ``__all__`` the application may import from.
IMPLEMENTATIONS = ("kvrows.reference", "kvrows.optimized")

#: The codec benchmarks time the codec modules themselves (quantize, encode, the eager
#: attention), which the implementations do not export.
CODEC_BENCHMARKS = {
    "app/bench/affine.py": {"kvrows.optimized.affine_codec", "kvrows.reference.affine_codec"},
    "app/bench/turbo.py": {
        "kvrows.optimized.codecs",
        "kvrows.optimized.turbo_codec",
        "kvrows.reference.codecs",  # the decode check's oracle: the NumPy codecs
        "kvrows.reference.turbo_codec",
    },
}


def _application_files() -> list[Path]:
    return sorted(path for folder in APPLICATION for path in (ROOT / folder).rglob("*.py"))


def _application_package(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).parent.parts
    return ".".join([APPLICATION[folder], *rest])


def private_implementation_imports(
    modules: list[tuple[int, str]], public: dict[str, set[str]]
) -> list[tuple[int, str]]:
    """The imports of ``modules`` that reach inside an implementation: a module below
    ``kvrows.reference`` / ``kvrows.optimized`` that is not a name of its ``__all__``
    (``from kvrows.optimized import X`` resolves to ``kvrows.optimized.X`` too)."""
    found = []
    for line, module in modules:
        for root in IMPLEMENTATIONS:
            if module.startswith(root + "."):
                name, *deeper = module[len(root) + 1 :].split(".")
                if deeper or name not in public[root]:
                    found.append((line, module))
    return found


@pytest.fixture(scope="module")
def public_names() -> dict[str, set[str]]:
    import importlib

    return {root: set(importlib.import_module(root).__all__) for root in IMPLEMENTATIONS}


def test_the_private_import_check_sees_internals() -> None:
    public = {"kvrows.reference": {"KVCache"}, "kvrows.optimized": {"KVCache", "attend"}}
    source = (
        "from kvrows.optimized import KVCache, attend\n"
        "import kvrows.optimized as optimized\n"
        "from kvrows.reference import KVCache\n"
        "from kvrows.optimized.paged import PagedKVCache\n"
        "from kvrows.optimized import ring\n"
        "import kvrows.reference.classes\n"
        "from kvrows.lego import Bf16First\n"
    )
    found = private_implementation_imports(imported_modules(source, "kvrows.app"), public)
    assert sorted(found) == [
        (4, "kvrows.optimized.paged"),
        (4, "kvrows.optimized.paged.PagedKVCache"),
        (5, "kvrows.optimized.ring"),
        (6, "kvrows.reference.classes"),
    ]


@pytest.mark.parametrize("path", _application_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_application_imports_only_public_implementation_names(
    path: Path, public_names: dict[str, set[str]]
) -> None:
    allowed = CODEC_BENCHMARKS.get(str(path.relative_to(ROOT)), set())
    found = private_implementation_imports(
        imported_modules(path.read_text(), _application_package(path)), public_names
    )
    private = sorted(
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for line, module in found
        if not any(module == m or module.startswith(m + ".") for m in allowed)
    )
    assert private == [], (
        "the application (app/, persist/) imports the core, kvrows.protocols and the "
        "__all__ of kvrows.reference / kvrows.optimized; ask a capability of "
        "kvrows.protocols instead of an implementation's class (spec/contract.md §0.10)"
    )


def test_the_twins_page_on_their_own_machinery() -> None:
    """Paging (KV and latent) is ``reference/paging.py`` and ``optimized/paging.py``, each
    over its own row machinery (contract §0.4, §0.8: the twins share no row bookkeeping):
    the shared paged machineries are gone."""
    assert not (CORE / "paged_storage.py").exists()
    assert not (CORE / "paged_latent.py").exists()
    for twin in ("reference", "optimized"):
        assert not (CORE.parent / twin / "paged_latent.py").exists()
