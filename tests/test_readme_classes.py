"""The README's table of seed classes is ``kvrows classes`` (read off the composition
table, the conformance families and the spec pages), and every landed class is driven by
a conformance machine and has a spec page."""

from __future__ import annotations

from pathlib import Path

from kvrows.app.classes import README_BEGIN, README_END, classes_table, families_of, spec_page
from kvrows.compositions import COMPOSITIONS

README = Path(__file__).resolve().parent.parent / "README.md"

#: Landed classes no conformance family drives yet (each one is an open gap; this set only
#: shrinks).
NOT_YET_DRIVEN: set[str] = set()


def test_the_readme_table_is_the_generated_one() -> None:
    text = README.read_text(encoding="utf-8")
    assert README_BEGIN in text and README_END in text
    copy = text.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()
    assert copy == classes_table().strip(), "README is stale: paste `kvrows classes` into it"


def test_every_landed_class_has_a_family_and_a_spec_page() -> None:
    landed = [entry.name for entry in COMPOSITIONS if entry.is_landed]
    assert landed, "no landed class"
    undriven = {name for name in landed if not families_of(name)}
    assert undriven == NOT_YET_DRIVEN, undriven ^ NOT_YET_DRIVEN
    assert [name for name in landed if spec_page(name) is None] == []


def test_the_table_names_every_class_once_with_its_status() -> None:
    table = classes_table()
    for entry in COMPOSITIONS:
        rows = [line for line in table.splitlines() if line.startswith(f"| `{entry.name}` |")]
        assert len(rows) == 1, entry.name
        status = "planned (issue" if entry.issue is not None else "| landed"
        assert status in rows[0], rows[0]
