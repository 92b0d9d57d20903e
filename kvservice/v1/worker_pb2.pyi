from kvservice.v1 import block_manager_pb2 as _block_manager_pb2
from kvservice.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ViolationPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_NAN: _ClassVar[ViolationPolicy]
    POLICY_ZEROS: _ClassVar[ViolationPolicy]
    POLICY_ERROR: _ClassVar[ViolationPolicy]
POLICY_NAN: ViolationPolicy
POLICY_ZEROS: ViolationPolicy
POLICY_ERROR: ViolationPolicy

class ViolationRecord(_message.Message):
    __slots__ = ("kernel", "layer", "count", "row", "position", "value", "reason", "counts_by_reason")
    class CountsByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNTS_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    kernel: str
    layer: int
    count: int
    row: int
    position: int
    value: int
    reason: str
    counts_by_reason: _containers.ScalarMap[str, int]
    def __init__(self, kernel: _Optional[str] = ..., layer: _Optional[int] = ..., count: _Optional[int] = ..., row: _Optional[int] = ..., position: _Optional[int] = ..., value: _Optional[int] = ..., reason: _Optional[str] = ..., counts_by_reason: _Optional[_Mapping[str, int]] = ...) -> None: ...

class KernelReply(_message.Message):
    __slots__ = ("violations", "kernel_seconds")
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    violations: _containers.RepeatedCompositeFieldContainer[ViolationRecord]
    kernel_seconds: float
    def __init__(self, violations: _Optional[_Iterable[_Union[ViolationRecord, _Mapping]]] = ..., kernel_seconds: _Optional[float] = ...) -> None: ...

class AppendKVRequest(_message.Message):
    __slots__ = ("layer", "k", "v", "slot_mapping", "policy", "pool_incarnation", "table_id", "slot_generations")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POOL_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TABLE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    k: _common_pb2.Tensor
    v: _common_pb2.Tensor
    slot_mapping: _common_pb2.Tensor
    policy: ViolationPolicy
    pool_incarnation: int
    table_id: str
    slot_generations: _common_pb2.Tensor
    def __init__(self, layer: _Optional[int] = ..., k: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., v: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., slot_mapping: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., policy: _Optional[_Union[ViolationPolicy, str]] = ..., pool_incarnation: _Optional[int] = ..., table_id: _Optional[str] = ..., slot_generations: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DecodeAttentionRequest(_message.Message):
    __slots__ = ("layer", "q", "indptr", "indices", "last_page_len", "sm_scale", "policy", "pool_incarnation", "table_id", "generations")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    INDPTR_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    LAST_PAGE_LEN_FIELD_NUMBER: _ClassVar[int]
    SM_SCALE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POOL_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TABLE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    q: _common_pb2.Tensor
    indptr: _common_pb2.Tensor
    indices: _common_pb2.Tensor
    last_page_len: _common_pb2.Tensor
    sm_scale: float
    policy: ViolationPolicy
    pool_incarnation: int
    table_id: str
    generations: _common_pb2.Tensor
    def __init__(self, layer: _Optional[int] = ..., q: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., indptr: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., indices: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., last_page_len: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sm_scale: _Optional[float] = ..., policy: _Optional[_Union[ViolationPolicy, str]] = ..., pool_incarnation: _Optional[int] = ..., table_id: _Optional[str] = ..., generations: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DecodeAttentionReply(_message.Message):
    __slots__ = ("out", "lse", "violation", "kernel_seconds")
    OUT_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    VIOLATION_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    out: _common_pb2.Tensor
    lse: _common_pb2.Tensor
    violation: ViolationRecord
    kernel_seconds: float
    def __init__(self, out: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., lse: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., violation: _Optional[_Union[ViolationRecord, _Mapping]] = ..., kernel_seconds: _Optional[float] = ...) -> None: ...

class CopyBlocksRequest(_message.Message):
    __slots__ = ("group", "pairs", "policy", "pool_incarnation", "generations")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POOL_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    group: int
    pairs: _common_pb2.Tensor
    policy: ViolationPolicy
    pool_incarnation: int
    generations: _common_pb2.Tensor
    def __init__(self, group: _Optional[int] = ..., pairs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., policy: _Optional[_Union[ViolationPolicy, str]] = ..., pool_incarnation: _Optional[int] = ..., generations: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class WorkerValidateRequest(_message.Message):
    __slots__ = ("layer", "indptr", "indices", "last_page_len", "pool_incarnation", "generations")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    INDPTR_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    LAST_PAGE_LEN_FIELD_NUMBER: _ClassVar[int]
    POOL_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    indptr: _common_pb2.Tensor
    indices: _common_pb2.Tensor
    last_page_len: _common_pb2.Tensor
    pool_incarnation: int
    generations: _common_pb2.Tensor
    def __init__(self, layer: _Optional[int] = ..., indptr: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., indices: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., last_page_len: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., pool_incarnation: _Optional[int] = ..., generations: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class WorkerValidateReply(_message.Message):
    __slots__ = ("ok", "violation", "row_status")
    OK_FIELD_NUMBER: _ClassVar[int]
    VIOLATION_FIELD_NUMBER: _ClassVar[int]
    ROW_STATUS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    violation: ViolationRecord
    row_status: _common_pb2.Tensor
    def __init__(self, ok: _Optional[bool] = ..., violation: _Optional[_Union[ViolationRecord, _Mapping]] = ..., row_status: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class CheckGuardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GuardStatus(_message.Message):
    __slots__ = ("buffer", "corrupted_bytes", "first_offset")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    corrupted_bytes: int
    first_offset: int
    def __init__(self, buffer: _Optional[str] = ..., corrupted_bytes: _Optional[int] = ..., first_offset: _Optional[int] = ...) -> None: ...

class CheckGuardsReply(_message.Message):
    __slots__ = ("ok", "buffers")
    OK_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    buffers: _containers.RepeatedCompositeFieldContainer[GuardStatus]
    def __init__(self, ok: _Optional[bool] = ..., buffers: _Optional[_Iterable[_Union[GuardStatus, _Mapping]]] = ...) -> None: ...

class CorruptGuardRequest(_message.Message):
    __slots__ = ("buffer", "after", "offset")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    after: bool
    offset: int
    def __init__(self, buffer: _Optional[str] = ..., after: _Optional[bool] = ..., offset: _Optional[int] = ...) -> None: ...

class CorruptGuardReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "pool", "epoch", "layer_begin", "layer_end", "backend", "device_name", "cache_bytes", "guard_bytes", "buffers", "pool_incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GUARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    POOL_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pool: str
    epoch: int
    layer_begin: int
    layer_end: int
    backend: str
    device_name: str
    cache_bytes: int
    guard_bytes: int
    buffers: _containers.RepeatedScalarFieldContainer[str]
    pool_incarnation: int
    def __init__(self, worker_id: _Optional[str] = ..., pool: _Optional[str] = ..., epoch: _Optional[int] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., backend: _Optional[str] = ..., device_name: _Optional[str] = ..., cache_bytes: _Optional[int] = ..., guard_bytes: _Optional[int] = ..., buffers: _Optional[_Iterable[str]] = ..., pool_incarnation: _Optional[int] = ...) -> None: ...

class UpdateTablesRequest(_message.Message):
    __slots__ = ("table_id", "step", "replace")
    TABLE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    table_id: str
    step: _block_manager_pb2.StepReply
    replace: bool
    def __init__(self, table_id: _Optional[str] = ..., step: _Optional[_Union[_block_manager_pb2.StepReply, _Mapping]] = ..., replace: _Optional[bool] = ...) -> None: ...

class UpdateTablesReply(_message.Message):
    __slots__ = ("stream_seq", "batch_size", "pages_held", "pool_incarnation", "table_bytes", "max_table_bytes", "tenant_bytes", "tenant_quota_bytes")
    STREAM_SEQ_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGES_HELD_FIELD_NUMBER: _ClassVar[int]
    POOL_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    stream_seq: int
    batch_size: int
    pages_held: int
    pool_incarnation: int
    table_bytes: int
    max_table_bytes: int
    tenant_bytes: int
    tenant_quota_bytes: int
    def __init__(self, stream_seq: _Optional[int] = ..., batch_size: _Optional[int] = ..., pages_held: _Optional[int] = ..., pool_incarnation: _Optional[int] = ..., table_bytes: _Optional[int] = ..., max_table_bytes: _Optional[int] = ..., tenant_bytes: _Optional[int] = ..., tenant_quota_bytes: _Optional[int] = ...) -> None: ...
