"""GRPO against the rollout service equals GRPO colocated: real workers on real ports (CPU).

The trainer publishes its weights before each batch (streamed, or as a checkpoint the workers
load) and the workers sample with the same per-completion seeds as the colocated generator, so
the rewards (the sampled tokens) are equal and the losses equal within fp32 reduction order.
A worker SIGKILLed between steps costs nothing (the other takes its prompts); a worker that
cannot receive updates answers only while its weights are within grpo.max_staleness, then the
run stops with an error naming the versions.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import signal
import socket
import time

import pytest
import torch

from meshtrain.services.common.errors import StorageUnavailableError
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
from meshtrain.services.rollout.engine import RolloutEngine
from meshtrain.services.rollout.rpc.server import start_server
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.objectives.publish import PublishError, full_weights
from meshtrain.services.trainer.train import Trainer
from tests.dist_utils import run_ranks
from tests.services.trainer.objectives.test_grpo_train import job_args, write_prompts

pytestmark = pytest.mark.e2e

STEPS = {
    "train.train_iters": 3,
    "train.global_batch_size": 16,
    "train.micro_batch_size": 8,
    "grpo.group_size": 4,
}


def _config(args):
    job = load_config(args)
    tok = build_tokenizer(job.data.tokenizer)
    return dataclasses.replace(job.model, vocab_size=tok.vocab_size), tok.eod_id


def _engine(args, seed: int = 0) -> RolloutEngine:
    """A worker's engine for the run's model (its start weights are overwritten by the run's)."""
    from meshtrain.services.trainer.model import GPT

    config, eod = _config(args)
    torch.manual_seed(seed)
    return RolloutEngine(GPT(config), version=0, eod_id=eod)


@pytest.fixture
def workers():
    """Starts in-process rollout servers: workers(engine, root=None) -> 'host:port'."""
    started = []

    def start(engine, root=None):
        server, port, _ = start_server(engine, checkpoint_root=root)
        started.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in started:
        s.stop(0)


def _rows(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r]


def _run(args, hook=None):
    trainer = Trainer(load_config(args))
    if hook is not None:
        hook(trainer)
    result = trainer.run()
    return result.losses, _rows(result.run_dir)


def _assert_same_run(got, want):
    (losses, rows), (ref_losses, ref_rows) = got, want
    assert sorted(losses) == sorted(ref_losses) == [1, 2, 3]
    for step, loss in ref_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), f"step {step}"
    assert len(rows) == len(ref_rows) == 3
    for h, w in zip(rows, ref_rows, strict=True):
        for name in ("reward", "reward_std", "completions/mean_length"):
            assert h[name] == w[name], (name, w["step"])  # the same tokens were sampled


def _service(tmp_path, name, prompts, addresses, **extra):
    return job_args(
        tmp_path / name,
        prompts,
        **STEPS,
        **{"grpo.rollout": "service", "grpo.rollout_addresses": json.dumps(addresses)},
        **extra,
    )


@pytest.mark.parametrize("iterations", [1, 2])
def test_service_rollouts_equal_colocated_ones_with_one_and_two_workers(
    iterations, tmp_path, workers
):
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=10)
    extra = {"grpo.num_iterations": iterations}
    ref = _run(job_args(tmp_path / "colocated", prompts, **STEPS, **extra))
    base = _service(tmp_path, "x", prompts, ["x"], **extra)
    one = [workers(_engine(base, seed=1))]
    _assert_same_run(_run(_service(tmp_path, "one", prompts, one, **extra)), ref)
    two = [workers(_engine(base, seed=2)), workers(_engine(base, seed=3))]
    _assert_same_run(_run(_service(tmp_path, "two", prompts, two, **extra)), ref)


def test_weights_published_as_checkpoints_give_the_same_run(tmp_path, workers):
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=10)
    ref = _run(job_args(tmp_path / "colocated", prompts, **STEPS))
    root = str(tmp_path / "ckpt")
    args = _service(tmp_path, "x", prompts, ["x"])
    engine = _engine(args, seed=1)
    address = workers(engine, root=root)
    extra = {"grpo.publish": "checkpoint", "checkpoint.save": root}
    got = _run(_service(tmp_path, "ckpt", prompts, [address], **extra))
    _assert_same_run(got, ref)
    assert engine.version == 2  # the batch of step 2 came from checkpoint 2


def _serve_child(args, port: int) -> None:
    """A rollout worker process on 127.0.0.1:port until killed."""
    import threading

    torch.set_num_threads(1)
    server, _, _ = start_server(_engine(args, seed=4), port=port)
    threading.Event().wait()
    server.stop(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(address: str, child) -> None:
    from meshtrain.services.rollout.rpc.client import RolloutClient

    deadline = time.monotonic() + 30
    with RolloutClient([address]) as client:
        while not client.describe():
            assert child.is_alive() and time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.1)


def test_a_worker_killed_between_steps_does_not_break_the_run(tmp_path, workers):
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=10)
    ref = _run(job_args(tmp_path / "colocated", prompts, **STEPS))
    args = _service(tmp_path, "x", prompts, ["x"])
    port = _free_port()
    child = mp.get_context("spawn").Process(target=_serve_child, args=(args, port), daemon=True)
    child.start()
    try:
        doomed = f"127.0.0.1:{port}"
        _wait_serving(doomed, child)
        steady = _engine(args, seed=5)
        addresses = [doomed, workers(steady)]

        def kill_before_step_1(trainer):
            publish = trainer.rollouts.publish

            def hooked(step):
                if step == 1:
                    os.kill(child.pid, signal.SIGKILL)
                    child.join(10)
                publish(step)

            trainer.rollouts.publish = hooked

        got = _run(_service(tmp_path, "svc", prompts, addresses), kill_before_step_1)
        assert not child.is_alive()
        _assert_same_run(got, ref)
        assert steady.version == 2
    finally:
        child.kill()
        child.join(10)


@pytest.mark.parametrize("staleness", [0, 1])
def test_completions_older_than_max_staleness_are_refused(staleness, tmp_path, workers):
    """Worker A answers step 0 then fails; worker B never takes an update (its version stays 0):
    B's completions serve while step - version <= max_staleness, then the run stops."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=10)
    args = _service(tmp_path, "x", prompts, ["x"])
    a, b = _engine(args, seed=6), _engine(args, seed=7)

    def no_updates(*_, **__):
        raise StorageUnavailableError("this worker cannot receive weights")

    b.set_weights = no_updates  # type: ignore[method-assign]
    a_generate = a.generate

    def a_fails_after_step_0(request, *rest):
        if request.min_version > 0 or a.version > 0:
            raise StorageUnavailableError("worker A is down")
        return a_generate(request, *rest)

    a.generate = a_fails_after_step_0  # type: ignore[method-assign]
    run = _service(
        tmp_path, "svc", prompts, [workers(a), workers(b)], **{"grpo.max_staleness": staleness}
    )
    trainer = Trainer(load_config(run))
    with pytest.raises(Exception, match=r"policy version 0; the request needs >= 1") as err:
        trainer.run()
    assert "grpo.max_staleness" in str(err.value) or "allow more staleness" in str(err.value)
    rows = _rows(trainer.run_dir)
    # staleness 0: step 1 refuses B's version 0; staleness 1: step 1 takes it, step 2 refuses
    assert [r["step"] for r in rows] == list(range(1, staleness + 2))


def _rank_publish(rank, world, args):
    trainer = Trainer(load_config(args))
    tensors = full_weights(trainer.model, trainer.mesh)
    trainer.checkpointer.close()
    trainer.release_run_dir()
    if rank != 0:
        assert tensors is None
        return None
    return {name: t.clone() for name, t in tensors.items()}


@pytest.mark.dist
@pytest.mark.parametrize("layout", [{"parallel.tp": 2}, {}], ids=["tp2", "dp2"])
def test_published_weights_are_the_single_device_models(layout, tmp_path):
    """tp=2 / dp=2: rank 0 gathers the names and shapes a worker's single-device model has and
    the values one process holds (the same seed), and a worker takes them."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=10)
    args = _service(tmp_path, "two", prompts, ["127.0.0.1:1"], **layout)
    got = run_ranks(_rank_publish, 2, args, timeout=300)[0]
    one = Trainer(load_config(_service(tmp_path, "one", prompts, ["127.0.0.1:1"])))
    want = full_weights(one.model, one.mesh)
    one.checkpointer.close()
    one.release_run_dir()
    assert want is not None and sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    engine = _engine(args)
    assert sorted(got) == sorted(n for n, _ in engine.model.named_parameters())
    engine.set_weights(got, version=1)  # the worker checks names and shapes
    bad = dict(got)
    name = next(iter(bad))
    bad[name] = bad[name][..., :-1]
    with pytest.raises(Exception, match="shape"):
        engine.set_weights(bad, version=2)


def test_a_run_whose_workers_all_refuse_updates_stops_at_the_first_publication(tmp_path, workers):
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=10)
    from meshtrain.services.trainer.model import GPT

    config, eod = _config(_service(tmp_path, "x", prompts, ["x"]))
    other = GPT(dataclasses.replace(config, hidden_size=32))  # another model: names fit, shapes not
    address = workers(RolloutEngine(other, version=0, eod_id=eod))
    with pytest.raises(PublishError, match="shape"):
        _run(_service(tmp_path, "svc", prompts, [address]))
