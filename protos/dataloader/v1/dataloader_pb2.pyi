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

class MultimodalSpec(_message.Message):
    __slots__ = ("paths", "tokenizer", "seq_length", "num_samples", "seed", "image_token_id", "tokens_per_image", "image_size", "resize_mode", "normalization", "wire_dtype", "bad_image_policy", "split", "split_name")
    PATHS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESIZE_MODE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZATION_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BAD_IMAGE_POLICY_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_NAME_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    tokenizer: str
    seq_length: int
    num_samples: int
    seed: int
    image_token_id: int
    tokens_per_image: int
    image_size: int
    resize_mode: str
    normalization: str
    wire_dtype: str
    bad_image_policy: str
    split: str
    split_name: str
    def __init__(self, paths: _Optional[_Iterable[str]] = ..., tokenizer: _Optional[str] = ..., seq_length: _Optional[int] = ..., num_samples: _Optional[int] = ..., seed: _Optional[int] = ..., image_token_id: _Optional[int] = ..., tokens_per_image: _Optional[int] = ..., image_size: _Optional[int] = ..., resize_mode: _Optional[str] = ..., normalization: _Optional[str] = ..., wire_dtype: _Optional[str] = ..., bad_image_policy: _Optional[str] = ..., split: _Optional[str] = ..., split_name: _Optional[str] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("spec", "multimodal", "dp_rank", "dp_size", "micro_batch_size", "global_batch_size", "start_step", "start_microbatch", "end_step", "cp_rank", "cp_size")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_FIELD_NUMBER: _ClassVar[int]
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
    multimodal: MultimodalSpec
    dp_rank: int
    dp_size: int
    micro_batch_size: int
    global_batch_size: int
    start_step: int
    start_microbatch: int
    end_step: int
    cp_rank: int
    cp_size: int
    def __init__(self, spec: _Optional[_Union[DatasetSpec, _Mapping]] = ..., multimodal: _Optional[_Union[MultimodalSpec, _Mapping]] = ..., dp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ..., micro_batch_size: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., start_step: _Optional[int] = ..., start_microbatch: _Optional[int] = ..., end_step: _Optional[int] = ..., cp_rank: _Optional[int] = ..., cp_size: _Optional[int] = ...) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("step", "microbatch", "dtype", "shape", "samples", "loss_mask", "images_dtype", "images_shape", "images", "token_mask", "document_ids")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    IMAGES_DTYPE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_SHAPE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASK_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    microbatch: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    samples: bytes
    loss_mask: bytes
    images_dtype: str
    images_shape: _containers.RepeatedScalarFieldContainer[int]
    images: bytes
    token_mask: Array
    document_ids: Array
    def __init__(self, step: _Optional[int] = ..., microbatch: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., samples: _Optional[bytes] = ..., loss_mask: _Optional[bytes] = ..., images_dtype: _Optional[str] = ..., images_shape: _Optional[_Iterable[int]] = ..., images: _Optional[bytes] = ..., token_mask: _Optional[_Union[Array, _Mapping]] = ..., document_ids: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

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
