"""Version-1 forms: what files of kvrows' saved-state format 1 hold where it differs from
today's, and the form-version plumbing (``spec/contract.md`` §0.6,
``spec/persistence-files.md``).

A format-2 file records each layer entry's form version (``form``; absent: 1), so the
families switch to the §0.6 rule one at a time; a format-1 file's layers are all form 1.
Each family writes ``kvrows.forms.written_form(entry)``. What differs from form 1:

* the delayed layouts (form 2): version 1 saved two ragged **groups**, each its stage's
  one-stage preset's whole form (``plain.*``, ``affine.*``, each in its own column frame),
  then the record ``start, converted_at, left_pad, prefilling, composed`` and a ring's
  ``keep``; :func:`parse_delayed` reads either (their lengths differ for every preset);
* the recurrent layer record: version 1 described its two planes as ``conv_shape``,
  ``conv_dtype``, ``state_shape``, ``state_dtype`` (the state tuple ``(conv, recurrent,
  offset)`` is the two-plane ``(state.0, state.1, offset)``, unchanged).

The other families' form 1 is the §0.6 rule already (the paged integer codec tags
``(kind, a, b)`` and the latent fields are read by ``kvrows.paged_forms`` and
``kvrows.latent`` until their writers switch).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

from kvrows.codecs.state import StateShapes
from kvrows.compositions import Composition
from kvrows.errors import CorruptStateError, InvalidInputError, UnsupportedStateError
from kvrows.forms import (
    DELAYED_RECORD,
    FORM_VERSION,
    DelayedParts,
    StateForm,
    delayed_fields,
    delayed_groups,
    delayed_marks,
    delayed_record,
    state_form,
    unpack_state,
)
from kvrows.forms import parse_delayed_state as parse_form_2
from kvrows.geometries import GEOMETRIES

__all__ = [
    "V1_STATE_FIELDS",
    "delayed_form",
    "form_version",
    "parse_delayed",
    "parse_delayed_state",
    "state_shapes",
]

#: The fields of a version-1 recurrent layer record (its ``kv`` entry).
V1_STATE_FIELDS = ("conv_shape", "conv_dtype", "state_shape", "state_dtype")


def form_version(record: Mapping[str, Any]) -> int:
    """The form version of a saved layer entry (absent: 1); one this kvrows does not read
    (newer than ``FORM_VERSION``) is ``UnsupportedStateError``, one that is no version
    ``CorruptStateError``."""
    form = record.get("form", 1)
    if isinstance(form, bool) or not hasattr(form, "__index__"):
        raise CorruptStateError(f"a layer's form version must be an integer, got {form!r}")
    version = operator.index(form)
    if version < 1:
        raise CorruptStateError(f"a layer's form version must be 1 or more, got {version}")
    if version > FORM_VERSION:
        raise UnsupportedStateError(
            f"a layer of form version {version}; this kvrows reads forms up to "
            f"{FORM_VERSION}: upgrade kvrows"
        )
    return version


def state_shapes(saved: Mapping[str, Any]) -> StateShapes:
    """The shapes of a version-1 recurrent layer record: conv ``(K - 1, C)`` and state."""
    conv_shape, conv_dtype, state_shape, state_dtype = (saved[name] for name in V1_STATE_FIELDS)
    return StateShapes.from_v1(conv_shape, conv_dtype, state_shape, state_dtype)


# -------------------------------------------------------------------------------- delayed


def delayed_form(entry: Composition) -> StateForm:
    """A delayed layout's form 1: each group's form (its stage's one-stage ragged preset's,
    fields prefixed ``plain.`` / ``affine.``), then the record and what a layout form
    omits (a ring's ``keep``)."""
    plain, affine = (state_form(group).fields for group in delayed_groups(entry))
    fields = (
        *(f"plain.{name}" for name in plain),
        *(f"affine.{name}" for name in affine),
        *DELAYED_RECORD,
        *GEOMETRIES[entry.geometry].layout_form_omits,
    )
    return StateForm(entry.name, fields, entry.name)


def parse_delayed_state(
    entry: Composition, state: object, *, keep: int | None = None
) -> DelayedParts:
    """A delayed layout's form-1 ``state`` checked whole (``InvalidInputError`` naming the
    fault): its length, each group's form, the row table against the groups (as many
    plain rows as the plain group holds), and the record (``kvrows.forms.delayed_record``).
    """
    form = delayed_form(entry)
    tail = (
        len(form.fields) - len(DELAYED_RECORD) - len(GEOMETRIES[entry.geometry].layout_form_omits)
    )
    values = delayed_fields(
        entry, state, form, f"its plain group's, its affine group's, then {form.fields[tail:]}"
    )
    plain_entry, affine_entry = delayed_groups(entry)
    width = len(state_form(plain_entry).fields)
    split = width + len(state_form(affine_entry).fields)
    plain_state, affine_state = tuple(values[:width]), tuple(values[width:split])
    plain = unpack_state(plain_entry, plain_state)
    affine = unpack_state(affine_entry, affine_state)
    raw = dict(zip(form.fields[split:], values[split:], strict=True))
    converted = delayed_marks(entry, raw)
    counts = [len(group["offset"]) for group in (plain, affine)]
    plain_rows = sum(1 for c in converted if c is None)
    if [plain_rows, len(converted) - plain_rows] != counts:
        raise InvalidInputError(
            f"{entry.name} state: the row table has {plain_rows} plain and "
            f"{len(converted) - plain_rows} converted rows, the groups hold "
            f"{counts[0]} and {counts[1]}"
        )
    record = delayed_record(entry, raw, converted, plain["offset"], keep)
    return DelayedParts((plain, affine), (plain_state, affine_state), record)


def parse_delayed(entry: Composition, state: object, *, keep: int | None = None) -> DelayedParts:
    """A delayed layout's state of either form, told apart by its length (form 1's and
    form 2's differ for every delayed preset): what ``from_state`` reads."""
    if isinstance(state, tuple | list) and len(state) == len(delayed_form(entry).fields):
        return parse_delayed_state(entry, state, keep=keep)
    return parse_form_2(entry, state, keep=keep)
