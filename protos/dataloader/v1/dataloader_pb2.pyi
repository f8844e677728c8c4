from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DatasetSpec(_message.Message):
    __slots__ = ("prefixes", "weights", "seq_length", "num_samples", "seed", "split", "split_name", "sample_order", "format")
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ORDER_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    prefixes: _containers.RepeatedScalarFieldContainer[str]
    weights: _containers.RepeatedScalarFieldContainer[float]
    seq_length: int
    num_samples: int
    seed: int
    split: str
    split_name: str
    sample_order: str
    format: str
    def __init__(self, prefixes: _Optional[_Iterable[str]] = ..., weights: _Optional[_Iterable[float]] = ..., seq_length: _Optional[int] = ..., num_samples: _Optional[int] = ..., seed: _Optional[int] = ..., split: _Optional[str] = ..., split_name: _Optional[str] = ..., sample_order: _Optional[str] = ..., format: _Optional[str] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("spec", "dp_rank", "dp_size", "micro_batch_size", "global_batch_size", "start_step", "start_microbatch", "end_step", "cp_rank", "cp_size")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    START_MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    END_STEP_FIELD_NUMBER: _ClassVar[int]
    CP_RANK_FIELD_NUMBER: _ClassVar[int]
    CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    spec: DatasetSpec
    dp_rank: int
    dp_size: int
    micro_batch_size: int
    global_batch_size: int
    start_step: int
    start_microbatch: int
    end_step: int
    cp_rank: int
    cp_size: int
    def __init__(self, spec: _Optional[_Union[DatasetSpec, _Mapping]] = ..., dp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ..., micro_batch_size: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., start_step: _Optional[int] = ..., start_microbatch: _Optional[int] = ..., end_step: _Optional[int] = ..., cp_rank: _Optional[int] = ..., cp_size: _Optional[int] = ...) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("step", "microbatch", "dtype", "shape", "samples", "token_mask", "document_ids")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASK_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    microbatch: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    samples: bytes
    token_mask: Array
    document_ids: Array
    def __init__(self, step: _Optional[int] = ..., microbatch: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., samples: _Optional[bytes] = ..., token_mask: _Optional[_Union[Array, _Mapping]] = ..., document_ids: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class Array(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("num_samples", "num_steps", "num_micro_batches", "sample_order", "format")
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ORDER_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    num_samples: int
    num_steps: int
    num_micro_batches: int
    sample_order: str
    format: str
    def __init__(self, num_samples: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., sample_order: _Optional[str] = ..., format: _Optional[str] = ...) -> None: ...
