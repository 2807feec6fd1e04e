"""The latent codec on MLX: MLA's latent through the inner codec, rope and index plain
(``kvrows.codecs.latent.Latent``)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.codecs.latent import LATENT_ROLE, Latent, LatentLayout
from kvrows.errors import LATENT_HAS_NO_ATTENTION, InvalidInputError
from kvrows.optimized.codecs.common import Planes, mlx_dtype
from kvrows.optimized.codecs.registry import build, implements

__all__ = ["LatentArrayCodec"]


@implements("latent")
class LatentArrayCodec(LatentLayout):
    """The composite codec's array work: ``latent`` planes are the inner codec's
    ``values`` planes, ``rope`` and ``index`` one plain plane each. Reads are dense (the
    latent decoded); MLA attention is the model's, so ``attend`` refuses."""

    spec: Latent

    def __init__(self, spec: Latent) -> None:
        self.spec = spec
        self.inner: Any = build(spec.inner)

    def encode(self, block: mx.array, tensor: str = "latent") -> Planes:
        if tensor == "latent":
            planes: Planes = self.inner.encode(block, LATENT_ROLE)
            return planes
        return (block,)

    def decoded(self, planes: Planes, tensor: str, dtype: str) -> mx.array:
        """``tensor``'s tokens as the activations (``dtype``): the latent decoded."""
        if tensor != "latent":
            return planes[0]
        decoded: mx.array = self.decode(planes, tensor)
        wanted = mlx_dtype(dtype)
        return decoded if decoded.dtype == wanted else decoded.astype(wanted)

    def decode(self, planes: Planes, tensor: str = "latent") -> Any:
        """``tensor``'s stored tokens (the latent decoded by the inner codec)."""
        if tensor != "latent":
            return planes[0]
        return self.inner.decode(planes, LATENT_ROLE)

    def fetched(self, planes: Planes, tensor: str = "latent") -> Any:
        return self.decode(planes, tensor)

    def zeros(
        self, rows: int, heads: int, columns: int, dim: int, dtype: str, tensor: str = "latent"
    ) -> Planes:
        """Zero planes of ``columns`` tokens of a ``dim``-wide ``tensor`` (``heads`` 1)."""
        if tensor == "latent":
            planes: Planes = self.inner.zeros(rows, heads, columns, dim, dtype, LATENT_ROLE)
            return planes
        return (mx.zeros((rows, heads, columns, dim), mlx_dtype(dtype)),)

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        raise InvalidInputError(LATENT_HAS_NO_ATTENTION)
