"""Storage schemes as data: the codec axis and the token-geometry axis, as frozen specs.

The codec specs live one per module in ``kvrows.codecs``, the geometry specs one per
module in ``kvrows.geometries`` (both re-exported here, so every ``from kvrows.schemes
import Affine, Ring`` keeps working).

A *codec spec* says how one token's vector is stored (``Plain()``, ``Affine(bits=…,
group_size=…)``, ``Turbo(k_bits=…, v_bits=…)``); a *geometry spec* says how the token axis
is organised (``Growing()``, ``Ring(max_size=…)``). Both are frozen, keyword-only and
validated on construction, so a spec that exists is a spec a storage can be built from:
parameters travel as one object from the CLI to the storage and are never pulled apart
and rebuilt on the way.

``KvStorageScheme`` is what an engine asks for per model: a default codec, optional
per-layer overrides, and the bf16-first boundary ``quantized_kv_start`` (the delayed
modifier; filled in by the delayed-quantization issue).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrows.codec import CodecSpec
from kvrows.codecs import TURBO_KEY_BITS, TURBO_VALUE_BITS, Affine, Plain, Turbo, parse_codec
from kvrows.errors import InvalidInputError
from kvrows.geometries import GeometrySpec, Growing, Ring
from kvrows.validation import as_count

__all__ = [
    "TURBO_KEY_BITS",
    "TURBO_VALUE_BITS",
    "Affine",
    "CodecSpec",
    "GeometrySpec",
    "Growing",
    "KvStorageScheme",
    "Plain",
    "Ring",
    "Turbo",
]


@dataclass(frozen=True, kw_only=True)
class KvStorageScheme:
    """How a model's attention layers store their KV.

    ``codec`` is every layer's codec unless ``layers`` names another for a layer index;
    a negative index counts from the last layer (``-1``: the last), resolved against the
    model's layer count (:meth:`resolve`) when its caches are made.
    ``quantized_kv_start`` (``None``: quantize from the first token) is the bf16-first
    boundary of the delayed modifier.
    """

    codec: CodecSpec = field(default_factory=Plain)
    layers: tuple[tuple[int, CodecSpec], ...] = ()
    quantized_kv_start: int | None = None

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for index, _ in self.layers:
            if isinstance(index, bool) or not isinstance(index, int):
                raise InvalidInputError(
                    f"a layer index is an integer (negative: from the last layer), got {index!r}"
                )
            if index in seen:
                raise InvalidInputError(f"layer {index} has two codecs in the scheme")
            seen.add(index)
        if self.quantized_kv_start is not None:
            as_count(self.quantized_kv_start, "quantized_kv_start")

    @classmethod
    def per_layer(
        cls,
        layers: Mapping[int, CodecSpec],
        *,
        default: CodecSpec | None = None,
        quantized_kv_start: int | None = None,
    ) -> KvStorageScheme:
        """The seed's per-layer form: the listed layers' codecs (negative indices count
        from the last layer), every other layer ``default`` (plain)."""
        if not isinstance(layers, Mapping):
            raise InvalidInputError(
                f"per_layer takes a mapping of layer index to codec, got {type(layers).__name__}"
            )
        return cls(
            codec=Plain() if default is None else default,
            layers=tuple(layers.items()),
            quantized_kv_start=quantized_kv_start,
        )

    @classmethod
    def parse(cls, text: str) -> KvStorageScheme:
        """A scheme from its ``name``: a codec (``plain``, ``affine8``, ``affine4:32``,
        ``turbo-k8v3``, also written ``turbo:k8v3``; bare ``turbo`` is k8v3), then optional per-layer codecs (``,0=plain,5=affine8``; a negative
        index counts from the last layer: ``,-1=plain``), then an optional bf16-first start
        (``@512``): ``affine4:32,0=plain,-1=plain@512``."""
        if not isinstance(text, str):
            raise InvalidInputError(f"a KV scheme name is a string, got {type(text).__name__}")
        body, at, start_text = text.partition("@")
        start: int | None = None
        if at:
            if not start_text.isdigit():
                raise InvalidInputError(
                    f"KV scheme {text!r}: the start after @ must be a token count, "
                    f"got {start_text!r}"
                )
            start = int(start_text)
        default, *overrides = body.split(",")
        layers: list[tuple[int, CodecSpec]] = []
        for override in overrides:
            index, equals, codec = override.partition("=")
            if not equals or not index.removeprefix("-").isdigit():
                raise InvalidInputError(
                    f"KV scheme {text!r}: a per-layer codec is <layer>=<codec> with an "
                    f"integer layer index (negative: from the last layer), got {override!r}"
                )
            layers.append((int(index), parse_codec(codec)))
        return cls(codec=parse_codec(default), layers=tuple(layers), quantized_kv_start=start)

    def resolve(self, layer_count: int) -> KvStorageScheme:
        """This scheme for a model of ``layer_count`` layers: negative layer indices counted
        from the last layer. An index outside the model, or two entries naming one layer,
        raise ``InvalidInputError``."""
        count = as_count(layer_count, "layer_count")
        resolved: dict[int, int] = {}
        layers: list[tuple[int, CodecSpec]] = []
        for index, codec in self.layers:
            layer = index + count if index < 0 else index
            if not 0 <= layer < count:
                raise InvalidInputError(
                    f"KV scheme {self.name}: layer {index} is outside a model of {count} "
                    f"layers (expected {-count}..{count - 1})"
                )
            if layer in resolved:
                raise InvalidInputError(
                    f"KV scheme {self.name}: layers {resolved[layer]} and {index} are both "
                    f"layer {layer} of a model of {count} layers"
                )
            resolved[layer] = index
            layers.append((layer, codec))
        return KvStorageScheme(
            codec=self.codec, layers=tuple(layers), quantized_kv_start=self.quantized_kv_start
        )

    def codec_for_layer(self, index: int, layer_count: int | None = None) -> CodecSpec:
        """The codec layer ``index`` stores its KV with (negative entries need the model's
        ``layer_count`` to resolve; without it only non-negative entries are matched)."""
        layers = self.layers if layer_count is None else self.resolve(layer_count).layers
        for layer, codec in layers:
            if layer == index:
                return codec
        return self.codec

    @property
    def name(self) -> str:
        """The scheme's name (the default codec's, plus overrides)."""
        extra = "".join(f",{layer}={codec.name}" for layer, codec in self.layers)
        start = "" if self.quantized_kv_start is None else f"@{self.quantized_kv_start}"
        return f"{self.codec.name}{extra}{start}"
