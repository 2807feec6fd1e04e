"""The turbo family's machine: the base machine (with verify rounds) at one TurboQuant
codec per example.

Every example draws one codec, ``(k_bits, v_bits)`` with ``k_bits`` in {2, 4, 5, 8} and
``v_bits`` in {2, 3, 4, 5, 8}, and head dims from ``TURBO_HEAD_DIMS`` (64, 128, 256, 512;
key and value dims drawn separately). ``BatchedTurboQuantKVCache`` fills all three roles
of ``TurboQuantKVCache``'s rows, so its machine is the speculative one: every base rule
(requests, joins, filters, extracts, publishes, steps, trims, bad input) plus verify
rounds. The base machine does the rest; this subclass supplies:

* **the model, by role**: keys stored as ``(kIdx, kScales, kZeros)``, values as
  ``(vPacked, vScales)``, by the reference codec (``kvrows.reference.turbo_codec``): both
  implementations' stored planes (serial ``planes()``, ``row_planes(b)``, extracted and
  published rows) must equal it byte for byte, so the optimized codes and scales are
  checked exactly on every append;
* **the fetched form**: a read returns keys decoded and values still rotated, both
  bfloat16 (:meth:`TurboMachine._fetched_form`); tokens are identified by the bytes of
  their decoded keys (masks and visibility as the base machine checks them);
* **deferred vs eager V** (:meth:`TurboMachine._check_deferred`): every attention output
  of both implementations (serial chunks, layout steps, verify blocks) against
  ``eager_attention`` of the same implementation over the model's planes laid out in the
  read's columns (values fully decoded before attention), under the ``attention.eager``
  tolerance;
* the codec's invalid operations: rows of other widths, plain and affine caches and
  layouts, each refused with ``IncompatibleRowsError``; head dims the codec does not
  store, refused with ``InvalidInputError`` before anything changes.

No mlx-lm peer: mlx-lm has no TurboQuant cache. Saved states are checked as in every
family (both implementations describe the same rows; the machine goes on with restored
caches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from hypothesis import strategies as st

from kvrows.codec import TURBO_HEAD_DIMS, Role
from kvrows.conformance import strategies as ks
from kvrows.conformance.arrays import NUMPY_DTYPES, random_block
from kvrows.conformance.families import Impl
from kvrows.conformance.machines import Case, Planes, Slot, Track, column_ids
from kvrows.conformance.speculative import SpeculativeMachine
from kvrows.errors import IncompatibleRowsError, InvalidInputError
from kvrows.reference import turbo_codec
from kvrows.schemes import TURBO_KEY_BITS, TURBO_VALUE_BITS, Turbo

__all__ = ["CODECS", "HEAD_DIMS", "TURBO_CHECKS", "TurboMachine", "turbo_geometries"]

Array = npt.NDArray[Any]

#: Every supported codec, ``(k_bits, v_bits)``.
CODECS: tuple[tuple[int, int], ...] = tuple(
    (k, v) for k in TURBO_KEY_BITS for v in TURBO_VALUE_BITS
)
#: Head dims the examples use: every one the codec stores.
HEAD_DIMS = TURBO_HEAD_DIMS

#: The checks (``Stats.checks`` keys) the turbo machine adds; the cases it exists for.
TURBO_CHECKS = (
    "deferred vs eager",
    "eager over padding columns",
    "8-bit keys",
    "packed keys",
    "key and value dims differ",
)


@st.composite
def turbo_geometries(draw: st.DrawFn, codecs: tuple[tuple[int, int], ...] = CODECS) -> ks.Geometry:
    """The base shapes at TurboQuant head dims, then a codec ``(k_bits, v_bits)``."""
    base = draw(ks.geometries(dims=HEAD_DIMS))
    k_bits, v_bits = draw(st.sampled_from(codecs), label="(k_bits, v_bits)")
    return replace(base, k_bits=k_bits, v_bits=v_bits)


class TurboMachine(SpeculativeMachine):
    """The base rules and verify rounds at one TurboQuant codec per example (see the
    module docstring)."""

    codecs: ClassVar[tuple[tuple[int, int], ...]] = CODECS

    @classmethod
    def geometries(cls) -> st.SearchStrategy[ks.Geometry]:
        return turbo_geometries(tuple(cls.codecs))

    def teardown(self) -> None:
        if self.geo is not None and self.stats.steps > self._steps_at_start:
            g = self.g
            self.stats.check("8-bit keys" if g.k_bits == 8 else "packed keys")
            for dim in {g.key_dim, g.value_dim}:
                self.stats.check(f"head dim {dim}")
            if g.key_dim != g.value_dim:
                self.stats.check("key and value dims differ")
        super().teardown()

    # ------------------------------------------------------------------ the model
    def _encode(self, block: Array, role: Role = "keys") -> Planes:
        if role == "keys":
            return tuple(turbo_codec.encode_keys(block, self.g.k_bits))
        return tuple(turbo_codec.encode_values(block, self.g.v_bits))

    def _fetched_form(self, planes: Planes, role: Role = "keys") -> Planes:
        """Keys decoded, values decoded but still rotated, as bfloat16 (the spec's read)."""
        bf16 = NUMPY_DTYPES["bfloat16"]
        if role == "keys":
            keys = turbo_codec.decode_keys(planes[0], planes[1], planes[2], self.g.k_bits)
            return (keys.astype(bf16),)
        return (turbo_codec.rotated_values(planes[0], planes[1], self.g.v_bits).astype(bf16),)

    def _fetched_dtypes(self) -> list[str]:
        return ["bfloat16"]  # whatever the activation dtype (spec/turbo-codec.md)

    # --------------------------------------------------------- deferred vs eager V
    def _models(
        self, rows: Sequence[tuple[int, Track, Array, Array]]
    ) -> list[tuple[int, tuple[Planes, Planes], dict[bytes, int]]]:
        """Each row's model key and value planes after the append, and its ``{token id:
        position}`` (the same for both implementations' reads)."""
        models = []
        for b, track, keys, values in rows:
            model = (
                tuple(
                    np.concatenate([p, e], axis=2)
                    for p, e in zip(track.keys, self._encoded(keys), strict=True)
                ),
                tuple(
                    np.concatenate([p, e], axis=2)
                    for p, e in zip(track.values, self._encoded(values, "values"), strict=True)
                ),
            )
            ids = column_ids(self._fetched_form(model[0]), 0)
            models.append((b, model, {token: p for p, token in enumerate(ids)}))
        return models

    def _image(
        self,
        fetched_keys: Planes,
        models: Sequence[tuple[int, tuple[Planes, Planes], dict[bytes, int]]],
    ) -> tuple[Planes, Planes]:
        """The model's key and value planes laid out in the read's columns: each column
        that holds a token of its row (identified by its decoded key) gets the token's
        planes, every other column zero planes (the mask hides them)."""
        batch, columns = int(fetched_keys[0].shape[0]), int(fetched_keys[0].shape[2])
        image: list[list[Array]] = [[], []]
        for b, model, position in models:
            if not image[0]:
                for side, planes in enumerate(model):
                    image[side] = [
                        np.zeros((batch, p.shape[1], columns, p.shape[3]), p.dtype) for p in planes
                    ]
            for c, token in enumerate(column_ids(fetched_keys, b)):
                p = position.get(token)
                if p is None:
                    self.stats.check("eager over padding columns")
                    continue
                for side, planes in enumerate(model):
                    for target, plane in zip(image[side], planes, strict=True):
                        target[b, :, c] = plane[0, :, p]
        return tuple(image[0]), tuple(image[1])

    def _check_deferred(
        self,
        what: str,
        queries: Array,
        outputs: tuple[Array, Array],
        fetched_keys: tuple[Planes, Planes],
        mask: npt.NDArray[np.bool_],
        rows: Sequence[tuple[int, Track, Array, Array]],
    ) -> None:
        """Each implementation's (deferred) attention equals its ``eager_attention``: keys
        and values decoded from the model's planes in the read's columns, then attention
        under the same mask (values un-rotated before attention, not after)."""
        import kvrows.optimized.codecs as opt_codecs
        import kvrows.reference.codecs as ref_codecs

        spec = Turbo(k_bits=self.g.k_bits, v_bits=self.g.v_bits)
        oracles: tuple[tuple[Impl, Any, Any], ...] = (
            (self.ref_impl, ref_codecs.TurboCodec(spec), ref_codecs.eager_attention),
            (self.opt_impl, opt_codecs.TurboCodec(spec), opt_codecs.eager_attention),
        )
        models = self._models(rows)
        for (impl, codec, eager), out, keys in zip(oracles, outputs, fetched_keys, strict=True):
            image_keys, image_values = self._image(keys, models)
            expected = eager(
                codec,
                impl.to_native(queries),
                tuple(impl.to_native(p) for p in image_keys),
                tuple(impl.to_native(p) for p in image_values),
                impl.to_native(mask),
                self.g.scale,
            )
            self._close(
                "attention.eager",
                f"{what} ({impl.name}): deferred-V attention vs eager",
                out,
                impl.to_numpy(expected),
            )
        self.stats.check("deferred vs eager", len(rows))

    # ------------------------------------------------------------- invalid input
    def _filled(self, impl: Impl, name: str, **changes: int) -> Any:
        """A new ``name`` of ``impl`` (this example's codec unless ``changes``) after one
        append of two tokens of the example's shapes."""
        return self._fill(impl, self._new(impl, name, **changes), self.g.key_dim)

    def _holding(self, impl: Impl, name: str, cache: Any, **changes: int) -> Any:
        """A new ``name`` layout of ``impl`` holding ``cache`` as its row."""
        layout = self._new(impl, name, **changes)
        layout.merge_rows([cache])
        return layout

    def _other_widths(self) -> tuple[dict[str, int], dict[str, int]]:
        g = self.g
        other_k = next(k for k in TURBO_KEY_BITS if k != g.k_bits)
        other_v = next(v for v in TURBO_VALUE_BITS if v != g.v_bits)
        return {"k_bits": other_k}, {"v_bits": other_v}

    def _foreign(self, impl: Impl, what: str) -> Any:
        """The base machine's foreign caches, with the codec's own notion of another key
        dim (another stored head dim) and of another codec (an affine cache)."""
        g = self.g
        if what == "key_dim":
            other = next(d for d in HEAD_DIMS if d != g.key_dim)
            return self._fill(impl, self._new(impl, self.serial_name), other)
        if what == "other codec":
            return self._fill(impl, self._new(impl, "QuantizedKVCache"), g.key_dim)
        return super()._foreign(impl, what)

    def _extra_serial_cases(self, track: Track) -> list[Case]:
        g = self.g
        rng = np.random.default_rng(6)
        rows = 1
        odd = random_block(rng, (rows, g.heads, 1, 96), g.dtype)
        keys = random_block(rng, (rows, g.heads, 1, g.key_dim), g.dtype)
        values = random_block(rng, (rows, g.heads, 1, g.value_dim), g.dtype)
        cases: list[Case] = [
            (
                "serial update with a key dim of 96 (not a TurboQuant head dim)",
                lambda impl, c: c.update_and_fetch(impl.to_native(odd), impl.to_native(values)),
                "V0",
                None if track.geometry_known else InvalidInputError,
            ),
            (
                "serial update with a value dim of 96 (not a TurboQuant head dim)",
                lambda impl, c: c.update_and_fetch(impl.to_native(keys), impl.to_native(odd)),
                "V0",
                None if track.geometry_known else InvalidInputError,
            ),
        ]
        return cases + super()._extra_serial_cases(track)

    def _extra_layout_cases(self, slot: Slot) -> list[Case]:
        serial, layout, bad = self.serial_name, self.spec.name, IncompatibleRowsError
        other_k, other_v = self._other_widths()
        cases: list[Case] = [
            (
                f"merge_rows of a cache of k_bits {other_k['k_bits']}",
                lambda impl, lay: lay.merge_rows([self._filled(impl, serial, **other_k)]),
                "V0",
                bad,
            ),
            (
                f"merge_rows of a cache of v_bits {other_v['v_bits']}",
                lambda impl, lay: lay.merge_rows([self._filled(impl, serial, **other_v)]),
                "V0",
                bad,
            ),
            (
                "merge_rows of a valid cache and one of other widths",
                lambda impl, lay: lay.merge_rows(
                    [self._filled(impl, serial), self._filled(impl, serial, **other_v)]
                ),
                "V0",
                bad,
            ),
            (
                "merge_rows of a plain KVCache holding tokens",
                lambda impl, lay: lay.merge_rows([self._filled(impl, "KVCache")]),
                "V0",
                bad,
            ),
            (
                "merge_rows of an affine QuantizedKVCache holding tokens",
                lambda impl, lay: lay.merge_rows([self._filled(impl, "QuantizedKVCache")]),
                "V0",
                bad,
            ),
            (
                "merge_rows of a plain BatchedKVCache holding a row",
                lambda impl, lay: lay.merge_rows(
                    [self._holding(impl, "BatchedKVCache", self._filled(impl, "KVCache"))]
                ),
                "V0",
                bad,
            ),
            (
                "merge_rows of a layout of other widths holding a row",
                lambda impl, lay: lay.merge_rows(
                    [self._holding(impl, layout, self._filled(impl, serial, **other_k), **other_k)]
                ),
                "V0",
                bad,
            ),
        ]
        return cases + super()._extra_layout_cases(slot)
