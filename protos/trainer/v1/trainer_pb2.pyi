from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("step", "train_iters", "loss", "tokens_per_s", "eta_s", "last_checkpoint", "stop_requested", "checkpoint_requested")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ITERS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STOP_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    step: int
    train_iters: int
    loss: float
    tokens_per_s: float
    eta_s: float
    last_checkpoint: str
    stop_requested: bool
    checkpoint_requested: bool
    def __init__(self, step: _Optional[int] = ..., train_iters: _Optional[int] = ..., loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., eta_s: _Optional[float] = ..., last_checkpoint: _Optional[str] = ..., stop_requested: _Optional[bool] = ..., checkpoint_requested: _Optional[bool] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...
