"""Every error message is written once: no literal message is copied between files.

Conformance compares the reference's and the optimized implementation's error text, so a
message both raise belongs in ``kvrows/errors.py`` (a constant or a ``..._message``
function) and each raise site uses it. Every module of ``reference/``, ``optimized/`` and
``kvrows/`` is parsed (not imported); each ``raise SomeError(<literal>)`` whose first
argument is a string, an f-string, or a ``+`` of them is normalized (every ``{...}``
placeholder becomes ``{}``), and a normalized text raised in two files fails.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("reference", "optimized", "kvrows")

#: Messages that are raised in several files and differ on purpose, with the reason.
#: Empty: add an entry only for a text that must not be shared, and say why.
DIFFER_ON_PURPOSE: dict[str, str] = {}


def literal_message(node: ast.expr) -> str | None:
    """The literal text of a message with each placeholder as ``{}``; None if not literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            part.value if isinstance(part, ast.Constant) and isinstance(part.value, str) else "{}"
            for part in node.values
        )
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = literal_message(node.left), literal_message(node.right)
        if left is not None and right is not None:
            return left + right
    return None


def is_wrapper(message: str) -> bool:
    """A text of only placeholders and punctuation (``"{}: {}"``) prefixes another
    message with its owner: the words are in the wrapped message, not here."""
    return not any(character.isalpha() for character in message.replace("{}", ""))


def raise_sites(source: str, where: str) -> list[tuple[str, str]]:
    """``(normalized message, "file:line")`` of every literal-message raise in ``source``."""
    sites: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            message = literal_message(node.exc.args[0])
            if message is not None and not is_wrapper(message):
                sites.append((message, f"{where}:{node.lineno}"))
    return sites


def copied_messages(sources: dict[str, str]) -> dict[str, list[str]]:
    """Each normalized message raised in more than one of ``sources`` (file name to
    text), with its sites."""
    sites_of: dict[str, list[str]] = defaultdict(list)
    for where, source in sources.items():
        for message, site in raise_sites(source, where):
            sites_of[message].append(site)
    return {
        message: sites
        for message, sites in sites_of.items()
        if len({site.rsplit(":", 1)[0] for site in sites}) > 1
    }


def test_the_checker_finds_a_copied_message_whatever_its_placeholders() -> None:
    sources = {
        "a.py": (
            "def f(x, y):\n"
            "    raise InvalidInputError(f'{x} must be positive, got {y!r}')\n"
            "def g(name):\n"
            "    raise KvRowsError(f'{name}: {name}')\n"
        ),
        "b.py": (
            "def h(owner, v, name):\n"
            "    if v:\n"
            "        raise InvalidInputError(f'{owner.name} must be ' + f'positive, got {v}')\n"
            "    raise KvRowsError(f'{name}: {v}')\n"
            "def k():\n"
            "    raise LayoutStateError('adopt needs an empty cache') from None\n"
        ),
        "c.py": "def k():\n    raise LayoutStateError('adopt needs an empty cache')\n",
    }
    assert copied_messages(sources) == {
        "{} must be positive, got {}": ["a.py:2", "b.py:3"],
        "adopt needs an empty cache": ["b.py:6", "c.py:2"],
    }


def test_a_message_repeated_within_one_file_is_not_a_copy() -> None:
    source = "def f():\n    raise A('no rows')\ndef g():\n    raise B('no rows')\n"
    assert copied_messages({"a.py": source}) == {}


def test_no_error_message_is_copied_between_files() -> None:
    sources = {
        str(path.relative_to(ROOT)): path.read_text()
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
    }
    assert len(sources) > 50  # the folders were found
    copies = {
        message: sites
        for message, sites in copied_messages(sources).items()
        if message not in DIFFER_ON_PURPOSE
    }
    assert copies == {}, (
        "define each of these once in kvrows/errors.py and use it at every site:\n"
        + "\n".join(f"{message!r}: {', '.join(sites)}" for message, sites in copies.items())
    )
