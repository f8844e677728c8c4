"""What preference tuning refuses is refused before anything is built, naming the setting."""

from types import SimpleNamespace

import pytest

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config import load
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.objectives.dpo import check_dpo_job

ALONE = SimpleNamespace(cp=1, pp=1)


def job(**overrides) -> JobConfig:
    base = {"train": {"objective": "dpo"}, "dpo": {"data_path": "/data/pairs"}}
    for key, value in overrides.items():
        section, name = key.split(".")
        base.setdefault(section, {})[name] = value
    return load.replace(JobConfig(), **base)


def test_a_plain_dpo_job_passes():
    check_dpo_job(job(), ALONE)


@pytest.mark.parametrize(
    "overrides, mesh, named",
    [
        ({"dpo.data_path": None}, ALONE, "dpo.data_path"),
        ({"data.service_addresses": ["localhost:1"]}, ALONE, "data.service_addresses"),
        ({}, SimpleNamespace(cp=2, pp=1), "parallel.cp"),
        ({"parallel.use_torch_fsdp2": True}, ALONE, "parallel.use_torch_fsdp2"),
        ({"dpo.valid_data_path": "/data/valid"}, SimpleNamespace(cp=1, pp=2), "pp=1"),
    ],
)
def test_what_dpo_does_not_run_with_is_refused_by_name(overrides, mesh, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        check_dpo_job(job(**overrides), mesh)
