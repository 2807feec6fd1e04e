"""kvrows: the KV-cache state layer of LLM inference on MLX.

``import kvrows`` gives the contract, which imports neither MLX nor an implementation:
the protocols, the row-layout table and its functions, leases, the errors, the storage
schemes and the composition table. The implementations are ``kvrows.reference``
(NumPy, the executable spec) and ``kvrows.optimized`` (MLX); the application (engine,
mlx-lm glue, demo, CLI, benchmarks) is ``kvrows.app``.
"""

# The checkout's top-level ``kvrows/`` folder holds only the core; ``reference/``,
# ``optimized/``, ``conformance/`` and ``app/`` sit beside it and are mapped into this
# package by pyproject.toml. When Python imports this folder straight from the checkout
# (``python -c "import kvrows.optimized"`` in the repository root), the installed copy
# of the package is found through ``extend_path``, so the subpackages still resolve.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

from kvrows.codec import Codec, PlaneSpec
from kvrows.compositions import COMPOSITIONS, Composition, Roles, composition
from kvrows.errors import (
    CapacityError,
    CorruptStateError,
    IncompatibleRowsError,
    InvalidInputError,
    KvRowsError,
    LayoutStateError,
    MixedPrecisionReadError,
    NoRowLayoutError,
    NotBatchableError,
    NotTrimmableError,
    RowIndexError,
    SpeculativeRoundError,
    SpeculativeStateInvalidError,
    StateReadError,
    StateWriteError,
    UnsupportedStateError,
)
from kvrows.leases import StateLease, lease_cache_state, lease_cache_states
from kvrows.protocols import (
    AppendLimited,
    BatchableCache,
    Cache,
    Composed,
    HasCodec,
    Mask,
    ReusableOffset,
    RingGeometry,
    RowTrimmable,
    SelfChecking,
    SpeculativeRowLayout,
    StateDisposer,
)
from kvrows.schemes import (
    Affine,
    CodecSpec,
    GeometrySpec,
    Growing,
    KvStorageScheme,
    Plain,
    Ring,
    Turbo,
)
from kvrows.speculative import RowRound
from kvrows.table import (
    RowAdmission,
    extract_sole_row,
    filter_layout_rows,
    is_batchable,
    owned_cache_layout,
    owned_cache_layout_factory,
    prefill_cache_layout,
    publish_row,
    row_admission,
    target_cache_layout,
    target_row_layout_factory,
)
from kvrows.validation import KvGeometry

__all__ = [
    "COMPOSITIONS",
    "Affine",
    "AppendLimited",
    "BatchableCache",
    "Cache",
    "CapacityError",
    "Codec",
    "CodecSpec",
    "Composed",
    "Composition",
    "CorruptStateError",
    "GeometrySpec",
    "Growing",
    "HasCodec",
    "IncompatibleRowsError",
    "InvalidInputError",
    "KvGeometry",
    "KvRowsError",
    "KvStorageScheme",
    "LayoutStateError",
    "Mask",
    "MixedPrecisionReadError",
    "NoRowLayoutError",
    "NotBatchableError",
    "NotTrimmableError",
    "Plain",
    "PlaneSpec",
    "ReusableOffset",
    "Ring",
    "RingGeometry",
    "Roles",
    "RowAdmission",
    "RowIndexError",
    "RowRound",
    "RowTrimmable",
    "SelfChecking",
    "SpeculativeRoundError",
    "SpeculativeRowLayout",
    "SpeculativeStateInvalidError",
    "StateDisposer",
    "StateLease",
    "StateReadError",
    "StateWriteError",
    "Turbo",
    "UnsupportedStateError",
    "composition",
    "extract_sole_row",
    "filter_layout_rows",
    "is_batchable",
    "lease_cache_state",
    "lease_cache_states",
    "owned_cache_layout",
    "owned_cache_layout_factory",
    "prefill_cache_layout",
    "publish_row",
    "row_admission",
    "target_cache_layout",
    "target_row_layout_factory",
]
