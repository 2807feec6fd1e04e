"""The measures of issue 23 ("one row machinery over planes"), read from the source tree.

Prints, for a checkout (default: this one):

* the substantive ``merge_rows`` implementations (file:line, class);
* the ``RuleBasedStateMachine`` roots in ``conformance/``;
* every dispatch on a codec kind or a concrete storage type outside the codec and geometry
  modules, one ``file:line`` each (the definition is in ``spec/measures.md``; the count is
  ratcheted by ``tests/test_dispatch_ratchet.py``);
* the lines of Python per folder.

Everything is read with ``ast`` (nothing is imported), so it runs on any checkout:

    .venv/bin/python tools/measures.py [ROOT]
"""

from __future__ import annotations

import ast
import builtins
import itertools
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

#: The source folders and the package each is installed as (pyproject's ``package-dir``).
PACKAGES = {
    "kvrows": "kvrows",
    "reference": "kvrows.reference",
    "optimized": "kvrows.optimized",
    "conformance": "kvrows.conformance",
    "app": "kvrows.app",
    "persist": "kvrows.persist",
}

#: Folders searched for dispatch sites: the product (what the before-stop hook greps) and
#: the conformance suite (its families are to plug in hooks, not probe classes).
#: ``tests/`` and ``benchmarks/`` may name concrete classes: they test them.
DISPATCH_FOLDERS = ("kvrows", "reference", "optimized", "app", "persist", "conformance")

#: Modules that own a codec: its spec (and CLI parsing: ``kvrows/schemes.py`` re-exports
#: the codec and geometry specs and parses schemes), parameters, tables and array work. A
#: dispatch on codec kinds belongs here and nowhere else.
CODEC_MODULES = frozenset(
    {
        "kvrows/codec.py",
        "kvrows/schemes.py",
        "kvrows/affine_geometry.py",
        "kvrows/turbo_tables.py",
        "reference/codecs.py",
        "reference/affine_codec.py",
        "reference/turbo_codec.py",
        "optimized/codecs.py",
        "optimized/affine_codec.py",
        "optimized/turbo_codec.py",
    }
)

#: Packages whose every module owns a codec (one module per kind: the spec in
#: ``kvrows/codecs/``, its array work in each implementation's ``codecs/``).
CODEC_PACKAGES = ("kvrows/codecs/", "reference/codecs/", "optimized/codecs/")


def is_codec_module(path: str) -> bool:
    """Whether the module at ``path`` (relative, POSIX) owns a codec."""
    return path in CODEC_MODULES or path.startswith(CODEC_PACKAGES)


#: Packages whose every module owns a token geometry (one module per kind: the spec and
#: the registry in ``kvrows/geometries/``, the hooks in each implementation's
#: ``geometries/``).
GEOMETRY_PACKAGES = ("kvrows/geometries/", "reference/geometries/", "optimized/geometries/")

#: The package of the geometry specs (their classes are specs, not storage types).
GEOMETRY_SPEC_PACKAGE = "kvrows/geometries/"


def is_geometry_module(path: str) -> bool:
    """Whether the module at ``path`` (relative, POSIX) owns a token geometry."""
    return path.startswith(GEOMETRY_PACKAGES)


#: Folders whose classes are storages, layouts, their geometries, mixins and modifiers.
STORAGE_FOLDERS = ("kvrows", "reference", "optimized")

#: Folders counted in "Python lines per folder" (the before-stop hook's list; their sum
#: is the issue's "lines of Python"). ``tools/`` is shown apart.
LINE_FOLDERS = (
    "kvrows",
    "reference",
    "optimized",
    "conformance",
    "app",
    "persist",
    "tests",
    "benchmarks",
)

#: Categories of a dispatch site.
CODEC = "codec"  # a codec spec or codec class, or a codec kind string
STORAGE = "storage"  # a concrete storage / layout / geometry / modifier class or its name
GEOMETRY = "geometry-spec"  # a geometry spec class (Growing, Ring, ...) or its kind string


class Site(NamedTuple):
    """One dispatch site: where, which category, and what it names."""

    path: str
    line: int
    column: int  # two sites on one line are two sites
    category: str
    what: str


@dataclass
class _ClassInfo:
    qualname: str
    path: str
    bases: list[ast.expr]
    decorators: list[str]
    kind: str | None  # the ``kind`` ClassVar of an axis spec
    has_key: bool  # defines ``key`` (a codec's identity)


@dataclass
class _Module:
    name: str
    path: str
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local name -> qualified name
    classes: dict[str, _ClassInfo] = field(default_factory=dict)
    aliases: dict[str, ast.expr] = field(default_factory=dict)


def python_files(root: Path, folder: str) -> list[Path]:
    base = root / folder
    return sorted(p for p in base.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    package = PACKAGES[parts[0]]
    rest = parts[1:]
    if rest and rest[-1] == "__init__":
        rest = rest[:-1]
    return ".".join([package, *rest])


def _resolve_relative(module: _Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = module.path.endswith("__init__.py")
    parts = module.name.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    return ".".join([*parts[:keep], *([node.module] if node.module else [])])


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _class_info(module: _Module, node: ast.ClassDef) -> _ClassInfo:
    kind: str | None = None
    has_key = False
    for item in node.body:
        if (
            isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)
            and item.target.id == "kind"
            and isinstance(item.value, ast.Constant)
            and isinstance(item.value.value, str)
        ):
            kind = item.value.value
        if isinstance(item, ast.FunctionDef) and item.name == "key":
            has_key = True
    decorators = [_dotted(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
    return _ClassInfo(
        qualname=f"{module.name}.{node.name}",
        path=module.path,
        bases=list(node.bases),
        decorators=[d for d in decorators if d],
        kind=kind,
        has_key=has_key,
    )


def _load_module(root: Path, path: Path) -> _Module:
    relative = path.relative_to(root)
    module = _Module(_module_name(relative), relative.as_posix(), ast.parse(path.read_text()))
    # Imports at any depth (many modules import inside functions to avoid cycles).
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    module.imports[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    module.imports[top] = top
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_relative(module, node)
            for alias in node.names:
                module.imports[alias.asname or alias.name] = f"{source}.{alias.name}"
    # A class built at run time (``classes.build``) is declared under ``TYPE_CHECKING``.
    declared = [
        node.body
        for node in module.tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    for node in [*module.tree.body, *(n for body in declared for n in body)]:
        if isinstance(node, ast.ClassDef):
            module.classes[node.name] = _class_info(module, node)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                module.aliases[target.id] = node.value
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.value is not None
        ):
            module.aliases[node.target.id] = node.value
    return module


class Project:
    """The parsed source folders, with enough name resolution to say what class an
    expression like ``Turbo``, ``kv.PaddedKVRows`` or ``Plain | Affine`` denotes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: dict[str, _Module] = {}
        for folder in PACKAGES:
            for path in python_files(root, folder):
                module = _load_module(root, path)
                self.modules[module.name] = module
        self._classes = {
            info.qualname: info for m in self.modules.values() for info in m.classes.values()
        }
        self.codec_kinds = {
            c.kind for c in self._classes.values() if c.kind is not None and c.has_key
        }
        self.geometry_kinds = {
            c.kind for c in self._classes.values() if c.kind is not None and not c.has_key
        }
        self.storage_names = {
            q.rsplit(".", 1)[1]: q
            for q in self._classes
            if self.category(q) == STORAGE and not q.rsplit(".", 1)[1].startswith("_")
        }

    # -- name resolution ---------------------------------------------------------------

    def _lookup(self, qualified: str, depth: int = 0) -> list[str]:
        """The project classes a qualified name denotes (through re-exports and aliases);
        ``[]`` for anything outside the project or not a class."""
        if depth > 8 or qualified in self._classes:
            return [qualified] if qualified in self._classes else []
        module_name, _, attr = qualified.rpartition(".")
        module = self.modules.get(module_name)
        if module is None:
            return []
        if attr in module.imports:
            return self._lookup(module.imports[attr], depth + 1)
        if attr in module.aliases:
            return self.resolve(module, module.aliases[attr], depth + 1)
        return []

    def resolve(self, module: _Module, node: ast.expr, depth: int = 0) -> list[str]:
        """The project classes ``node`` (a class expression in ``module``) denotes."""
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return [q for e in node.elts for q in self.resolve(module, e, depth)]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self.resolve(module, node.left, depth) + self.resolve(module, node.right, depth)
        if isinstance(node, ast.Subscript):  # TypeAlias = Union[...] spellings
            return self.resolve(module, node.slice, depth)
        dotted = _dotted(node)
        if dotted is None:
            return []
        head, _, rest = dotted.partition(".")
        if head in module.classes or head in module.aliases:
            base = f"{module.name}.{head}"
        elif head in module.imports:
            base = module.imports[head]
        else:
            return []
        return self._lookup(f"{base}.{rest}" if rest else base, depth)

    def _ancestors(self, qualname: str) -> Iterator[tuple[_ClassInfo, list[str]]]:
        """Each project class in ``qualname``'s hierarchy with its unresolved base names."""
        seen: set[str] = set()
        todo = [qualname]
        while todo:
            current = todo.pop()
            if current in seen or current not in self._classes:
                continue
            seen.add(current)
            info = self._classes[current]
            module = self.modules[current.rpartition(".")[0]]
            outside = []
            for base in info.bases:
                inside = self.resolve(module, base)
                todo += inside
                if not inside:
                    outside.append((_dotted(base) or "").rpartition(".")[2])
            yield info, outside

    # -- classification ----------------------------------------------------------------

    def category(self, qualname: str) -> str | None:
        """What dispatching on class ``qualname`` dispatches on; ``None``: not a codec kind
        nor a concrete storage type (a protocol, an exception, a value type, a class of the
        app or the suite)."""
        info = self._classes[qualname]
        if info.kind is not None:
            return CODEC if info.has_key else GEOMETRY
        if "Protocol" in [b.rpartition(".")[2] for b in map(_dotted, info.bases) if b]:
            return None  # a capability: what to check instead of a concrete type
        for ancestor, outside in self._ancestors(qualname):
            if any(_is_exception(name) for name in outside):
                return None
            if ancestor is not info and ancestor.kind is not None:
                return CODEC if ancestor.has_key else GEOMETRY
        if any(d.rpartition(".")[2] in ("dataclass", "NamedTuple") for d in info.decorators):
            return None  # a value (a composition, a scheme, a geometry of shapes, an entry)
        if is_codec_module(info.path):
            return CODEC
        if info.path.startswith(GEOMETRY_SPEC_PACKAGE):
            return GEOMETRY  # the registry's base of the specs (hooks are storage types)
        if info.path.split("/")[0] not in STORAGE_FOLDERS:
            return None  # a class of the app or the suite
        return STORAGE

    def classify(self, module: _Module, node: ast.expr) -> list[tuple[str, str]]:
        """``(category, class name)`` for each codec kind or storage type ``node`` names."""
        found = []
        for qualname in self.resolve(module, node):
            category = self.category(qualname)
            if category is not None:
                found.append((category, qualname.rpartition(".")[2]))
        return found

    def string_category(self, text: str) -> str | None:
        """The category of a string compared as a kind or a class name."""
        if text in self.codec_kinds:
            return CODEC
        if text in self.geometry_kinds:
            return GEOMETRY
        if text in self.storage_names:
            return STORAGE
        return None


# -- dispatch sites -------------------------------------------------------------------------


def _is_exception(name: str) -> bool:
    builtin = getattr(builtins, name, None)
    return isinstance(builtin, type) and issubclass(builtin, BaseException)


def _is_type_of(node: ast.expr) -> bool:
    """``type(x)`` or ``x.__class__``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id == "type" and len(node.args) == 1
    return isinstance(node, ast.Attribute) and node.attr == "__class__"


def _is_type_name(node: ast.expr) -> bool:
    """``type(x).__name__``, ``x.__class__.__name__`` or ``cls.__name__``."""
    return isinstance(node, ast.Attribute) and node.attr in ("__name__", "__qualname__")


def _strings(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for e in node.elts for s in _strings(e)]
    return []


def _is_constant(node: ast.expr) -> bool:
    return bool(_strings(node)) or isinstance(node, ast.Constant)


def _counted_elsewhere(tree: ast.Module) -> set[int]:
    """Ids of the nodes an enumeration of kinds must not count again: what an
    ``isinstance`` or a comparison already counts, annotations (types, not dispatch), and
    the inner links of an ``A | B | C`` chain."""
    covered: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _dotted(node.func) in ("isinstance", "issubclass"):
            covered += node.args[1:2]
        elif isinstance(node, ast.Compare):
            covered += [node.left, *node.comparators]
        elif isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            covered.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns:
            covered.append(node.returns)
        elif isinstance(node, ast.BinOp):
            covered += [c for c in (node.left, node.right) if isinstance(c, ast.BinOp)]
    return {id(n) for root in covered for n in ast.walk(root)}


def _members(node: ast.expr) -> list[ast.expr]:
    """The direct members of a tuple, list or set literal or an ``A | B`` chain."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return list(node.elts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _members(node.left) + _members(node.right)
    return [node]


def _sites_in(project: Project, module: _Module) -> Iterator[Site]:
    def site(node: ast.AST, hits: Iterable[tuple[str, str]], how: str) -> Iterator[Site]:
        hits = list(dict.fromkeys(hits))
        if hits:
            category = min(c for c, _ in hits)  # one category per site: codec < geo < storage
            names = ", ".join(n for _, n in hits)
            yield Site(
                module.path,
                getattr(node, "lineno", 0),
                getattr(node, "col_offset", 0),
                category,
                f"{how} {names}",
            )

    counted_elsewhere = _counted_elsewhere(module.tree)
    for node in ast.walk(module.tree):
        if (
            isinstance(node, ast.Tuple | ast.List | ast.Set | ast.BinOp)
            and id(node) not in counted_elsewhere
        ):
            # ``(Plain, Affine, Turbo)`` handed to an isinstance later is the same ladder.
            kinds = [
                hit
                for member in _members(node)
                if isinstance(member, ast.Name | ast.Attribute)
                for hit in project.classify(module, member)
                if hit[0] != STORAGE
            ]
            if len(kinds) >= 2:
                yield from site(node, kinds, "kinds listed:")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            yield from site(node, project.classify(module, node.args[1]), node.func.id)
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for left, right in itertools.pairwise(operands):
                for a, b in ((left, right), (right, left)):
                    if _is_type_of(a):
                        yield from site(node, project.classify(module, b), "type() vs")
                    elif _is_type_name(a) or not _is_constant(a):
                        hits = [
                            (c, repr(s))
                            for s in _strings(b)
                            if (c := project.string_category(s)) is not None
                        ]
                        how = "type name ==" if _is_type_name(a) else "kind string =="
                        yield from site(node, hits, how)
        elif isinstance(node, ast.match_case):
            patterns = list(ast.walk(node.pattern))
            classes = [p.cls for p in patterns if isinstance(p, ast.MatchClass)]
            yield from site(
                node.pattern, [h for c in classes for h in project.classify(module, c)], "case"
            )
            values = [p.value for p in patterns if isinstance(p, ast.MatchValue)]
            yield from site(
                node.pattern,
                [
                    (c, repr(s))
                    for v in values
                    for s in _strings(v)
                    if (c := project.string_category(s)) is not None
                ],
                "case",
            )
        elif isinstance(node, ast.Dict):
            # A table over codec kinds (every key one) is a ladder in another spelling; a
            # registry of other names that happens to hold a codec's is not.
            keys = [s for k in node.keys if k is not None for s in _strings(k)]
            if len(keys) >= 2 and all(project.string_category(k) == CODEC for k in keys):
                yield from site(node, [(CODEC, repr(k)) for k in keys], "table keyed by")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and not _is_constant(node.func.value)
            and node.args
        ):
            hits = [
                (c, repr(s))
                for s in _strings(node.args[0])
                if (c := project.string_category(s)) is not None
            ]
            yield from site(node, hits, f"{node.func.attr}(")


def dispatch_sites(root: Path, project: Project | None = None) -> list[Site]:
    """Every dispatch on a codec kind or a concrete storage type (and geometry spec) in
    ``DISPATCH_FOLDERS`` outside the codec and geometry modules, sorted by file and line."""
    project = project or Project(root)
    sites = {
        s
        for m in project.modules.values()
        if m.path.split("/")[0] in DISPATCH_FOLDERS
        and not is_codec_module(m.path)
        and not is_geometry_module(m.path)
        for s in _sites_in(project, m)
    }
    return sorted(sites)


def sites_per_file(sites: Iterable[Site]) -> dict[str, int]:
    return dict(sorted(Counter(s.path for s in sites).items()))


# -- merge_rows and machine roots -----------------------------------------------------------


def _is_stub(body: list[ast.stmt]) -> bool:
    statements = [
        s
        for s in body
        if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))  # docstring, ...
        and not isinstance(s, ast.Pass)
    ]
    return not statements or (
        len(statements) == 1
        and isinstance(statements[0], ast.Raise)
        and "NotImplementedError" in ast.unparse(statements[0])
    )


def _calls_super_merge(function: ast.FunctionDef) -> bool:
    """Whether ``function`` hands the merge on: to ``super().merge_rows`` (a guard) or to
    the cache a drop-in wraps (``….wrapped.merge_rows``, ``kvrows.protocols.DropInWrapper``)."""

    def delegated(target: ast.expr) -> bool:
        if isinstance(target, ast.Attribute):
            return target.attr == "wrapped"
        return (
            isinstance(target, ast.Call)
            and isinstance(target.func, ast.Name)
            and target.func.id == "super"
        )

    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "merge_rows"
        and delegated(n.func.value)
        for n in ast.walk(function)
    )


def _hands_to_parts(function: ast.FunctionDef) -> bool:
    """Whether ``function`` is a composite's merge over its parts' machinery
    (``kvrows.protocols.DropInParts``): it checks the rows (``….check_merge``, every part's
    check before any part joins) and its every ``merge_rows`` call is a loop's part
    (``for part, … in zip(self.caches, …): part.merge_rows(…)``)."""
    checks = any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "check_merge"
        for n in ast.walk(function)
    )
    parts = {
        name.id
        for loop in ast.walk(function)
        if isinstance(loop, ast.For)
        for name in ast.walk(loop.target)
        if isinstance(name, ast.Name)
    }
    merges = [
        n.func.value
        for n in ast.walk(function)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "merge_rows"
    ]
    return (
        checks
        and bool(merges)
        and all(isinstance(target, ast.Name) and target.id in parts for target in merges)
    )


def merge_rows_definitions(project: Project) -> list[tuple[str, int, str, bool]]:
    """``(path, line, class, substantive)`` for each ``merge_rows`` of a class in the core
    and the implementations. Not substantive: a protocol stub, a wrapper that guards and
    then calls ``super().merge_rows``, a drop-in that hands the merge to the cache it
    wraps, or a drop-in over parts that checks every part and hands each its share."""
    found = []
    for module in project.modules.values():
        if module.path.split("/")[0] not in STORAGE_FOLDERS:
            continue
        for cls in (n for n in ast.walk(module.tree) if isinstance(n, ast.ClassDef)):
            for item in cls.body:
                if isinstance(item, ast.FunctionDef) and item.name == "merge_rows":
                    substantive = not (
                        _is_stub(item.body) or _calls_super_merge(item) or _hands_to_parts(item)
                    )
                    found.append((module.path, item.lineno, cls.name, substantive))
    return sorted(found)


def machine_roots(project: Project) -> list[tuple[str, int, str]]:
    """``(path, line, class)`` of each direct ``RuleBasedStateMachine`` subclass in
    ``conformance/``."""
    found = []
    for module in project.modules.values():
        if not module.path.startswith("conformance/"):
            continue
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef) and any(
                (_dotted(b) or "").rpartition(".")[2] == "RuleBasedStateMachine" for b in node.bases
            ):
                found.append((module.path, node.lineno, node.name))
    return sorted(found)


def python_lines(root: Path) -> dict[str, int]:
    """Lines (newlines, as ``wc -l``) of the ``.py`` files under each folder."""
    return {
        folder: sum(p.read_bytes().count(b"\n") for p in python_files(root, folder))
        for folder in LINE_FOLDERS
        if (root / folder).is_dir()
    }


# -- report -----------------------------------------------------------------------------------


def _commit(root: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "log", "-1", "--format=%h %cs"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return out.stdout.strip()


def report(root: Path) -> str:
    project = Project(root)
    lines = [f"kvrows measures for {root} ({_commit(root)})", ""]

    merges = merge_rows_definitions(project)
    substantive = [m for m in merges if m[3]]
    lines.append(f"Substantive merge_rows implementations: {len(substantive)}")
    lines += [f"  {path}:{line} {cls}" for path, line, cls, real in merges if real]
    others = [f"{path}:{line} {cls}" for path, line, cls, real in merges if not real]
    lines.append(
        f"  (not counted, stubs, super() wrappers and drop-in delegations: "
        f"{', '.join(others) or 'none'})"
    )
    lines.append("")

    roots = machine_roots(project)
    lines.append(f"RuleBasedStateMachine roots in conformance/: {len(roots)}")
    lines += [f"  {path}:{line} {cls}" for path, line, cls in roots]
    lines.append("")

    sites = dispatch_sites(root, project)
    by_category = Counter(s.category for s in sites)
    by_folder = Counter(s.path.split("/")[0] for s in sites)
    lines.append(
        "Dispatch on codec kinds or concrete storage types outside the codec and geometry "
        f"modules: {len(sites)} sites in {len(sites_per_file(sites))} files"
    )
    lines.append("  by category: " + ", ".join(f"{c} {n}" for c, n in sorted(by_category.items())))
    lines.append("  by folder: " + ", ".join(f"{f} {n}" for f, n in sorted(by_folder.items())))
    by_form = Counter(s.what.split(" ")[0] for s in sites)
    lines.append("  by form: " + ", ".join(f"{f} {n}" for f, n in sorted(by_form.items())))
    # The before-stop hook greps isinstance on codec and storage names in the product.
    hooked = [
        s
        for s in sites
        if s.what.startswith("isinstance")
        and s.category != GEOMETRY
        and not s.path.startswith("conformance/")
    ]
    lines.append(
        f"  of which isinstance on codec or storage classes outside conformance/: {len(hooked)}"
    )
    lines += [f"  {s.path}:{s.line}  [{s.category}] {s.what}" for s in sites]
    lines.append("")

    counts = python_lines(root)
    lines.append(f"Python lines: {sum(counts.values()):,} in all")
    lines += [f"  {folder}: {n:,}" for folder, n in counts.items()]
    tools = sum(p.read_bytes().count(b"\n") for p in python_files(root, "tools"))
    lines.append(f"  (tools, not in the sum: {tools:,})")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    print(report(root.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
