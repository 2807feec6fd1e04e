"""A ratchet on dispatch by codec kind or concrete storage type (issue 23's measure).

Every ``isinstance`` / ``issubclass``, ``type(x) is ...``, ``type(x).__name__ == "..."``,
``case Cls()`` and comparison of a string with a codec kind, a geometry kind or a storage
class name (and every dict keyed only by codec kinds) outside the codec and geometry
modules is a *dispatch site* (the definition: ``spec/measures.md``; the detector:
``tools/measures.py``, which reads the source with ``ast``). Each such site is a place that
adding a codec or a geometry has to touch.

The issue's target is **0** sites on codec kinds and concrete storage types, reached when
the delayed layouts' saved form became the one form rule (its modifier record) and the
paged form asked the placement registry: :data:`BASELINE` is empty and the total 0, so
any new site fails (the issue's AST test). The ratchet's shape stays, should a site ever
be allowed again: no file may hold more sites than :data:`BASELINE` records, nor the
total exceed :data:`BASELINE_TOTAL`.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "measures.py"


def _load_measures() -> Any:
    spec = importlib.util.spec_from_file_location("kvrows_tools_measures", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


measures = _load_measures()

#: Dispatch sites per file (``.venv/bin/python tools/measures.py``): none left.
BASELINE: dict[str, int] = {}

#: The sum of :data:`BASELINE`: 0, the issue's target.
BASELINE_TOTAL = 0

ADVICE = (
    "Ask a capability instead of a type: a protocol of kvrows.protocols (HasCodec, "
    "RingGeometry, Composed, RowTrimmable, AppendLimited, ReusableOffset, StateDisposer, "
    "SelfChecking, BatchableCache, Converting, Handover, RowAttention, PendingRows, "
    "TimeOrderedReads, PagedRows, LatentAppend, StateWritten, RowSource), a member of the codec (kvrows.codec.Codec: key, "
    "parameters, plane specs) or of the composition entry; a branch on codec kinds belongs "
    "in the codec modules, one on geometry kinds in the geometry modules (spec/measures.md). "
    "Sites of each file that grew:"
)


def _listing(sites: list[Any], paths: set[str]) -> str:
    return "\n".join(
        f"  {s.path}:{s.line} [{s.category}] {s.what}" for s in sites if s.path in paths
    )


def test_the_recorded_total_is_the_sum_of_the_files() -> None:
    # Raising a file's allowance must show as a raised total in review.
    assert sum(BASELINE.values()) == BASELINE_TOTAL


def test_no_dispatch_site_is_left() -> None:
    """The ratchet (no file above its baseline, the total not above the recorded one) and
    the issue's measure (0 sites on codec kinds or concrete storage types outside the codec
    and geometry modules), from one scan of the tree (a scan parses every file: one test,
    so one worker pays it)."""
    sites: list[Any] = measures.dispatch_sites(ROOT)
    counts: dict[str, int] = measures.sites_per_file(sites)
    grown = {path for path, n in counts.items() if n > BASELINE.get(path, 0)}
    assert not grown, (
        "dispatch on codec kinds or concrete storage types grew in "
        + ", ".join(f"{p} ({counts[p]} > {BASELINE.get(p, 0)})" for p in sorted(grown))
        + f".\n{ADVICE}\n{_listing(sites, grown)}"
    )
    assert len(sites) <= BASELINE_TOTAL, (
        f"{len(sites)} dispatch sites, the baseline allows {BASELINE_TOTAL}.\n{ADVICE}\n"
        + _listing(sites, grown)
    )
    assert BASELINE_TOTAL == 0
    assert not sites, f"{len(sites)} dispatch sites.\n{ADVICE}\n" + _listing(
        sites, {s.path for s in sites}
    )


# -- the detector, on a small tree written here ------------------------------------------------

SYNTHETIC = {
    "kvrows/schemes.py": """
        from dataclasses import dataclass
        from typing import ClassVar

        @dataclass(frozen=True)
        class Plain:
            kind: ClassVar[str] = "plain"
            @property
            def key(self) -> str:
                return "plain"

        @dataclass(frozen=True)
        class Affine:
            kind: ClassVar[str] = "affine"
            @property
            def key(self) -> str:
                return "affine"

        @dataclass(frozen=True)
        class Ring:
            kind: ClassVar[str] = "ring"

        CodecSpec = Plain | Affine

        def parse(spec):
            return isinstance(spec, Plain)  # a codec module: not counted
    """,
    "kvrows/geometries/chunked.py": """
        from dataclasses import dataclass
        from typing import ClassVar

        from kvrows.schemes import Ring

        @dataclass(frozen=True)
        class Chunked:
            kind: ClassVar[str] = "chunked"

        def place(spec):
            return isinstance(spec, Ring) or spec.kind == "chunked"  # a geometry module: not counted
    """,
    "kvrows/protocols.py": """
        from typing import Protocol

        class HasCodec(Protocol):
            codec: object
    """,
    "kvrows/errors.py": """
        class KvRowsError(Exception):
            pass

        class BadInput(KvRowsError, ValueError):
            pass
    """,
    "kvrows/values.py": """
        from dataclasses import dataclass

        @dataclass(frozen=True)
        class Composition:
            name: str
    """,
    "reference/__init__.py": """
        from .rows import RowLayout
    """,
    "reference/codecs.py": """
        class PlainCodec:
            pass
    """,
    "reference/rows.py": """
        class Storage:
            pass

        class RowLayout(Storage):
            pass
    """,
    "reference/geometries/ring.py": """
        from .rows import Storage

        def place(cache):
            return isinstance(cache, Storage)  # a geometry module: not counted
    """,
    "app/engine.py": """
        import numpy as np

        from kvrows import reference as ref
        from kvrows.errors import BadInput
        from kvrows.geometries.chunked import Chunked
        from kvrows.protocols import HasCodec
        from kvrows.reference.codecs import PlainCodec
        from kvrows.reference.rows import Storage
        from kvrows.schemes import Affine, CodecSpec, Plain, Ring
        from kvrows.values import Composition

        def convert(spec: Plain | Affine) -> Plain | Affine:  # annotations: not counted
            return spec

        def serve(cache, spec, entry, kinds):
            a = isinstance(spec, Plain)  # site: codec
            b = isinstance(cache, ref.RowLayout | int)  # site: storage
            c = type(cache) is Storage  # site: storage
            d = type(cache).__name__ == "RowLayout"  # site: storage
            e = entry.codec == "plain"  # site: codec
            f = entry.geometry in ("ring", "other")  # site: geometry-spec
            g = isinstance(spec, Ring)  # site: geometry-spec
            h = isinstance(spec, CodecSpec)  # site: codec
            i = isinstance(cache.codec, PlainCodec)  # site: codec
            tails = {"plain": (), "affine": ("bits",)}  # site: codec
            match spec:
                case Plain():  # site: codec
                    pass
            j = issubclass(type(cache), Storage)  # site: storage
            k = isinstance(cache, Storage) or isinstance(spec, Plain)  # site: storage # site: codec
            allowed = (Plain, Affine)  # site: codec
            either = Plain | Affine | Ring  # site: codec
            m = type(cache) in (Storage, ref.RowLayout)  # site: storage
            n = entry.name.startswith("affine")  # site: codec
            o = isinstance(spec, Chunked)  # site: geometry-spec
            match entry.geometry:
                case "ring":  # site: geometry-spec
                    pass
            return (
                {"plain": 1, "engine": 2},
                isinstance(cache, HasCodec),
                isinstance(spec, (int, str)),
                isinstance(cache, np.ndarray),
                isinstance(cache, BadInput),
                isinstance(entry, Composition),
                isinstance(cache, kinds),
                type(cache) is type(spec),
                "plain" == "plain",
                cache.name == "reference",
                a, b, c, d, e, f, g, h, i, j, k, m, n, o, tails, allowed, either,
            )
    """,
    "tests/test_engine.py": """
        from kvrows.schemes import Plain

        def test_it(spec):
            assert isinstance(spec, Plain)  # tests may name classes: not scanned
    """,
    "reference/speculative.py": """
        from .rows import RowLayout

        class SpeculativeLayout(RowLayout):
            def merge_rows(self, rows):
                self._guard()
                super().merge_rows(rows)
    """,
    "kvrows/table.py": """
        from typing import Protocol

        class Batchable(Protocol):
            def merge_rows(self, rows):
                \"\"\"Join the rows.\"\"\"
                ...

        class Delayed:
            def merge_rows(self, rows):
                for group in self.groups:
                    group.merge_rows(rows)

        class Parts:
            def merge_rows(self, rows):
                self.check_merge(rows)
                for part, share in zip(self.caches, self._sources(rows)):
                    part.merge_rows(share)

        class Joined:
            def merge_rows(self, rows):
                self.check_merge(rows)
                self.rows.merge_rows(rows)
    """,
    "conformance/machines.py": """
        from hypothesis import stateful
        from hypothesis.stateful import RuleBasedStateMachine

        class Base(RuleBasedStateMachine):
            pass

        class Pool(stateful.RuleBasedStateMachine):
            pass

        class Family(Base):
            pass
    """,
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    for relative, source in SYNTHETIC.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip())
    return root


def _marked(root: Path) -> list[tuple[str, int, str]]:
    """``(path, line, category)`` of every ``# site: <category>`` marker in the tree."""
    marked = []
    for relative in SYNTHETIC:
        for number, text in enumerate((root / relative).read_text().splitlines(), 1):
            for part in text.split("# site: ")[1:]:
                marked.append((relative, number, part.split()[0]))
    return sorted(marked)


def test_the_detector_finds_each_marked_site_and_nothing_else(synthetic: Path) -> None:
    found = [(s.path, s.line, s.category) for s in measures.dispatch_sites(synthetic)]
    assert len(_marked(synthetic)) == 20
    assert sorted(found) == _marked(synthetic)


def test_a_new_site_fails_the_ratchet_naming_its_line(synthetic: Path) -> None:
    engine = synthetic / "app" / "engine.py"
    before = measures.sites_per_file(measures.dispatch_sites(synthetic))
    original = engine.read_text()
    try:
        engine.write_text(original + "\n\ndef probe(c):\n    return isinstance(c, Storage)\n")
        after = measures.dispatch_sites(synthetic)
    finally:
        engine.write_text(original)
    assert measures.sites_per_file(after)["app/engine.py"] == before["app/engine.py"] + 1
    last = len((original + "\n\ndef probe(c):\n").splitlines()) + 1
    assert ("app/engine.py", last, "storage") in [(s.path, s.line, s.category) for s in after]


def test_merge_rows_counts_only_substantive_definitions(synthetic: Path) -> None:
    project = measures.Project(synthetic)
    merges = {(path, cls): real for path, _, cls, real in measures.merge_rows_definitions(project)}
    assert merges == {
        ("reference/speculative.py", "SpeculativeLayout"): False,  # guards, then super()
        ("kvrows/table.py", "Batchable"): False,  # a protocol's stub
        ("kvrows/table.py", "Delayed"): True,  # its own join, over groups
        ("kvrows/table.py", "Parts"): False,  # every part checked, then each its share
        ("kvrows/table.py", "Joined"): True,  # checked, but not a part's merge
    }


def test_machine_roots_are_the_direct_rule_based_state_machines(synthetic: Path) -> None:
    project = measures.Project(synthetic)
    assert [cls for _, _, cls in measures.machine_roots(project)] == ["Base", "Pool"]
