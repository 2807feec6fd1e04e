"""The kvrows error hierarchy.

Every public operation validates its input before it changes anything, and
raises one of these with a message that says what was wrong and what was
expected. A call that raises leaves every cache it touched unchanged.
"""

from __future__ import annotations

__all__ = [
    "ADOPT_NEEDS_EMPTY",
    "AFFINE_SCALAR_INPUT",
    "EMPTY_CACHE_NO_BLOCK",
    "EMPTY_LAYOUT_UPDATE",
    "EMPTY_ROW_NO_BLOCK",
    "LATENT_HAS_NO_ATTENTION",
    "MERGE_NEEDS_SEQUENCE",
    "MLX_MASK_NOT_BOOLEAN",
    "NOTHING_TO_FETCH",
    "NOTHING_TO_RECORD",
    "ONE_VERIFY_BLOCK",
    "PACKED_SCALAR_INPUT",
    "PAGED_ONE_STAGE",
    "POOL_GEOMETRY_UNKNOWN",
    "PROJECTED_BYTES_NEEDS_GEOMETRY",
    "SHARED_COLUMN_TRIM",
    "SPECULATIVE_INVALID",
    "STAGES_MOVE_TOGETHER",
    "STATE_NOT_ATTENDED",
    "CapacityError",
    "CorruptStateError",
    "DrainingError",
    "IncompatibleRowsError",
    "InvalidInputError",
    "KvRowsError",
    "LayoutStateError",
    "MixedPrecisionReadError",
    "NoRowLayoutError",
    "NotBatchableError",
    "NotTrimmableError",
    "PoolExhaustedError",
    "QueueFullError",
    "RankDivergenceError",
    "RankLostError",
    "RowIndexError",
    "SpeculativeRoundError",
    "SpeculativeStateInvalidError",
    "StateReadError",
    "StateWriteError",
    "UnsupportedStateError",
    "affine_input_dtype_message",
    "align_rows_message",
    "attend_storage_message",
    "empty_row_needs_geometry_message",
    "empty_state_row_message",
    "from_state_tuple_message",
    "given_twice_message",
    "head_dim_message",
    "head_grouping_message",
    "incompatible_merge_message",
    "last_stage_message",
    "latent_planes_message",
    "latent_role_message",
    "mask_message",
    "needs_parameters_message",
    "never_fits_message",
    "no_affine_parameter_message",
    "no_array_codec_message",
    "not_a_geometry_message",
    "not_an_integer_message",
    "packed_codes_dtype_message",
    "packed_shapes_message",
    "packed_width_message",
    "paged_empty_write_message",
    "paged_merge_message",
    "paged_read_only_message",
    "plain_latent_state_message",
    "plane_layer_input_message",
    "pool_geometry_message",
    "pool_limit_message",
    "positional_arguments_message",
    "prefix_mismatch_message",
    "prefix_too_long_message",
    "preview_blocks_message",
    "qkv_shape_message",
    "queue_full_message",
    "queue_timeout_message",
    "request_rows_message",
    "ring_rollback_message",
    "ring_state_index_message",
    "scales_biases_dtype_message",
    "self_merge_message",
    "speculative_modifier_message",
    "state_signature_message",
    "trim_past_row_message",
    "turbo_bits_message",
    "turbo_input_dtype_message",
    "turbo_scalar_input_message",
    "wrapped_ring_message",
    "wrong_geometry_message",
]


class KvRowsError(Exception):
    """Base of every error kvrows raises on purpose."""


class InvalidInputError(KvRowsError, ValueError):
    """An argument has the wrong type, rank, shape, dtype or value."""


class IncompatibleRowsError(KvRowsError):
    """Rows of different geometry, dtype, codec or family cannot share a layout."""


class RowIndexError(KvRowsError, IndexError):
    """A row index (or a keep list) names a row the layout does not hold."""


class CapacityError(KvRowsError):
    """An append or join needs more positions than the storage may hold."""


class QueueFullError(CapacityError):
    """An engine's waiting queue is full (``max_waiting`` requests wait): the request was
    not taken. ``retry_after``: the seconds a client should wait before it tries again."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DrainingError(KvRowsError):
    """An engine that is draining (``close_admissions``) takes no new request."""


class NotTrimmableError(KvRowsError):
    """A trim asks for more than the cache can give back."""


class MixedPrecisionReadError(KvRowsError):
    """A read would mix rows held at different precisions."""


class CorruptStateError(KvRowsError):
    """Restored or adopted state violates the storage's invariants."""


class UnsupportedStateError(KvRowsError):
    """Saved state this version cannot read: an unknown class or signature, or a newer format."""


class StateWriteError(KvRowsError, OSError):
    """Saving state to a file failed (no space, no permission, an I/O error); ``errno``
    is the OS's. The target file is unchanged and no temporary file is left."""


class StateReadError(KvRowsError, OSError):
    """A saved-state file could not be opened or read (missing, no permission, an I/O
    error); ``errno`` is the OS's. A file that opens but is damaged is a
    ``CorruptStateError``."""


class LayoutStateError(KvRowsError):
    """The operation is not valid in the layout's current state."""


class SpeculativeRoundError(LayoutStateError):
    """The speculative round protocol was used out of order: a second ``spec_round_begin``,
    a commit or rollback without a round or without its verify block, a second block, or
    a row operation (merge, filter, extract, trim) in the middle of a round. Nothing
    changed."""


class SpeculativeStateInvalidError(KvRowsError):
    """An append or a rollback failed inside a speculative round: the layout's state is
    undefined and every later call refuses (discard the layout)."""


class NoRowLayoutError(KvRowsError):
    """The row-layout table has no layout of the asked role for this storage."""


class NotBatchableError(KvRowsError):
    """A row operation was asked of serial (non-batchable) state."""


# Messages both implementations raise word for word (conformance compares them).

#: ``fetch()`` before any token is stored, on a serial cache or a layout.
NOTHING_TO_FETCH = "the cache holds no tokens yet: nothing to fetch"

#: ``attend`` of the latent codec: MLA attention is the model's (over the dense read).
LATENT_HAS_NO_ATTENTION = (
    "the latent codec has no attention of its own: MLA attention is the model's, over the "
    "dense latent and rope a read returns"
)

#: ``update_and_fetch`` on a layout that holds no rows.
STATE_NOT_ATTENDED = (
    "recurrent state has no keys and values to attend over: the layer reads its planes"
)
EMPTY_LAYOUT_UPDATE = "an empty layout takes no update: merge rows into it first"


#: Every call on a layout whose speculative round failed half-way.
SPECULATIVE_INVALID = "speculative state is invalid and must be discarded"


def plane_layer_input_message(largest: int, shape: tuple[int, ...]) -> str:
    """The test layer that writes recurrent planes of any shape, given too narrow an input."""
    return f"x must be [B, S, C] with C >= {largest} (the largest plane), got {shape}"


def no_array_codec_message(implementation: str, kind: str) -> str:
    """``make_codec`` of a registered codec kind the implementation has no array codec for."""
    return f"the {implementation} has no {kind} codec yet"


def self_merge_message(layout: str) -> str:
    """``merge_rows`` given the layout itself, or a cache it already holds."""
    return (
        f"{layout} cannot merge itself or a source given twice: "
        "merge_rows takes caches the layout does not already hold"
    )


def incompatible_merge_message(
    layout: str, source: object, codec_key: str, token_geometry: object
) -> str:
    """``merge_rows`` given a source whose rows cannot join the layout."""
    signature = getattr(source, "signature", None)
    described = signature() if callable(signature) else type(source).__name__
    source_geometry = getattr(source, "token_geometry", None)
    if source_geometry is not None:
        described = f"{described} ({source_geometry})"
    return (
        f"{layout} cannot merge {described}: rows join a layout of the same codec "
        f"({codec_key}) and token geometry ({token_geometry})"
    )


def wrapped_ring_message(what: str, window: int) -> str:
    """A trim or rollback of ring tokens that the window has already overwritten."""
    return (
        f"{what} has wrapped past its window of {window}: "
        "the overwritten tokens are gone and cannot be trimmed"
    )


def trim_past_row_message(count: int, row: int, holds: int) -> str:
    """A trim or rollback of more tokens than a row holds."""
    return f"cannot trim {count} tokens from row {row}, which holds {holds}"


def ring_rollback_message(row: int, offset: int, retained: int, count: int, window: int) -> str:
    """A per-row trim of a ragged ring that would leave the row short of its window."""
    return (
        f"cannot trim {count} tokens from row {row} at offset {offset}: it retains its "
        f"newest {retained}, and its window of {window} before them is already overwritten "
        "(a ring rolls back only tokens of its latest block)"
    )


class PoolExhaustedError(CapacityError):
    """A block pool cannot take the blocks an append asks for without growing past its
    byte limit (``kvrows.paged``); nothing changed."""


class RankDivergenceError(KvRowsError):
    """Ranks of a tensor-parallel group that should apply the same row operations hold
    different rows or offsets (``kvrows.app.distributed.check_in_step``)."""


class RankLostError(KvRowsError):
    """A rank of a group no longer takes part in its collectives (it died or its
    connection is gone): a collective came back without its presence mark."""


# Messages raised in more than one file, each written once here so that the copies cannot
# drift (tests/test_error_messages.py refuses a literal message repeated across files).

# -- row machinery -------------------------------------------------------------------------

#: ``merge_rows`` given something that is not a sequence of caches.
MERGE_NEEDS_SEQUENCE = "merge_rows takes a sequence of caches"

#: A serial storage asked to adopt a row while it already holds one (extraction).
ADOPT_NEEDS_EMPTY = "adopt needs an empty cache"

#: A trim of some, not all, of the rows that write into one shared column.
SHARED_COLUMN_TRIM = "rows sharing one write column must trim together"

#: Converting some, not all, rows of a serial storage (its rows move together), or of a
#: layout whose geometry has no per-row stage stores yet (the optimized rings).
STAGES_MOVE_TOGETHER = "the rows of this storage convert together: convert every row or none"


def last_stage_message(row: int, stage: int) -> str:
    """A row asked to convert out of its storage's last stage."""
    return f"row {row} is in stage {stage}, the last: it has no next stage to convert into"


#: Stages asked of a paged storage: its pool's blocks are of one codec (a paged delayed
#: preset keeps its plain stage beside the pool, contract §0.5; not built yet).
PAGED_ONE_STAGE = "a paged storage holds one stage: its pool's blocks are of one codec"

#: ``projected_bytes`` of a cache that has neither a declared geometry nor a token.
PROJECTED_BYTES_NEEDS_GEOMETRY = (
    "projected_bytes needs the KV geometry: declare it at construction "
    "(geometry=KvGeometry(...)) or append a token first"
)

#: ``register_prefix`` of a paged row that holds no block yet.
EMPTY_ROW_NO_BLOCK = "an empty row has no block to register"

# -- paged placement (both implementations' pools and paged storages) ----------------------

#: ``register_prefix`` of a paged cache that holds no row yet.
EMPTY_CACHE_NO_BLOCK = "an empty cache has no block to register"

#: A pool's per-token bytes asked before it knows its KV geometry.
POOL_GEOMETRY_UNKNOWN = "the pool's KV geometry is unknown until its first write"


def pool_geometry_message(held: str, got: str) -> str:
    """A pool that holds one KV geometry given another."""
    return f"the pool holds {held}, got {got}"


def pool_limit_message(max_bytes: int, limit: int, initial: int) -> str:
    """A pool whose byte limit holds fewer blocks than it is to start with."""
    return f"max_bytes {max_bytes} holds {limit} blocks, fewer than num_blocks {initial}"


def prefix_too_long_message(count: int, offset: int) -> str:
    """``register_prefix`` given more token ids than the row holds positions."""
    return f"{count} token ids name more positions than the cache holds ({offset})"


def prefix_mismatch_message(block: int) -> str:
    """``register_prefix`` given ids other than the ones a block already caches."""
    return f"block {block} of the table caches other token ids than token_ids gives"


def no_affine_parameter_message(owner: str, spec: object, name: str) -> str:
    """``bits`` / ``group_size`` of a paged cache whose codec is not affine."""
    return f"{owner} over {spec!r} has no {name}"


def paged_empty_write_message(owner: str, name: str) -> str:
    """``keys`` / ``values`` written to an empty paged cache."""
    return f"{owner} holds no tokens: write {name} through update_and_fetch"


def paged_read_only_message(owner: str, name: str) -> str:
    """``keys`` / ``values`` written to a paged cache that holds tokens."""
    return (
        f"{owner}.{name} is read-only: its blocks live in a shared pool, "
        "written through update_and_fetch only"
    )


def request_rows_message(rows: int) -> str:
    """A request's block table asked of a paged cache that holds several rows."""
    return f"the cache holds {rows} rows; a request's table is one row's"


def paged_merge_message(signature: str, block_size: int, codec: str, source: str) -> str:
    """A paged layout given rows of another codec, block size or storage."""
    return (
        f"{signature} (block size {block_size}, codec {codec}) cannot take rows of "
        f"{source}: a paged layout joins paged caches of its codec and block size only"
    )


#: A second verify block appended in one speculative round.
#: ``spec_round_record`` on a verify layout that forgets rejected tokens itself.
NOTHING_TO_RECORD = (
    "this layout forgets rejected tokens itself: a round records no inputs to replay"
)
ONE_VERIFY_BLOCK = "a speculative round takes one verify block: commit or roll back before the next"
NO_PROPOSALS = (
    "this layout cannot hold a proposal round: its rows would drop columns a discard needs "
    "(propose on a copy)"
)
PROPOSAL_ROUND_ENDS = "a proposal round ends with spec_round_discard(), not a commit or a rollback"


def speculative_modifier_message(name: str) -> str:
    """A class whose composition entry's speculative modifier disagrees with its being a
    ``SpeculativeLayout``."""
    return f"{name}: the speculative modifier is SpeculativeLayout"


def align_rows_message(name: str) -> str:
    """The align-rows mixin declared on a class that is not a ragged growing layout."""
    return f"{name}: align_rows is for ragged growing layouts only"


# -- arguments -----------------------------------------------------------------------------


def not_an_integer_message(what: str, value: object) -> str:
    """A count, size or state field that is not an integer (``bool`` included)."""
    return f"{what} must be an integer, got {value!r}"


def not_a_geometry_message(got: str) -> str:
    """A ``geometry=`` argument that is not a ``KvGeometry``; ``got`` describes it."""
    return f"geometry must be a KvGeometry, got {got}"


# -- persisted state -----------------------------------------------------------------------


def empty_row_needs_geometry_message(offset: int) -> str:
    """A chunked state row that forgot every token it held, loaded without ``geometry=``."""
    return f"state row at position {offset} holds no token: pass geometry= to load it"


def empty_state_row_message(offset: int) -> str:
    """A state row with a non-zero offset but no keys or values."""
    return f"state row at position {offset} holds no token"


def ring_state_index_message(idx: int, held: int) -> str:
    """A ring's state whose write index lies outside the tokens it holds."""
    return f"ring state: idx {idx} outside [0, {held}]"


def state_signature_message(owner: str, restored: str, signature: str) -> str:
    """A latent cache's ``state`` set from the state of a differently declared cache."""
    return f"{owner}: the state is a {restored} cache, this is {signature}"


def from_state_tuple_message(name: str) -> str:
    """A latent cache's ``from_state`` given something that is not a state tuple."""
    return f"{name}.from_state takes the state tuple"


def latent_role_message(name: str) -> str:
    """A latent state whose role field is neither target nor MTP."""
    return f"{name}: role must be 0 (target) or 1 (mtp)"


def latent_planes_message(owner: str, planes: int, got: int) -> str:
    """A latent restore given a number of planes other than its codec's."""
    return f"{owner}: the latent has {planes} planes, got {got}"


def plain_latent_state_message(owner: str) -> str:
    """A converting latent cache given the state of a plain (unconverted) latent."""
    return f"{owner}: the state holds a plain latent"


# -- attention -----------------------------------------------------------------------------


def mask_message(mask: object) -> str:
    """An attention mask that is not None, ``"causal"`` or a boolean array."""
    return f"mask must be None, 'causal' or a boolean array, got {mask!r}"


#: An attention mask array that is not an MLX boolean array (the optimized codecs).
MLX_MASK_NOT_BOOLEAN = "a mask array must be a boolean mlx array"


def head_grouping_message(q_heads: int, kv_heads: int) -> str:
    """Query heads that are not a multiple of the KV heads."""
    return f"{q_heads} query heads do not group over {kv_heads} KV heads"


def attend_storage_message(cache: object) -> str:
    """``attend`` given something that is not a kvrows storage."""
    return f"attend needs a kvrows storage, got {type(cache).__name__}"


def preview_blocks_message(owner: str) -> str:
    """A latent ``preview`` given blocks that are not ``[B, 1, N, W]``."""
    return f"{owner}.preview takes [B, 1, N, W] blocks"


def qkv_shape_message(channels: int, shape: object) -> str:
    """A recurrent conv step given ``qkv`` that is not ``[B, S, channels]``."""
    return f"qkv must be [B, S, {channels}], got {shape}"


# -- codecs --------------------------------------------------------------------------------


def head_dim_message(name: str, dim: int, error: object) -> str:
    """A codec that cannot encode the key or value head dim (``error`` says why)."""
    return f"{name} head dim {dim}: {error}"


def affine_input_dtype_message(name: str, dtype: object) -> str:
    """Affine ``quantize`` input, or scales, that are not float32, float16 or bfloat16."""
    return f"{name} must be float32, float16 or bfloat16, got dtype {dtype}"


#: Affine ``quantize`` given a scalar.
AFFINE_SCALAR_INPUT = "x must have at least one axis (the head dim), got a scalar"

#: Affine ``dequantize`` given scalar packed codes or scales.
PACKED_SCALAR_INPUT = "packed codes and scales need at least one axis"


def packed_codes_dtype_message(dtype: object) -> str:
    """Affine ``dequantize`` given packed codes that are not uint32."""
    return f"packed codes must be uint32, got dtype {dtype}"


def scales_biases_dtype_message(scales: object, biases: object) -> str:
    """Affine ``dequantize`` given scales and biases of different dtypes."""
    return f"scales and biases must share a dtype, got {scales} and {biases}"


def packed_shapes_message(packed: object, scales: object, biases: object) -> str:
    """Affine ``dequantize`` given packed codes, scales and biases whose shapes disagree."""
    return f"shapes of packed {packed}, scales {scales} and biases {biases} do not match"


def packed_width_message(width: int, groups: int, group_size: int, bits: int, words: int) -> str:
    """Affine ``dequantize`` given packed codes of the wrong width for the scales."""
    return (
        f"packed width {width} does not match {groups} groups of "
        f"{group_size} at {bits} bits (expected {words} words)"
    )


def turbo_bits_message(field: str, allowed: object, bits: object) -> str:
    """A TurboQuant ``k_bits`` or ``v_bits`` (``field``) outside the ``allowed`` widths."""
    return f"{field} must be one of {allowed}, got {bits!r}"


def turbo_input_dtype_message(name: str, dtype: object) -> str:
    """TurboQuant encode input that is not float32, float16 or bfloat16."""
    return f"{name} must be float32, float16 or bfloat16, got {dtype}"


def turbo_scalar_input_message(name: str) -> str:
    """TurboQuant encode input that is a scalar."""
    return f"{name} needs a head-dim axis, got a scalar"


def positional_arguments_message(name: str, params: tuple[str, ...], got: int) -> str:
    """A constructor given more positional arguments than its composition's parameters."""
    return (
        f"{name} takes at most {len(params)} positional arguments "
        f"({', '.join(params) or 'none'}), got {got}"
    )


def given_twice_message(name: str, parameters: str, *, spec: bool = False) -> str:
    """A constructor parameter given twice (positionally and by keyword, or as an argument
    and inside a spec: ``spec``)."""
    return f"{name} got {parameters} twice" + (" (argument and spec)" if spec else "")


def wrong_geometry_message(name: str, kind: str, spec: object) -> str:
    """A token geometry spec of another kind than the composition's."""
    return f"{name} has {kind} geometry, got {spec!r}"


def needs_parameters_message(name: str, parameters: str) -> str:
    """A constructor missing a parameter its composition has no default for."""
    return f"{name} needs {parameters}"


def queue_full_message(rid: str, waiting: int) -> str:
    """An engine's ``submit`` while ``max_waiting`` requests wait."""
    return f"request {rid}: the engine's queue is full ({waiting} requests wait); retry later"


def queue_timeout_message(rid: str, waited: float, timeout: float) -> str:
    """A request that waited for admission longer than the engine's ``queue_timeout``."""
    return (
        f"request {rid} waited {waited:.3f} s for admission, longer than the queue timeout "
        f"of {timeout:g} s (the engine's rows and KV budget were full)"
    )


def never_fits_message(rid: str, need: int, prompt: int, max_tokens: int, budget: int) -> str:
    """A request whose KV bytes alone exceed an engine's whole budget."""
    return (
        f"request {rid} needs {need} KV bytes ({prompt} + {max_tokens} tokens), more than "
        f"the whole budget of {budget}"
    )
