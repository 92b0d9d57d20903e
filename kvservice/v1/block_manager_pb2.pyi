from kvservice.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Layout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYOUT_UNSPECIFIED: _ClassVar[Layout]
    PER_LAYER: _ClassVar[Layout]
    INTERLEAVED: _ClassVar[Layout]
LAYOUT_UNSPECIFIED: Layout
PER_LAYER: Layout
INTERLEAVED: Layout

class LayerSpec(_message.Message):
    __slots__ = ("kv_heads", "head_dim", "dtype", "sliding_window", "count", "k_only")
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    K_ONLY_FIELD_NUMBER: _ClassVar[int]
    kv_heads: int
    head_dim: int
    dtype: _common_pb2.DType
    sliding_window: int
    count: int
    k_only: bool
    def __init__(self, kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., sliding_window: _Optional[int] = ..., count: _Optional[int] = ..., k_only: _Optional[bool] = ...) -> None: ...

class CacheSpec(_message.Message):
    __slots__ = ("layers", "page_size", "layout")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    page_size: int
    layout: Layout
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., page_size: _Optional[int] = ..., layout: _Optional[_Union[Layout, str]] = ...) -> None: ...

class Sizing(_message.Message):
    __slots__ = ("max_batch", "max_seq_len", "memory_budget_bytes", "num_slots", "max_num_batched_tokens", "prefix_headroom_slots", "equal_groups", "group_slots")
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HEADROOM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    EQUAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SLOTS_FIELD_NUMBER: _ClassVar[int]
    max_batch: int
    max_seq_len: int
    memory_budget_bytes: int
    num_slots: int
    max_num_batched_tokens: int
    prefix_headroom_slots: int
    equal_groups: bool
    group_slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_batch: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., prefix_headroom_slots: _Optional[int] = ..., equal_groups: _Optional[bool] = ..., group_slots: _Optional[_Iterable[int]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("cache", "sizing", "backends")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SIZING_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    cache: CacheSpec
    sizing: Sizing
    backends: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cache: _Optional[_Union[CacheSpec, _Mapping]] = ..., sizing: _Optional[_Union[Sizing, _Mapping]] = ..., backends: _Optional[_Iterable[str]] = ...) -> None: ...

class LayerPlan(_message.Message):
    __slots__ = ("layer", "group", "index_space", "page_bytes", "bytes", "scale", "offset", "upper_bound", "base")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    INDEX_SPACE_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    UPPER_BOUND_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    group: int
    index_space: int
    page_bytes: int
    bytes: int
    scale: int
    offset: int
    upper_bound: int
    base: int
    def __init__(self, layer: _Optional[int] = ..., group: _Optional[int] = ..., index_space: _Optional[int] = ..., page_bytes: _Optional[int] = ..., bytes: _Optional[int] = ..., scale: _Optional[int] = ..., offset: _Optional[int] = ..., upper_bound: _Optional[int] = ..., base: _Optional[int] = ...) -> None: ...

class GroupPlan(_message.Message):
    __slots__ = ("group", "sliding_window", "layers", "slot_bytes", "buffer_bytes", "num_slots")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    group: int
    sliding_window: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    slot_bytes: int
    buffer_bytes: int
    num_slots: int
    def __init__(self, group: _Optional[int] = ..., sliding_window: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., slot_bytes: _Optional[int] = ..., buffer_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ...) -> None: ...

class IndexSpace(_message.Message):
    __slots__ = ("id", "group", "scale", "offset", "upper_bound", "layers", "index_dtype", "base")
    ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    UPPER_BOUND_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    INDEX_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    id: int
    group: int
    scale: int
    offset: int
    upper_bound: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    index_dtype: _common_pb2.DType
    base: int
    def __init__(self, id: _Optional[int] = ..., group: _Optional[int] = ..., scale: _Optional[int] = ..., offset: _Optional[int] = ..., upper_bound: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., index_dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., base: _Optional[int] = ...) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("num_slots", "page_size", "max_seq_len", "max_pages_per_seq", "bytes_per_layer", "bytes_per_slot", "total_bytes", "max_byte_offset", "offsets_exceed_int32", "offsets_exceed_uint32", "indices_need_int64", "layers", "groups", "index_spaces", "backends", "warnings", "pool_pages", "equal_sizing_bytes", "notes")
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGES_PER_SEQ_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_SLOT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_EXCEED_INT32_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_EXCEED_UINT32_FIELD_NUMBER: _ClassVar[int]
    INDICES_NEED_INT64_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    INDEX_SPACES_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGES_FIELD_NUMBER: _ClassVar[int]
    EQUAL_SIZING_BYTES_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    num_slots: int
    page_size: int
    max_seq_len: int
    max_pages_per_seq: int
    bytes_per_layer: int
    bytes_per_slot: int
    total_bytes: int
    max_byte_offset: int
    offsets_exceed_int32: bool
    offsets_exceed_uint32: bool
    indices_need_int64: bool
    layers: _containers.RepeatedCompositeFieldContainer[LayerPlan]
    groups: _containers.RepeatedCompositeFieldContainer[GroupPlan]
    index_spaces: _containers.RepeatedCompositeFieldContainer[IndexSpace]
    backends: _containers.RepeatedScalarFieldContainer[str]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    pool_pages: int
    equal_sizing_bytes: int
    notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_slots: _Optional[int] = ..., page_size: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., max_pages_per_seq: _Optional[int] = ..., bytes_per_layer: _Optional[int] = ..., bytes_per_slot: _Optional[int] = ..., total_bytes: _Optional[int] = ..., max_byte_offset: _Optional[int] = ..., offsets_exceed_int32: _Optional[bool] = ..., offsets_exceed_uint32: _Optional[bool] = ..., indices_need_int64: _Optional[bool] = ..., layers: _Optional[_Iterable[_Union[LayerPlan, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[GroupPlan, _Mapping]]] = ..., index_spaces: _Optional[_Iterable[_Union[IndexSpace, _Mapping]]] = ..., backends: _Optional[_Iterable[str]] = ..., warnings: _Optional[_Iterable[str]] = ..., pool_pages: _Optional[int] = ..., equal_sizing_bytes: _Optional[int] = ..., notes: _Optional[_Iterable[str]] = ...) -> None: ...

class CreatePoolRequest(_message.Message):
    __slots__ = ("name", "cache", "sizing", "backends", "request_id", "enable_prefix_caching", "incarnation", "model", "prefix_hash", "prefix_hash_seed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SIZING_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    name: str
    cache: CacheSpec
    sizing: Sizing
    backends: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    enable_prefix_caching: bool
    incarnation: int
    model: str
    prefix_hash: str
    prefix_hash_seed: str
    def __init__(self, name: _Optional[str] = ..., cache: _Optional[_Union[CacheSpec, _Mapping]] = ..., sizing: _Optional[_Union[Sizing, _Mapping]] = ..., backends: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., enable_prefix_caching: _Optional[bool] = ..., incarnation: _Optional[int] = ..., model: _Optional[str] = ..., prefix_hash: _Optional[str] = ..., prefix_hash_seed: _Optional[str] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("num_slots", "num_free_slots", "peak_used_slots", "num_sequences", "num_tokens", "steps", "admitted", "refused", "prefix_cache_hits", "prefix_cache_evictions", "cached_slots", "prefix_caching", "event_sequence")
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PEAK_USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    num_slots: int
    num_free_slots: int
    peak_used_slots: int
    num_sequences: int
    num_tokens: int
    steps: int
    admitted: int
    refused: int
    prefix_cache_hits: int
    prefix_cache_evictions: int
    cached_slots: int
    prefix_caching: bool
    event_sequence: int
    def __init__(self, num_slots: _Optional[int] = ..., num_free_slots: _Optional[int] = ..., peak_used_slots: _Optional[int] = ..., num_sequences: _Optional[int] = ..., num_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., admitted: _Optional[int] = ..., refused: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_evictions: _Optional[int] = ..., cached_slots: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., event_sequence: _Optional[int] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("name", "plan", "stats", "cache", "incarnation", "model", "prefix_hash", "prefix_hash_seed", "position")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    name: str
    plan: PlanReply
    stats: PoolStats
    cache: CacheSpec
    incarnation: int
    model: str
    prefix_hash: str
    prefix_hash_seed: str
    position: JournalPosition
    def __init__(self, name: _Optional[str] = ..., plan: _Optional[_Union[PlanReply, _Mapping]] = ..., stats: _Optional[_Union[PoolStats, _Mapping]] = ..., cache: _Optional[_Union[CacheSpec, _Mapping]] = ..., incarnation: _Optional[int] = ..., model: _Optional[str] = ..., prefix_hash: _Optional[str] = ..., prefix_hash_seed: _Optional[str] = ..., position: _Optional[_Union[JournalPosition, _Mapping]] = ...) -> None: ...

class JournalPosition(_message.Message):
    __slots__ = ("incarnation", "seq", "lineage")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    seq: int
    lineage: int
    def __init__(self, incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., lineage: _Optional[int] = ...) -> None: ...

class GetPoolRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoolsReply(_message.Message):
    __slots__ = ("pools", "position")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    position: JournalPosition
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ..., position: _Optional[_Union[JournalPosition, _Mapping]] = ...) -> None: ...

class DeletePoolRequest(_message.Message):
    __slots__ = ("pool", "force", "request_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    force: bool
    request_id: str
    def __init__(self, pool: _Optional[str] = ..., force: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class DeletePoolReply(_message.Message):
    __slots__ = ("position",)
    POSITION_FIELD_NUMBER: _ClassVar[int]
    position: JournalPosition
    def __init__(self, position: _Optional[_Union[JournalPosition, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("pool", "free_seq_ids", "extend_seq_ids", "extend_num_tokens", "admit_seq_ids", "admit_num_tokens", "omit_tables", "include_block_table", "request_id", "fork_parent_ids", "fork_child_ids", "admit_token_ids", "admit_cache_salts", "admit_extra_keys", "stream_seq", "delta_tables", "delta_base", "accept_tokens_added")
    POOL_FIELD_NUMBER: _ClassVar[int]
    FREE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OMIT_TABLES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FORK_PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    FORK_CHILD_IDS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_CACHE_SALTS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    STREAM_SEQ_FIELD_NUMBER: _ClassVar[int]
    DELTA_TABLES_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_TOKENS_ADDED_FIELD_NUMBER: _ClassVar[int]
    pool: str
    free_seq_ids: _common_pb2.Tensor
    extend_seq_ids: _common_pb2.Tensor
    extend_num_tokens: _common_pb2.Tensor
    admit_seq_ids: _common_pb2.Tensor
    admit_num_tokens: _common_pb2.Tensor
    omit_tables: bool
    include_block_table: bool
    request_id: str
    fork_parent_ids: _common_pb2.Tensor
    fork_child_ids: _common_pb2.Tensor
    admit_token_ids: _common_pb2.Tensor
    admit_cache_salts: _containers.RepeatedScalarFieldContainer[str]
    admit_extra_keys: _containers.RepeatedScalarFieldContainer[str]
    stream_seq: int
    delta_tables: bool
    delta_base: int
    accept_tokens_added: bool
    def __init__(self, pool: _Optional[str] = ..., free_seq_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., extend_seq_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., extend_num_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., admit_seq_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., admit_num_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., omit_tables: _Optional[bool] = ..., include_block_table: _Optional[bool] = ..., request_id: _Optional[str] = ..., fork_parent_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., fork_child_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., admit_token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., admit_cache_salts: _Optional[_Iterable[str]] = ..., admit_extra_keys: _Optional[_Iterable[str]] = ..., stream_seq: _Optional[int] = ..., delta_tables: _Optional[bool] = ..., delta_base: _Optional[int] = ..., accept_tokens_added: _Optional[bool] = ...) -> None: ...

class SpaceTables(_message.Message):
    __slots__ = ("index_space", "group", "scale", "offset", "upper_bound", "base", "slot_mapping", "indptr", "indices", "last_page_len", "block_table", "generations", "slot_generations", "delta")
    INDEX_SPACE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    UPPER_BOUND_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    INDPTR_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    LAST_PAGE_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    index_space: int
    group: int
    scale: int
    offset: int
    upper_bound: int
    base: int
    slot_mapping: _common_pb2.Tensor
    indptr: _common_pb2.Tensor
    indices: _common_pb2.Tensor
    last_page_len: _common_pb2.Tensor
    block_table: _common_pb2.Tensor
    generations: _common_pb2.Tensor
    slot_generations: _common_pb2.Tensor
    delta: SpaceDelta
    def __init__(self, index_space: _Optional[int] = ..., group: _Optional[int] = ..., scale: _Optional[int] = ..., offset: _Optional[int] = ..., upper_bound: _Optional[int] = ..., base: _Optional[int] = ..., slot_mapping: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., indptr: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., indices: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., last_page_len: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., block_table: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., generations: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., slot_generations: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., delta: _Optional[_Union[SpaceDelta, _Mapping]] = ...) -> None: ...

class SpaceDelta(_message.Message):
    __slots__ = ("pages", "replaced", "generations", "replaced_generations")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    REPLACED_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    pages: _common_pb2.Tensor
    replaced: _common_pb2.Tensor
    generations: _common_pb2.Tensor
    replaced_generations: _common_pb2.Tensor
    def __init__(self, pages: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., replaced: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., generations: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., replaced_generations: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class TableDelta(_message.Message):
    __slots__ = ("base_seq", "base_rows", "groups", "tokens_added")
    BASE_SEQ_FIELD_NUMBER: _ClassVar[int]
    BASE_ROWS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ADDED_FIELD_NUMBER: _ClassVar[int]
    base_seq: int
    base_rows: _common_pb2.Tensor
    groups: _containers.RepeatedCompositeFieldContainer[GroupDelta]
    tokens_added: int
    def __init__(self, base_seq: _Optional[int] = ..., base_rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., groups: _Optional[_Iterable[_Union[GroupDelta, _Mapping]]] = ..., tokens_added: _Optional[int] = ...) -> None: ...

class GroupDelta(_message.Message):
    __slots__ = ("group", "first_rows", "first_pages", "replaced_rows")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROWS_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGES_FIELD_NUMBER: _ClassVar[int]
    REPLACED_ROWS_FIELD_NUMBER: _ClassVar[int]
    group: int
    first_rows: _common_pb2.Tensor
    first_pages: _common_pb2.Tensor
    replaced_rows: _common_pb2.Tensor
    def __init__(self, group: _Optional[int] = ..., first_rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., first_pages: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., replaced_rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("code", "message", "reason", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("seq_ids", "num_tokens", "new_token_indptr", "tables", "layer_index_space", "num_free_slots", "admit_cached_tokens", "copies", "pool_incarnation", "position", "stream_seq", "error", "delta", "stream_id")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_INDPTR_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    LAYER_INDEX_SPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    POOL_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    STREAM_SEQ_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _common_pb2.Tensor
    num_tokens: _common_pb2.Tensor
    new_token_indptr: _common_pb2.Tensor
    tables: _containers.RepeatedCompositeFieldContainer[SpaceTables]
    layer_index_space: _containers.RepeatedScalarFieldContainer[int]
    num_free_slots: int
    admit_cached_tokens: _common_pb2.Tensor
    copies: _containers.RepeatedCompositeFieldContainer[SlotCopies]
    pool_incarnation: int
    position: JournalPosition
    stream_seq: int
    error: RequestStatus
    delta: TableDelta
    stream_id: str
    def __init__(self, seq_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., new_token_indptr: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tables: _Optional[_Iterable[_Union[SpaceTables, _Mapping]]] = ..., layer_index_space: _Optional[_Iterable[int]] = ..., num_free_slots: _Optional[int] = ..., admit_cached_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., copies: _Optional[_Iterable[_Union[SlotCopies, _Mapping]]] = ..., pool_incarnation: _Optional[int] = ..., position: _Optional[_Union[JournalPosition, _Mapping]] = ..., stream_seq: _Optional[int] = ..., error: _Optional[_Union[RequestStatus, _Mapping]] = ..., delta: _Optional[_Union[TableDelta, _Mapping]] = ..., stream_id: _Optional[str] = ...) -> None: ...

class SlotCopies(_message.Message):
    __slots__ = ("group", "pairs", "generations")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    group: int
    pairs: _common_pb2.Tensor
    generations: _common_pb2.Tensor
    def __init__(self, group: _Optional[int] = ..., pairs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., generations: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ListSequencesRequest(_message.Message):
    __slots__ = ("pool", "limit")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    pool: str
    limit: int
    def __init__(self, pool: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class SequenceInfo(_message.Message):
    __slots__ = ("seq_id", "num_tokens", "num_slots", "num_slots_per_group")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_tokens: int
    num_slots: int
    num_slots_per_group: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_slots: _Optional[int] = ..., num_slots_per_group: _Optional[_Iterable[int]] = ...) -> None: ...

class ListSequencesReply(_message.Message):
    __slots__ = ("sequences", "total", "position")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceInfo]
    total: int
    position: JournalPosition
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceInfo, _Mapping]]] = ..., total: _Optional[int] = ..., position: _Optional[_Union[JournalPosition, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("pools", "position")
    class PoolsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: PoolStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[PoolStats, _Mapping]] = ...) -> None: ...
    POOLS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.MessageMap[str, PoolStats]
    position: JournalPosition
    def __init__(self, pools: _Optional[_Mapping[str, PoolStats]] = ..., position: _Optional[_Union[JournalPosition, _Mapping]] = ...) -> None: ...

class ValidatePageTableRequest(_message.Message):
    __slots__ = ("pool", "layer", "indptr", "indices", "last_page_len", "max_reports")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    INDPTR_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    LAST_PAGE_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_REPORTS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    layer: int
    indptr: _common_pb2.Tensor
    indices: _common_pb2.Tensor
    last_page_len: _common_pb2.Tensor
    max_reports: int
    def __init__(self, pool: _Optional[str] = ..., layer: _Optional[int] = ..., indptr: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., indices: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., last_page_len: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., max_reports: _Optional[int] = ...) -> None: ...

class Violation(_message.Message):
    __slots__ = ("reason", "row", "position", "value", "detail")
    REASON_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reason: str
    row: int
    position: int
    value: int
    detail: str
    def __init__(self, reason: _Optional[str] = ..., row: _Optional[int] = ..., position: _Optional[int] = ..., value: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class ValidatePageTableReply(_message.Message):
    __slots__ = ("ok", "num_violations", "violations", "index_space")
    OK_FIELD_NUMBER: _ClassVar[int]
    NUM_VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    INDEX_SPACE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    num_violations: int
    violations: _containers.RepeatedCompositeFieldContainer[Violation]
    index_space: IndexSpace
    def __init__(self, ok: _Optional[bool] = ..., num_violations: _Optional[int] = ..., violations: _Optional[_Iterable[_Union[Violation, _Mapping]]] = ..., index_space: _Optional[_Union[IndexSpace, _Mapping]] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class EchoReply(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "pool", "layer_begin", "layer_end", "tp_rank", "tp_size", "backend", "device_name", "device_memory_bytes", "address", "incarnation", "registered_by")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pool: str
    layer_begin: int
    layer_end: int
    tp_rank: int
    tp_size: int
    backend: str
    device_name: str
    device_memory_bytes: int
    address: str
    incarnation: int
    registered_by: str
    def __init__(self, worker_id: _Optional[str] = ..., pool: _Optional[str] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., backend: _Optional[str] = ..., device_name: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ..., registered_by: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "pool", "layer_begin", "layer_end", "tp_rank", "tp_size", "backend", "device_name", "device_memory_bytes", "address", "epoch", "alive", "seconds_since_heartbeat", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pool: str
    layer_begin: int
    layer_end: int
    tp_rank: int
    tp_size: int
    backend: str
    device_name: str
    device_memory_bytes: int
    address: str
    epoch: int
    alive: bool
    seconds_since_heartbeat: float
    incarnation: int
    def __init__(self, worker_id: _Optional[str] = ..., pool: _Optional[str] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., backend: _Optional[str] = ..., device_name: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ..., address: _Optional[str] = ..., epoch: _Optional[int] = ..., alive: _Optional[bool] = ..., seconds_since_heartbeat: _Optional[float] = ..., incarnation: _Optional[int] = ...) -> None: ...

class RegisterWorkerReply(_message.Message):
    __slots__ = ("epoch", "lease_seconds", "pool", "position")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_seconds: float
    pool: PoolInfo
    position: JournalPosition
    def __init__(self, epoch: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., pool: _Optional[_Union[PoolInfo, _Mapping]] = ..., position: _Optional[_Union[JournalPosition, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "pool", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    pool: str
    incarnation: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., pool: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("lease_seconds", "position")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    position: JournalPosition
    def __init__(self, lease_seconds: _Optional[float] = ..., position: _Optional[_Union[JournalPosition, _Mapping]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class ListWorkersReply(_message.Message):
    __slots__ = ("workers", "position")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    position: JournalPosition
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., position: _Optional[_Union[JournalPosition, _Mapping]] = ...) -> None: ...

class ScorePrefixRequest(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "extra_key", "pools", "model")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    token_ids: _common_pb2.Tensor
    cache_salt: str
    extra_key: str
    pools: _containers.RepeatedScalarFieldContainer[str]
    model: str
    def __init__(self, token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., cache_salt: _Optional[str] = ..., extra_key: _Optional[str] = ..., pools: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ...) -> None: ...

class PrefixScore(_message.Message):
    __slots__ = ("pool", "cached_tokens", "cached_pages", "page_size", "prefix_caching", "worker_ids", "worker_addresses")
    POOL_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    pool: str
    cached_tokens: int
    cached_pages: int
    page_size: int
    prefix_caching: bool
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    worker_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pool: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., cached_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., worker_ids: _Optional[_Iterable[str]] = ..., worker_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class ScorePrefixReply(_message.Message):
    __slots__ = ("scores", "num_tokens", "position")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[PrefixScore]
    num_tokens: int
    position: JournalPosition
    def __init__(self, scores: _Optional[_Iterable[_Union[PrefixScore, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., position: _Optional[_Union[JournalPosition, _Mapping]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("pool", "from_sequence")
    POOL_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    from_sequence: int
    def __init__(self, pool: _Optional[str] = ..., from_sequence: _Optional[int] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("sequence", "timestamp", "events", "reset", "more", "reset_reason")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    RESET_REASON_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    reset: bool
    more: bool
    reset_reason: str
    def __init__(self, sequence: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., reset: _Optional[bool] = ..., more: _Optional[bool] = ..., reset_reason: _Optional[str] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "extra_keys")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_KIND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _common_pb2.Tensor
    parent_block_hash: int
    token_ids: _common_pb2.Tensor
    block_size: int
    group_idx: int
    kv_cache_spec_kind: str
    kv_cache_spec_sliding_window: int
    extra_keys: _containers.RepeatedCompositeFieldContainer[BlockExtraKeys]
    def __init__(self, block_hashes: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., block_size: _Optional[int] = ..., group_idx: _Optional[int] = ..., kv_cache_spec_kind: _Optional[str] = ..., kv_cache_spec_sliding_window: _Optional[int] = ..., extra_keys: _Optional[_Iterable[_Union[BlockExtraKeys, _Mapping]]] = ...) -> None: ...

class BlockExtraKeys(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "group_idx")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _common_pb2.Tensor
    group_idx: int
    def __init__(self, block_hashes: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., group_idx: _Optional[int] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
