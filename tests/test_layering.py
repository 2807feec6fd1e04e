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
