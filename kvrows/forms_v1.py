"""Version-1 forms: what files of kvrows' saved-state format 1 hold where it differs from
today's, and the form-version plumbing (``spec/contract.md`` §0.6,
``spec/persistence-files.md``).

A format-2 file records each layer entry's form version (``form``; absent: 1), so the
families switch to the §0.6 rule one at a time; a format-1 file's layers are all form 1.
Every family still writes form 1 (``kvrows.forms.FORM_VERSION``), so the readers of
``kvrows.forms`` and ``kvrows.paged_forms`` read form 1 today (the two-group delayed form,
the paged integer codec tags ``(kind, a, b)``, the latent fields); each moves here when
its family's writer switches. What differs already is the recurrent layer record:
version 1 described its two planes as ``conv_shape``, ``conv_dtype``, ``state_shape``,
``state_dtype`` (the state tuple ``(conv, recurrent, offset)`` is the two-plane
``(state.0, state.1, offset)``, unchanged).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

from kvrows.codecs.state import StateShapes
from kvrows.errors import CorruptStateError, UnsupportedStateError
from kvrows.forms import FORM_VERSION

__all__ = ["V1_STATE_FIELDS", "form_version", "state_shapes"]

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
