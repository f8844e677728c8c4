"""The CPU thread budget `meshtrain up` gives each process, as the environment it starts with."""

import pytest

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.launcher import threads
from meshtrain.services.launcher.threads import ThreadBudget, thread_budget
from meshtrain.services.launcher.up_plan import UpOptions, plan

ARGS = ["--config", "deploy/configs/tiny.toml"]


def test_the_trainer_ranks_share_the_cores_the_data_workers_leave():
    assert thread_budget(1, 1, cores=16, environ={}) == ThreadBudget(1, 15)
    assert thread_budget(4, 2, cores=16, environ={}) == ThreadBudget(1, 3)
    assert thread_budget(1, 0, cores=8, environ={}) == ThreadBudget(1, 8)
    assert thread_budget(1, 1, cores=2, environ={}) == ThreadBudget(1, 1)
    assert thread_budget(4, 2, cores=2, environ={}) == ThreadBudget(1, 1)  # at least one


def test_an_explicit_count_wins_and_a_users_omp_num_threads_stands_for_the_ranks():
    assert thread_budget(2, 1, trainer_threads=5, environ={"OMP_NUM_THREADS": "3"}).trainer == 5
    budget = thread_budget(2, 1, cores=16, environ={"OMP_NUM_THREADS": "3"})
    assert budget == ThreadBudget(1, None)
    assert budget.trainer_env({"OMP_NUM_THREADS": "3"}) == {"MKL_NUM_THREADS": "3"}
    assert budget.trainer_env({"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "2"}) == {}
    assert budget.service_env() == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _plan(tmp_path, monkeypatch, options, cores=6):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    return plan(options, [*ARGS, f"--log.run_dir={tmp_path / 'run'}"])


@pytest.mark.parametrize("ranks", [1, 2])
def test_up_starts_services_with_one_thread_and_ranks_with_the_rest(tmp_path, monkeypatch, ranks):
    p = _plan(tmp_path, monkeypatch, UpOptions(data_workers=2, nproc_per_node=ranks))
    assert [c.name for c in p.services] == ["data-0", "data-1", "ckpt"]
    for child in p.services:
        assert child.env["OMP_NUM_THREADS"] == child.env["MKL_NUM_THREADS"] == "1"
    for child in p.trainers:  # (6 cores - 2 data workers) / ranks
        assert child.env["OMP_NUM_THREADS"] == child.env["MKL_NUM_THREADS"] == str(4 // ranks)


def test_up_trainer_threads_sets_the_ranks_count(tmp_path, monkeypatch):
    p = _plan(tmp_path, monkeypatch, UpOptions(nproc_per_node=2, trainer_threads=3))
    assert {c.env["OMP_NUM_THREADS"] for c in p.trainers} == {"3"}
    assert {c.env["OMP_NUM_THREADS"] for c in p.services} == {"1"}
    with pytest.raises(ConfigError, match="trainer-threads >= 1"):
        UpOptions(trainer_threads=0)


def test_up_leaves_a_users_omp_num_threads_to_the_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 6)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    p = plan(UpOptions(nproc_per_node=2), [*ARGS, f"--log.run_dir={tmp_path / 'run'}"])
    for child in p.trainers:  # inherited from ours, as torchrun does
        assert "OMP_NUM_THREADS" not in child.env and child.env["MKL_NUM_THREADS"] == "2"
    assert {c.env["OMP_NUM_THREADS"] for c in p.services} == {"1"}
