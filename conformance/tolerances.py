"""The one table of tolerances the conformance suite compares with.

Keys are ``(family, quantity, dtype)``. A :class:`Tolerance` of ``(0, 0)`` means
*byte for byte*: the two arrays must have the same shape, dtype and bits. A
positive tolerance means ``|actual - expected| <= atol + rtol * |expected|``
element-wise, computed in float32 after both sides are widened exactly.

Quantities are not in the table because they are always exact (compared with
``==``, never through a tolerance): offsets, per-row positions, left padding,
widths, batch sizes, masks (as expanded booleans), signatures, geometries,
projected bytes, return values of ``trim`` and raised error types.

``spec/tolerances.md`` shows the same table and how every number was chosen
(``kvrows.conformance.calibrate`` reruns the measurement). Later families add
rows; :func:`tolerance` raises ``KeyError`` for a key the table lacks, so a new
comparison can never run without a number someone chose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "ALWAYS_EXACT",
    "DTYPES",
    "QUANTITIES",
    "TOLERANCES",
    "Tolerance",
    "compare",
    "tolerance",
]

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|``; ``(0, 0)`` means byte-identical."""

    atol: float
    rtol: float

    @property
    def exact(self) -> bool:
        return self.atol == 0 and self.rtol == 0

    def describe(self) -> str:
        return "exact" if self.exact else f"atol={self.atol:g} rtol={self.rtol:g}"


EXACT = Tolerance(0.0, 0.0)

#: What each quantity compares (the keys' middle part).
QUANTITIES: dict[str, str] = {
    "kv.stored": "stored K/V of every row, reference vs optimized (extract_row / row_planes)",
    "kv.fetched": "fetched K/V at mask-visible positions, reference vs optimized",
    "kv.solo": "each row vs the serial cache that saw the same appends (solo replay)",
    "kv.mlx_lm": "optimized vs mlx-lm (KVCache / BatchKVCache): stored, fetched, extracted",
    "attention": "attention output of one step, reference vs optimized",
    "attention.solo": "a row's attention output vs its serial cache's, same implementation",
    "attention.mlx_lm": "optimized attention vs mlx-lm's cache + scaled_dot_product_attention",
    "attention.mlx_lm.host": "optimized attention on the CPU's host path (NumPy, float32 over "
    "the decoded planes) vs mlx-lm's cache + its quantized attention",
    "attention.eager": "deferred-V attention vs the eager oracle (values decoded first), same "
    "implementation",
}

#: Attention outputs, reference (NumPy, float32 accumulation, one rounding to the
#: dtype) vs optimized (``mx.fast.scaled_dot_product_attention``). Outputs are
#: convex combinations of N(0, 1) values (|v| < ~4.5), so the error scales with
#: the dtype's epsilon times max|v|, not with |output|: ``atol`` is 4 eps of the
#: dtype (2 eps for float32 is far below what float32 shows, so 1e-5), ``rtol``
#: 2 eps. The largest error seen in 1,800 calibration examples is about half of
#: the bound (see spec/tolerances.md).
_ATTENTION = {
    "float32": Tolerance(atol=1e-5, rtol=1e-5),
    "float16": Tolerance(atol=2.0**-8, rtol=2.0**-9),
    "bfloat16": Tolerance(atol=2.0**-5, rtol=2.0**-6),
}

#: A row's attention vs its serial cache's, same implementation: the same kernel
#: over the same keys plus masked columns, which changes only the accumulation
#: order, so outputs differ by at most a rounding flip of the output dtype:
#: ``rtol`` 2 eps, ``atol`` the dtype's smallest normal step near zero.
_SOLO = {
    "float32": Tolerance(atol=1e-5, rtol=1e-5),
    "float16": Tolerance(atol=2.0**-14, rtol=2.0**-9),
    "bfloat16": Tolerance(atol=2.0**-12, rtol=2.0**-6),
}

TOLERANCES: dict[tuple[str, str, str], Tolerance] = {}
for _dtype in DTYPES:
    TOLERANCES[("plain", "kv.stored", _dtype)] = EXACT
    TOLERANCES[("plain", "kv.fetched", _dtype)] = EXACT
    TOLERANCES[("plain", "kv.solo", _dtype)] = EXACT
    TOLERANCES[("plain", "kv.mlx_lm", _dtype)] = EXACT
    TOLERANCES[("plain", "attention", _dtype)] = _ATTENTION[_dtype]
    TOLERANCES[("plain", "attention.solo", _dtype)] = _SOLO[_dtype]
    # Same kernel (mx.fast.scaled_dot_product_attention), same keys at every visible
    # column, same mask: bit-identical in every calibration example.
    TOLERANCES[("plain", "attention.mlx_lm", _dtype)] = EXACT

#: Affine family (``QuantizedKVCache`` and its layouts). Codes, scales and biases are
#: bit-exact everywhere (both implementations run ``mx.quantize``'s CPU arithmetic, and row
#: operations never re-quantize). Attention: the reference dequantizes exactly as
#: ``mx.dequantize`` (each key/value rounded to the dtype twice) and attends in float32;
#: the optimized runs ``mx.quantized_matmul`` over the packed planes, on the CPU in float32
#: (half-precision queries are widened, the output rounded once), so it never rounds the
#: dequantized keys/values: each key/value differs by up to one dtype step, which moves
#: the scores (so the weights) and the weighted sum, and the output is rounded once more:
#: ``atol`` 16 eps (float16 ``2^-6``, bfloat16 ``2^-3``; at most ~0.3 of it was seen),
#: ``rtol`` 4 eps (``2^-8``, ``2^-5``). mlx-lm's quantized attention runs ``quantized_matmul``
#: in the activation dtype (scores, softmax weights and partial sums rounded to it): in
#: float32 it is bit-identical to the optimized path; in half precision it carries the
#: dtype's accumulation error (calibrated). See spec/tolerances.md §2.
_AFFINE_ATTENTION = {
    "float32": Tolerance(atol=1e-5, rtol=1e-5),
    "float16": Tolerance(atol=2.0**-6, rtol=2.0**-8),
    "bfloat16": Tolerance(atol=2.0**-3, rtol=2.0**-5),
}
_AFFINE_MLX_LM = {
    "float32": EXACT,
    "float16": Tolerance(atol=2.0**-5, rtol=2.0**-6),
    "bfloat16": Tolerance(atol=2.0**-2, rtol=2.0**-3),
}
for _dtype in DTYPES:
    TOLERANCES[("affine", "kv.stored", _dtype)] = EXACT
    TOLERANCES[("affine", "kv.fetched", _dtype)] = EXACT
    TOLERANCES[("affine", "kv.solo", _dtype)] = EXACT
    TOLERANCES[("affine", "kv.mlx_lm", _dtype)] = EXACT
    TOLERANCES[("affine", "attention", _dtype)] = _AFFINE_ATTENTION[_dtype]
    TOLERANCES[("affine", "attention.solo", _dtype)] = _SOLO[_dtype]
    TOLERANCES[("affine", "attention.mlx_lm", _dtype)] = _AFFINE_MLX_LM[_dtype]
    # The host path attends over the decoded values as the reference does: against
    # mlx-lm's quantized_matmul it differs as the reference does (float32: the attention
    # bound; half precision: mlx-lm's own accumulation error, calibrated above).
    TOLERANCES[("affine", "attention.mlx_lm.host", _dtype)] = (
        _AFFINE_ATTENTION[_dtype] if _dtype == "float32" else _AFFINE_MLX_LM[_dtype]
    )

#: Rotating family (``conformance.rules.RingRules``): "rotating" keys the plain rings
#: (RotatingKVCache, BatchedRotatingCache, RaggedRotatingRows), "rotating-affine" the
#: affine rings (RotatingQuantizedKVCache, BatchedRotatingQuantCache, RotatingAffineLayout).
#: Stored, fetched, extracted and mlx-lm K/V (affine: codes, scales, biases) are exact: a
#: ring only moves planes. Attention uses the plain and affine families' numbers: a row
#: of a ring layout holds its serial ring's keys at another ring phase (another column
#: order), and both attention kernels accumulate in float32 on the CPU, so a row and its
#: serial ring differ by at most a rounding flip of the output (spec/tolerances.md §2).
_RING_AFFINE_ATTENTION = {
    "float32": Tolerance(atol=1e-5, rtol=1e-5),
    "float16": Tolerance(atol=2.0**-6, rtol=2.0**-8),
    "bfloat16": Tolerance(atol=2.0**-3, rtol=2.0**-5),
}
#: A ring row's attention vs its serial ring's: the same keys in another column order (the
#: ring phase), which the CPU kernel's float16 / bfloat16 intermediates turn into more than a
#: rounding flip of a small output: a deep run measured 2^-12 (a quarter eps) at an output
#: below 0.1 in float16 (seed in spec/tolerances.md). ``atol`` half an eps of the dtype;
#: ``rtol`` 2 eps as the plain solo's.
_RING_SOLO = {
    "float32": Tolerance(atol=1e-5, rtol=1e-5),
    "float16": Tolerance(atol=2.0**-11, rtol=2.0**-9),
    "bfloat16": Tolerance(atol=2.0**-8, rtol=2.0**-6),
}
for _dtype in DTYPES:
    for _key in ("rotating", "rotating-affine"):
        TOLERANCES[(_key, "kv.stored", _dtype)] = EXACT
        TOLERANCES[(_key, "kv.fetched", _dtype)] = EXACT
        TOLERANCES[(_key, "kv.solo", _dtype)] = EXACT
    TOLERANCES[("rotating", "kv.mlx_lm", _dtype)] = EXACT
    TOLERANCES[("rotating", "attention", _dtype)] = _ATTENTION[_dtype]
    TOLERANCES[("rotating", "attention.solo", _dtype)] = _RING_SOLO[_dtype]
    TOLERANCES[("rotating", "attention.mlx_lm", _dtype)] = EXACT
    TOLERANCES[("rotating-affine", "attention", _dtype)] = _RING_AFFINE_ATTENTION[_dtype]
    TOLERANCES[("rotating-affine", "attention.solo", _dtype)] = _RING_SOLO[_dtype]

#: TurboQuant family (``TurboQuantKVCache``, ``BatchedTurboQuantKVCache``). Codes and scales
#: (the planes, which a read hands out) and both codecs' decoding of them (keys, rotated
#: values) are exact: both run the same float32 steps (spec/turbo-codec.md). attention
#: (reference vs optimized, both deferred, both over float32 decodes: the optimized one
#: scores on the codes): the plain attention error in the rotated basis, carried through the float32
#: un-rotation (orthonormal: it moves the error, does not grow it) and one more rounding to
#: the dtype: twice plain's bounds. attention.solo: a rounding flip before the un-rotation
#: spreads over the head dim and the output is rounded again: ``atol`` 2^-10 / 2^-7 (half
#: types), ``rtol`` 2 eps. attention.eager (deferred vs eager, same implementation): the
#: eager path rounds K and V to bfloat16 (the decoded values, up to half a bfloat16 ulp of
#: |v| < 8, so 2^-5 absolute; the deferred path rounded its rotated values too before
#: issue 28, and rounds nothing now), so ``atol`` 2^-5 and ``rtol`` 2^-7 whatever the output dtype (bfloat16
#: outputs: 2^-4 / 2^-5, one more bfloat16 rounding each side). Measured over five seeds
#: (spec/tolerances.md §2): every largest error/bound ratio below 0.45; recalibrated over
#: six more turbo seeds and five delayed-turbo seeds (which use these rows too): the eager
#: ratios stay at or below 0.31.
_TURBO_ATTENTION = {
    "float32": Tolerance(atol=1e-5, rtol=1e-5),
    "float16": Tolerance(atol=2.0**-7, rtol=2.0**-8),
    "bfloat16": Tolerance(atol=2.0**-4, rtol=2.0**-5),
}
_TURBO_SOLO = {
    "float32": Tolerance(atol=1e-5, rtol=1e-5),
    "float16": Tolerance(atol=2.0**-10, rtol=2.0**-9),
    "bfloat16": Tolerance(atol=2.0**-7, rtol=2.0**-6),
}
_TURBO_EAGER = {
    "float32": Tolerance(atol=2.0**-5, rtol=2.0**-7),
    "float16": Tolerance(atol=2.0**-5, rtol=2.0**-7),
    "bfloat16": Tolerance(atol=2.0**-4, rtol=2.0**-5),
}
for _dtype in DTYPES:
    TOLERANCES[("turbo", "kv.stored", _dtype)] = EXACT
    TOLERANCES[("turbo", "kv.fetched", _dtype)] = EXACT
    TOLERANCES[("turbo", "kv.solo", _dtype)] = EXACT
    TOLERANCES[("turbo", "attention", _dtype)] = _TURBO_ATTENTION[_dtype]
    TOLERANCES[("turbo", "attention.solo", _dtype)] = _TURBO_SOLO[_dtype]
    TOLERANCES[("turbo", "attention.eager", _dtype)] = _TURBO_EAGER[_dtype]

#: Recurrent state (``conformance.recurrent``): the conv plane is copied inputs (exact);
#: the recurrent plane and the layer's output are float32 whatever the activation dtype
#: (one row per dtype all the same), reference (NumPy, step by step) vs optimized (MLX):
#: the same float32 arithmetic in another reduction order. Largest seen in 80 examples:
#: 4.8e-7 (state), 1.8e-7 (output).
_RECURRENT = Tolerance(atol=1e-5, rtol=1e-5)
for _dtype in DTYPES:
    TOLERANCES[("recurrent", "state.conv", _dtype)] = EXACT
    TOLERANCES[("recurrent", "state.solo", _dtype)] = EXACT
    TOLERANCES[("recurrent", "state.mlx_lm", _dtype)] = EXACT
    TOLERANCES[("recurrent", "state.recurrent", _dtype)] = _RECURRENT
    TOLERANCES[("recurrent", "output", _dtype)] = _RECURRENT
    TOLERANCES[("recurrent", "output.solo", _dtype)] = EXACT

#: Compared with ``==`` only, in every family.
ALWAYS_EXACT = (
    "batch_size",
    "row_offsets",
    "left_pad",
    "width",
    "offset (per-row positions)",
    "masks (expanded to booleans)",
    "signature",
    "geometry",
    "projected_bytes",
    "trim return values",
    "error types",
)


def tolerance(family: str, quantity: str, dtype: str) -> Tolerance:
    """The tolerance for ``quantity`` of ``family`` at ``dtype`` (``KeyError`` if none chosen)."""
    try:
        return TOLERANCES[(family, quantity, dtype)]
    except KeyError:
        raise KeyError(
            f"no tolerance chosen for family={family!r} quantity={quantity!r} dtype={dtype!r}; "
            "add a row to kvrows.conformance.tolerances.TOLERANCES and spec/tolerances.md"
        ) from None


def compare(
    actual: npt.NDArray[Any], expected: npt.NDArray[Any], tol: Tolerance
) -> tuple[bool, float]:
    """Whether ``actual`` matches ``expected`` under ``tol``, and the largest absolute error.

    Exact comparisons are on bytes (shape and dtype included); the error reported
    for them is the largest absolute difference (0 when identical).
    """
    if actual.shape != expected.shape:
        return False, float("inf")
    if tol.exact and actual.dtype == expected.dtype and actual.tobytes() == expected.tobytes():
        return True, 0.0  # what the exact branch below answers, without the float64 diff
    wide_a = actual.astype(np.float64)
    wide_e = expected.astype(np.float64)
    diff = np.abs(wide_a - wide_e)
    finite = diff[np.isfinite(diff)]
    error = float(finite.max()) if finite.size else 0.0
    if tol.exact:
        same = actual.dtype == expected.dtype and actual.tobytes() == expected.tobytes()
        return same, 0.0 if same else error
    both_nan = np.isnan(wide_a) & np.isnan(wide_e)
    ok = bool(np.all((diff <= tol.atol + tol.rtol * np.abs(wide_e)) | both_nan))
    return ok, error
