"""Fully sharded data parallelism's settings: Megatron's and torchtitan's names, the sharding
strategy they resolve to, and what it refuses to compose with (by name)."""

import pytest

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.config.parallel import ParallelConfig


def test_megatron_flags_select_fsdp2_and_the_strategy():
    p = load_config(["--use-torch-fsdp2"]).parallel
    assert p.fully_sharded and p.data_parallel_sharding_strategy == "optim_grads_params"
    assert p.reshard_after_forward
    p = load_config(["--data-parallel-sharding-strategy", "optim_grads"]).parallel
    assert p.fully_sharded and not p.reshard_after_forward  # ZeRO-2
    p = load_config(["--data-parallel-sharding-strategy", "optim"]).parallel
    assert p.use_distributed_optimizer and not p.fully_sharded  # ZeRO-1
    p = load_config(["--use-distributed-optimizer"]).parallel
    assert p.data_parallel_sharding_strategy == "optim"
    assert load_config([]).parallel.data_parallel_sharding_strategy == "no_shard"


def test_torchtitan_degrees():
    p = load_config(
        [
            "--use-torch-fsdp2",
            "--data-parallel-replicate-degree",
            "2",
            "--data-parallel-shard-degree",
            "4",
        ]
    ).parallel
    assert (p.dp_replicate, p.dp_shard) == (2, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"use_torch_fsdp2": True, "data_parallel_sharding_strategy": "optim"},
            "must be 'optim_grads'",
        ),
        (
            {
                "use_distributed_optimizer": True,
                "data_parallel_sharding_strategy": "optim_grads_params",
            },
            "leave parallel.use_distributed_optimizer",
        ),
        (
            {"use_distributed_optimizer": True, "data_parallel_sharding_strategy": "no_shard"},
            "contradicts",
        ),
        ({"dp_replicate": 2}, "parallel.dp_replicate splits"),
        ({"dp_shard": 2}, "parallel.dp_shard splits"),
        ({"use_torch_fsdp2": True, "dp_shard": 0}, "dp_shard >= 1 or -1"),
    ],
)
def test_contradictions_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize(
    "args, key",
    [
        (
            ["--pipeline-model-parallel-size", "2", "--parallel.pipeline_schedule=zb-h1"],
            "parallel.pipeline_schedule='zb-h1'",
        ),
        (["--train.cuda_graph=true"], "train.cuda_graph"),
    ],
)
def test_what_does_not_compose_yet_is_refused_by_name(args, key):
    with pytest.raises(ConfigError, match=f"does not compose with .*{key.replace('.', '[.]')}"):
        load_config(["--use-torch-fsdp2", *args])


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "none", "auto"])
def test_pipeline_schedules_compose(schedule):
    job = load_config(
        [
            "--use-torch-fsdp2",
            "--pipeline-model-parallel-size",
            "2",
            f"--parallel.pipeline_schedule={schedule}",
        ]
    )
    assert job.parallel.fully_sharded and job.parallel.pp == 2


def test_context_parallel_composes():
    p = load_config(["--use-torch-fsdp2", "--context-parallel-size", "2"]).parallel
    assert p.fully_sharded and p.cp == 2


@pytest.mark.parametrize(
    "args", [["--num-experts", "4"], ["--num-experts", "4", "--expert-model-parallel-size", "2"]]
)
def test_experts_compose(args):
    job = load_config(["--use-torch-fsdp2", *args])
    assert job.parallel.fully_sharded and job.model.num_experts == 4


def test_fp8_composes():
    job = load_config(["--use-torch-fsdp2", "--fp8-format", "hybrid", "--bf16"])
    assert job.parallel.fully_sharded and job.train.fp8 == "hybrid"


def test_tensor_parallel_composes():
    p = load_config(
        ["--use-torch-fsdp2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    )
    assert p.parallel.fully_sharded and p.parallel.tp == 2


@pytest.mark.parametrize(
    "args, match",
    [
        (["--data-parallel-shard-degree", "2"], "parallel.dp_shard=2 needs 2 processes"),
        (["--data-parallel-replicate-degree", "2"], "parallel.dp_replicate=2 needs 2 processes"),
    ],
)
def test_one_process_refuses_degrees_it_cannot_have(args, match):
    """One process has dp_shard = dp_replicate = 1: a larger degree is refused, not ignored."""
    import torch

    from meshtrain.services.trainer.build import build_mesh

    with pytest.raises(ConfigError, match=match):
        build_mesh(load_config(["--use-torch-fsdp2", *args]), torch.device("cpu"))


def test_one_process_trains_unsharded_and_says_so(caplog):
    import torch

    from meshtrain.services.trainer.build import build_mesh

    for args in (["--use-torch-fsdp2"], ["--use-torch-fsdp2", "--data-parallel-shard-degree", "1"]):
        with caplog.at_level("WARNING", logger="meshtrain.train"):
            mesh = build_mesh(load_config(args), torch.device("cpu"))
        assert not mesh.distributed and mesh.dp_shard == 1
        assert "the model is not sharded" in caplog.text
