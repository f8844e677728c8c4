from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Box(_message.Message):
    __slots__ = ("array", "global_shape", "dtype", "offsets", "shape", "grid", "stacked")
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    STACKED_FIELD_NUMBER: _ClassVar[int]
    array: str
    global_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    grid: _containers.RepeatedScalarFieldContainer[int]
    stacked: bool
    def __init__(self, array: _Optional[str] = ..., global_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ..., grid: _Optional[_Iterable[int]] = ..., stacked: _Optional[bool] = ...) -> None: ...

class BeginSaveRequest(_message.Message):
    __slots__ = ("step", "num_writers", "overwrite")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITERS_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    step: int
    num_writers: int
    overwrite: bool
    def __init__(self, step: _Optional[int] = ..., num_writers: _Optional[int] = ..., overwrite: _Optional[bool] = ...) -> None: ...

class BeginSaveResponse(_message.Message):
    __slots__ = ("save_id", "root")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    root: str
    def __init__(self, save_id: _Optional[str] = ..., root: _Optional[str] = ...) -> None: ...

class WriteHeader(_message.Message):
    __slots__ = ("save_id", "writer_id", "step")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    WRITER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    writer_id: int
    step: int
    def __init__(self, save_id: _Optional[str] = ..., writer_id: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class WriteShardsRequest(_message.Message):
    __slots__ = ("header", "box", "chunk", "error")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    header: WriteHeader
    box: Box
    chunk: bytes
    error: str
    def __init__(self, header: _Optional[_Union[WriteHeader, _Mapping]] = ..., box: _Optional[_Union[Box, _Mapping]] = ..., chunk: _Optional[bytes] = ..., error: _Optional[str] = ...) -> None: ...

class WriteShardsResponse(_message.Message):
    __slots__ = ("boxes", "bytes")
    BOXES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    boxes: int
    bytes: int
    def __init__(self, boxes: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("save_id", "metadata_json", "timeout_s", "step")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    metadata_json: str
    timeout_s: float
    step: int
    def __init__(self, save_id: _Optional[str] = ..., metadata_json: _Optional[str] = ..., timeout_s: _Optional[float] = ..., step: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("url", "step", "num_arrays", "num_objects", "bytes_written", "seconds")
    URL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_ARRAYS_FIELD_NUMBER: _ClassVar[int]
    NUM_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    url: str
    step: int
    num_arrays: int
    num_objects: int
    bytes_written: int
    seconds: float
    def __init__(self, url: _Optional[str] = ..., step: _Optional[int] = ..., num_arrays: _Optional[int] = ..., num_objects: _Optional[int] = ..., bytes_written: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class AbortSaveRequest(_message.Message):
    __slots__ = ("save_id", "reason")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    reason: str
    def __init__(self, save_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortSaveResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class ResumeSaveRequest(_message.Message):
    __slots__ = ("save_id", "step", "num_writers")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITERS_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    step: int
    num_writers: int
    def __init__(self, save_id: _Optional[str] = ..., step: _Optional[int] = ..., num_writers: _Optional[int] = ...) -> None: ...

class ResumeSaveResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    def __init__(self, committed: _Optional[bool] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, steps: _Optional[_Iterable[int]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("manifest_json",)
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    def __init__(self, manifest_json: _Optional[str] = ...) -> None: ...

class ReadSliceRequest(_message.Message):
    __slots__ = ("step", "array", "offsets", "shape")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    step: int
    array: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., array: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ReadSliceResponse(_message.Message):
    __slots__ = ("dtype", "shape", "chunk")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    chunk: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class RetentionRequest(_message.Message):
    __slots__ = ("keep_last", "keep_every")
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    KEEP_EVERY_FIELD_NUMBER: _ClassVar[int]
    keep_last: int
    keep_every: int
    def __init__(self, keep_last: _Optional[int] = ..., keep_every: _Optional[int] = ...) -> None: ...

class RetentionResponse(_message.Message):
    __slots__ = ("deleted", "collected")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    COLLECTED_FIELD_NUMBER: _ClassVar[int]
    deleted: _containers.RepeatedScalarFieldContainer[int]
    collected: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, deleted: _Optional[_Iterable[int]] = ..., collected: _Optional[_Iterable[int]] = ...) -> None: ...
