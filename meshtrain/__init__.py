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
meshtrain.kernels and meshtrain.protos; this folder links to them.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys

__version__ = "0.1.0"


def _hide_repository_folders() -> None:
    """Mark the bare names `services`, `kernels` and `protos` absent where they would find this
    checkout's folders (its root on sys.path: pytest, `python -c` run in it).

    Those folders are meshtrain.services, meshtrain.kernels and meshtrain.protos, never
    packages of their own (their `__init__` refuses such an import). With None in sys.modules,
    `import kernels` fails as a missing module, and a probe for another distribution of that
    name finds none (transformers imports any `kernels` it can find, looking for Hugging Face's)
    instead of running into ours. A name that finds something else is left alone.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("services", "kernels", "protos"):
        if name in sys.modules:
            continue
        spec = importlib.machinery.PathFinder.find_spec(name)
        ours = os.path.realpath(os.path.join(here, name, "__init__.py"))
        if spec is not None and spec.origin and os.path.realpath(spec.origin) == ours:
            sys.modules[name] = None


_hide_repository_folders()

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
    "TrainConfig": f"{_T}.config.sections",
    "OptimConfig": f"{_T}.config.sections",
    "ParallelConfig": f"{_T}.config.parallel",
    "DataConfig": f"{_D}.config",
    "CheckpointConfig": "meshtrain.services.checkpoint.config",
    "LogConfig": f"{_T}.config.sections",
    "load_config": f"{_T}.config.load",
    # the model and its sharding
    "GPT": f"{_T}.model.gpt",
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
    "TrainState": f"{_T}.checkpointing",
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

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), _RENAMED.get(name, name))
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
