"""meshtrain: Megatron-style training of GPT-family language models.

The names below are the public API (documented in docs/api.md); every other module is internal
and may change. They are imported on first use, so `import meshtrain` stays light: a data or
checkpoint worker that imports the package never loads torch or the trainer.

    import meshtrain as mt

    mesh = mt.initialize_model_parallel(tensor_model_parallel_size=2)   # torchrun's environment
    job = mt.JobConfig(model=mt.ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4))
    model = mt.parallelize(mt.GPT(job.model), mesh, sequence_parallel=True)
    model = mt.DistributedDataParallel(model, mesh, job.optim, distributed_optimizer=True)
    ...
    mt.save_checkpoint("ckpt", step, model, model.optimizer)

The repository's folders services/, kernels/ and protos/ are the packages meshtrain.services,
meshtrain.kernels and meshtrain.protos; this folder links to them. Those three have no
`__init__.py` of their own, so from the repository's root (on sys.path in a `python -c` there)
their bare names are empty namespace portions that any installed package of the same name
outranks (transformers probes for Hugging Face's `kernels`); the modules in them refuse to load
under a bare name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The public names as type checkers and IDEs see them: the same names from the same modules as
# _EXPORTS and _RENAMED below, which `__getattr__` imports at run time (tests/test_packaging.py
# holds the tables together; ruff's F401/F822 hold this block and __all__ together).
if TYPE_CHECKING:
    from meshtrain.services.checkpoint.config import CheckpointConfig
    from meshtrain.services.checkpoint.rpc.server import start_server as start_checkpoint_service
    from meshtrain.services.common.errors import (
        CheckpointError,
        ConfigError,
        DataError,
        MeshtrainError,
    )
    from meshtrain.services.common.model_config import ModelConfig, VisionConfig
    from meshtrain.services.dataloader.config import DataConfig
    from meshtrain.services.dataloader.loader import Batch, LocalBatchSource, context_positions
    from meshtrain.services.dataloader.rpc.client import ServiceBatchSource
    from meshtrain.services.dataloader.rpc.server import start_server as start_data_worker
    from meshtrain.services.dataloader.spec import DatasetSpec
    from meshtrain.services.trainer.checkpoint_state import TrainState
    from meshtrain.services.trainer.checkpointing import load_checkpoint, save_checkpoint
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.config.parallel import ParallelConfig
    from meshtrain.services.trainer.config.sections import (
        JobConfig,
        LogConfig,
        OptimConfig,
        TrainConfig,
    )
    from meshtrain.services.trainer.data import TrainData, build_data, make_source
    from meshtrain.services.trainer.generate import generate
    from meshtrain.services.trainer.model.gpt import GPT
    from meshtrain.services.trainer.model.vision import Projector, VisionEncoder, freeze
    from meshtrain.services.trainer.optim.optimizer import build_optimizer, set_lr
    from meshtrain.services.trainer.optim.schedule import lr_at
    from meshtrain.services.trainer.parallel.context import parallelize_context
    from meshtrain.services.trainer.parallel.ddp import (
        DistributedDataParallel,
        DistributedOptimizer,
    )
    from meshtrain.services.trainer.parallel.expert import parallelize_experts
    from meshtrain.services.trainer.parallel.mesh import (
        Mesh,
        init_process_group,
        initialize_model_parallel,
    )
    from meshtrain.services.trainer.parallel.recompute import apply as apply_recompute
    from meshtrain.services.trainer.parallel.tensor import parallelize
    from meshtrain.services.trainer.train import Trainer, TrainResult, train

_T = "meshtrain.services.trainer"
_D = "meshtrain.services.dataloader"
_EXPORTS = {
    # the mesh
    "Mesh": f"{_T}.parallel.mesh",
    "initialize_model_parallel": f"{_T}.parallel.mesh",
    "init_process_group": f"{_T}.parallel.mesh",
    # configs
    "JobConfig": f"{_T}.config.sections",
    "ModelConfig": "meshtrain.services.common.model_config",
    "VisionConfig": "meshtrain.services.common.model_config",
    "TrainConfig": f"{_T}.config.sections",
    "OptimConfig": f"{_T}.config.sections",
    "ParallelConfig": f"{_T}.config.parallel",
    "DataConfig": f"{_D}.config",
    "CheckpointConfig": "meshtrain.services.checkpoint.config",
    "LogConfig": f"{_T}.config.sections",
    "load_config": f"{_T}.config.load",
    # the model and its sharding
    "GPT": f"{_T}.model.gpt",
    "VisionEncoder": f"{_T}.model.vision",
    "Projector": f"{_T}.model.vision",
    "freeze": f"{_T}.model.vision",
    "parallelize": f"{_T}.parallel.tensor",
    "parallelize_context": f"{_T}.parallel.context",
    "parallelize_experts": f"{_T}.parallel.expert",
    "apply_recompute": f"{_T}.parallel.recompute",
    "DistributedDataParallel": f"{_T}.parallel.ddp",
    "DistributedOptimizer": f"{_T}.parallel.ddp",
    # optimizer and schedule
    "build_optimizer": f"{_T}.optim.optimizer",
    "set_lr": f"{_T}.optim.optimizer",
    "lr_at": f"{_T}.optim.schedule",
    # data
    "build_data": f"{_T}.data",
    "make_source": f"{_T}.data",
    "TrainData": f"{_T}.data",
    "DatasetSpec": f"{_D}.spec",
    "Batch": f"{_D}.loader",
    "context_positions": f"{_D}.loader",
    "LocalBatchSource": f"{_D}.loader",
    "ServiceBatchSource": f"{_D}.rpc.client",
    "start_data_worker": f"{_D}.rpc.server",
    # checkpoints
    "save_checkpoint": f"{_T}.checkpointing",
    "load_checkpoint": f"{_T}.checkpointing",
    "TrainState": f"{_T}.checkpoint_state",
    # sampling
    "generate": f"{_T}.generate",
    "start_checkpoint_service": "meshtrain.services.checkpoint.rpc.server",
    # the training loop
    "train": f"{_T}.train",
    "Trainer": f"{_T}.train",
    "TrainResult": f"{_T}.train",
    # errors a user can cause
    "MeshtrainError": "meshtrain.services.common.errors",
    "ConfigError": "meshtrain.services.common.errors",
    "DataError": "meshtrain.services.common.errors",
    "CheckpointError": "meshtrain.services.common.errors",
}
_RENAMED = {
    "apply_recompute": "apply",
    "start_data_worker": "start_server",
    "start_checkpoint_service": "start_server",
}

__all__ = [
    "Batch",
    "CheckpointConfig",
    "CheckpointError",
    "ConfigError",
    "DataConfig",
    "DataError",
    "DatasetSpec",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "GPT",
    "JobConfig",
    "LocalBatchSource",
    "LogConfig",
    "Mesh",
    "MeshtrainError",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "Projector",
    "ServiceBatchSource",
    "TrainConfig",
    "TrainData",
    "TrainResult",
    "TrainState",
    "Trainer",
    "VisionConfig",
    "VisionEncoder",
    "apply_recompute",
    "build_data",
    "build_optimizer",
    "context_positions",
    "freeze",
    "generate",
    "init_process_group",
    "initialize_model_parallel",
    "load_checkpoint",
    "load_config",
    "lr_at",
    "make_source",
    "parallelize",
    "parallelize_context",
    "parallelize_experts",
    "save_checkpoint",
    "set_lr",
    "start_checkpoint_service",
    "start_data_worker",
    "train",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), _RENAMED.get(name, name))
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
