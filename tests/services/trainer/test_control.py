"""The trainer's control endpoint against a real training run in this process.

`train()` runs in a thread (the endpoint only sees what a live loop publishes), with
`train.control_port=0`: the test finds the endpoint through RUN_DIR/control.addr exactly as
`meshtrain status RUN_DIR` does, and scrapes the Prometheus gauges over real HTTP.
"""

import logging
import shutil
import stat
import threading
import time
import urllib.request

import pytest

from meshtrain.services.checkpoint.reader import list_checkpoints
from meshtrain.services.cli import main
from meshtrain.services.common.client_security import ClientSecurity
from meshtrain.services.common.errors import CheckpointError, ConfigError, MeshtrainError
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.rpc.client import ControlClient, resolve_address
from meshtrain.services.trainer.train import train
from tests.services.trainer.conftest import small_job_args


def wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Background:
    """`train(job)` in a thread, keeping its result or error."""

    def __init__(self, job):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(job,), daemon=True)
        self.thread.start()

    def _run(self, job):
        try:
            self.result = train(job)
        except BaseException as e:  # noqa: BLE001 -- re-raised in the test thread by join()
            self.error = e

    def join(self, timeout=120.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "training did not end"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def long_run(corpus_cache, tmp_path, monkeypatch):
    """A run configured for far more steps than the test lets it take."""
    monkeypatch.setenv("MESHTRAIN_METRICS_PORT", "0")
    run_dir = tmp_path / "run"
    job = load_config(
        small_job_args(
            corpus_cache,
            run_dir,
            **{"train.train_iters": 100_000, "train.eval_interval": 0, "train.control_port": 0},
        )
    )
    bg = Background(job)
    wait_for(
        lambda: (run_dir / "control.addr").exists() or not bg.thread.is_alive(), what="control.addr"
    )
    yield bg, run_dir
    if bg.thread.is_alive():  # a failed test must not leave a 100k-step run behind
        ControlClient(str(run_dir)).stop()
        bg.join()


def test_status_checkpoint_and_stop(long_run, capsys):
    bg, run_dir = long_run
    with ControlClient(str(run_dir)) as client:
        wait_for(lambda: client.status()["loss"] is not None, what="a logged step")
        s = client.status()
        assert s["train_iters"] == 100_000 and s["step"] >= 1
        assert s["tokens_per_s"] > 0 and s["eta_s"] > 0 and s["last_checkpoint"] is None

        asked_at = client.checkpoint()
        wait_for(
            lambda: client.status()["last_checkpoint"] is not None, what="the requested checkpoint"
        )
        saved = client.status()["last_checkpoint"]
        assert int(saved.rsplit("_", 1)[1]) >= asked_at + 1  # saved after the step it was asked at

        assert main(["status", str(run_dir)]) == 0
        out = capsys.readouterr().out
        assert "step            :" in out and "/ 100000" in out and saved in out

        assert main(["stop", str(run_dir)]) == 0
    result = bg.join()
    assert result.stopped_early
    steps = list_checkpoints(str(run_dir / "checkpoints"))
    assert result.checkpoint.endswith(f"step_{steps[-1]:08d}") and len(steps) == 2
    # a finished run is not reachable any more, and says so by name
    assert not (run_dir / "control.addr").exists()
    with pytest.raises(
        ConfigError, match=r"the run has ended \(no control endpoint\): last step \d+, loss"
    ):
        resolve_address(str(run_dir))


def test_a_save_that_fails_is_never_reported_as_the_last_checkpoint(corpus_cache, tmp_path, caplog):
    """Status named a save as the last checkpoint as soon as it started; one that then failed in
    the background (here: its root became a file) stayed reported while the run went on."""
    run_dir, root = tmp_path / "run", tmp_path / "checkpoints"
    bg = Background(
        load_config(
            small_job_args(
                corpus_cache,
                run_dir,
                **{
                    "train.train_iters": 100_000,
                    "train.eval_interval": 0,
                    "train.control_port": 0,
                    "checkpoint.save": str(root),
                },
            )
        )
    )
    try:
        with caplog.at_level(logging.ERROR, logger="meshtrain.services.checkpoint"):
            wait_for(
                lambda: (run_dir / "control.addr").exists() or not bg.thread.is_alive(),
                what="control.addr",
            )
            with ControlClient(str(run_dir)) as client:
                wait_for(lambda: client.status()["step"] >= 1, what="a first step")
                shutil.rmtree(root, ignore_errors=True)
                root.write_text("")
                client.checkpoint()
                wait_for(
                    lambda: "checkpoint save of step" in caplog.text, what="the save's failure"
                )
                failed_at = client.status()["step"]
                wait_for(
                    lambda: client.status()["step"] > failed_at, what="a step after the failure"
                )
                assert client.status()["last_checkpoint"] is None
                client.stop()
            with pytest.raises(
                CheckpointError, match="Not a directory"
            ):  # the stop's save raises it
                bg.join()
    finally:
        # a failed wait must not leave a 100k-step run behind (its thread aborted pytest's exit)
        if bg.thread.is_alive():
            ControlClient(str(run_dir)).stop()
            bg.thread.join(180)


def test_trainer_gauges_and_rpc_metrics_scraped_over_http(long_run):
    bg, run_dir = long_run
    with ControlClient(str(run_dir)) as client:
        wait_for(lambda: client.status()["step"] >= 2, what="two steps")
        step_seen = client.status()["step"]
        url = f"http://{(run_dir / 'metrics.addr').read_text().strip()}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        values = {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        assert values["meshtrain_trainer_step"] >= step_seen
        assert values["meshtrain_trainer_train_iters"] == 100_000
        assert (
            0 < values["meshtrain_trainer_loss"] < 10
            and values["meshtrain_trainer_tokens_per_s"] > 0
        )
        ok = 'meshtrain_rpc_requests_total{code="OK",method="Status",service="trainer"}'
        assert values[ok] >= 2
        client.stop()
    bg.join()


def test_a_stale_control_address_does_not_reach_the_run_now_on_its_port(long_run, tmp_path):
    """A trainer killed outright leaves its control.addr; the port may since serve another run (a
    fixed train.control_port always does). `meshtrain stop OLD_RUN_DIR` must not stop that run: the
    run token in control.addr is sent with each call and the endpoint refuses another's."""
    bg, run_dir = long_run
    address, token = (run_dir / "control.addr").read_text().split()
    old = tmp_path / "old-run"
    old.mkdir()
    (old / "control.addr").write_text(f"{address}\n{'0' * len(token)}\n")  # the dead run's file
    with pytest.raises(
        MeshtrainError, match="FAILED_PRECONDITION: this endpoint serves another run.* stale"
    ) as refused:
        ControlClient(str(old)).stop()
    # whoever holds a stale token learns nothing of the run now on the port: not its folder
    assert str(tmp_path) not in str(refused.value)
    assert main(["stop", str(old)]) == 2 and main(["save", str(old)]) == 2
    with ControlClient(str(run_dir)) as client:
        assert not client.status()["stop_requested"] and not client.status()["checkpoint_requested"]
    # Without a run token a call is refused too: HOST:PORT given directly,
    # or a file from before tokens.
    (old / "control.addr").write_text(f"{address}\n")
    for target in (address, str(old)):
        with pytest.raises(
            MeshtrainError,
            match="UNAUTHENTICATED: calls to this control endpoint must carry its run token",
        ):
            ControlClient(target).stop()
    assert (
        stat.S_IMODE((run_dir / "control.addr").stat().st_mode) == 0o600
    )  # the token lets its holder stop the run
    with ControlClient(str(run_dir)) as client:
        assert not client.status()["stop_requested"]
        client.stop()
    bg.join()


def _token_files(tmp_path) -> dict[str, str]:
    """The control endpoint's token file (a read and an admin token) and one file per token."""
    tokens = {"read": "r" * 16 + "-control-read", "admin": "a" * 16 + "-control-admin"}
    files = {"server": tmp_path / "tokens"}
    files["server"].write_text("".join(f"{scope} {token}\n" for scope, token in tokens.items()))
    for scope, token in tokens.items():
        files[scope] = tmp_path / f"{scope}.token"
        files[scope].write_text(token + "\n")
    for path in files.values():
        path.chmod(0o600)
    return {name: str(path) for name, path in files.items()}


def test_a_control_endpoint_with_tokens_wants_a_bearer_token_of_the_methods_scope(
    corpus_cache, tmp_path
):
    files = _token_files(tmp_path)
    run_dir = tmp_path / "run"
    job = load_config(
        small_job_args(
            corpus_cache,
            run_dir,
            **{
                "train.train_iters": 100_000,
                "train.eval_interval": 0,
                "train.control_port": 0,
                "auth.token_file": files["server"],
            },
        )
    )
    bg = Background(job)
    wait_for(
        lambda: (run_dir / "control.addr").exists() or not bg.thread.is_alive(), what="control.addr"
    )
    admin = ClientSecurity.from_files(files["admin"])
    try:
        with pytest.raises(
            MeshtrainError, match="UNAUTHENTICATED: .*Status needs a bearer token with scope read"
        ):
            ControlClient(str(run_dir), security=ClientSecurity()).status()
        with ControlClient(
            str(run_dir), security=ClientSecurity.from_files(files["read"])
        ) as client:
            assert client.status()["train_iters"] == 100_000
            with pytest.raises(
                MeshtrainError,
                match="PERMISSION_DENIED: .*/Stop needs scope admin; the token sent has scope read",
            ):
                client.stop()
        assert main(["status", str(run_dir), "--token-file", files["read"]]) == 0
        assert main(["stop", str(run_dir), "--token-file", files["read"]]) == 2
    finally:
        ControlClient(str(run_dir), security=admin).stop()
        bg.join()


def test_a_control_endpoint_beyond_loopback_needs_authentication(corpus_cache, tmp_path):
    job = load_config(
        small_job_args(
            corpus_cache,
            tmp_path / "run",
            **{"train.train_iters": 2, "train.control_port": 0, "train.control_host": "0.0.0.0"},
        )
    )
    with pytest.raises(
        ConfigError,
        match=r"refusing to serve 0\.0\.0\.0:0 without authentication.*auth\.token_file"
        r".*auth\.insecure=true",
    ):
        train(job)


def test_unreachable_or_malformed_targets_are_named(tmp_path):
    with pytest.raises(ConfigError, match="neither a run directory nor HOST:PORT"):
        resolve_address(str(tmp_path / "missing"))
    (tmp_path / "control.addr").write_text("127.0.0.1:1\n")
    with pytest.raises(MeshtrainError, match="127.0.0.1:1: UNAVAILABLE"):
        ControlClient(str(tmp_path), timeout_s=2).status()
    assert main(["status", "127.0.0.1:1"]) == 2
    (tmp_path / "control.addr").write_text("")  # torn: the trainer died while writing it
    with pytest.raises(ConfigError, match="does not start with HOST:PORT"):
        resolve_address(str(tmp_path))


def test_a_busy_metrics_port_is_a_clear_error_and_leaves_no_control_address(corpus_cache, tmp_path):
    import socket

    from meshtrain.services.trainer.rpc.server import serve_control
    from meshtrain.services.trainer.train import Trainer

    trainer = Trainer(
        load_config(small_job_args(corpus_cache, tmp_path, **{"train.train_iters": 1}))
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match=r"cannot serve trainer metrics on 127\.0\.0\.1:\d+"):
            serve_control(trainer, 0, metrics_port=taken.getsockname()[1])
    assert not (tmp_path / "control.addr").exists()


def test_a_checkpoint_request_made_during_a_save_is_kept_for_the_next_step(corpus_cache, tmp_path):
    """A request that reaches the endpoint while a save runs must give a later checkpoint.

    The save is wrapped only to send the second request (over the real endpoint) at the one
    moment that matters; the save itself, the request and the loop are the real ones.
    """
    from meshtrain.services.trainer.rpc.server import serve_control
    from meshtrain.services.trainer.train import Trainer

    run_dir = tmp_path / "run"
    trainer = Trainer(
        load_config(
            small_job_args(
                corpus_cache, run_dir, **{"train.train_iters": 100_000, "train.eval_interval": 0}
            )
        )
    )
    endpoint = serve_control(trainer, 0, metrics_port=None)
    real_save, during = trainer.save, []

    def save():
        if not during:  # the first save: ask again while it runs
            with ControlClient(str(run_dir)) as again:
                during.append(again.checkpoint())
        return real_save()

    trainer.save = save
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=trainer.run()), daemon=True)
    thread.start()
    try:
        with ControlClient(str(run_dir)) as client:
            wait_for(lambda: client.status()["step"] >= 1, what="a first step")
            client.checkpoint()
            wait_for(
                lambda: client.status()["last_checkpoint"] is not None, what="the first checkpoint"
            )
            first = int(client.status()["last_checkpoint"].rsplit("_", 1)[1])
            wait_for(
                lambda: int(client.status()["last_checkpoint"].rsplit("_", 1)[1]) > first,
                timeout=30,
                what="the checkpoint asked for during the first save",
            )
            client.stop()
        thread.join(60)
        assert not thread.is_alive()
    finally:
        if thread.is_alive():
            trainer.request_stop()
            thread.join(60)
        endpoint.stop()
    assert during and first >= during[0]
    assert len(list_checkpoints(str(run_dir / "checkpoints"))) >= 2


def test_a_metrics_port_without_the_control_endpoint_is_refused(corpus_cache, tmp_path):
    """Metrics are served beside the control endpoint: alone, the port was silently never opened."""
    args = small_job_args(corpus_cache, tmp_path / "run", **{"train.metrics_port": 0})
    with pytest.raises(ConfigError, match="train.metrics_port=0 .* needs train.control_port"):
        load_config(args)
    load_config(
        small_job_args(
            corpus_cache, tmp_path / "run", **{"train.metrics_port": 0, "train.control_port": 0}
        )
    )


def test_a_stop_names_the_ranks_that_asked_and_why():
    """Each rank's cause travels as a number in the flags' all-reduce; every rank turns the
    reduced numbers back into one line."""
    from meshtrain.services.trainer.run_requests import CONTROL_STOP, cause_code, describe_stop

    sigterm, control = cause_code("SIGTERM"), cause_code(CONTROL_STOP)
    assert cause_code(None) == 0 and sigterm == 15 and control not in (0, sigterm)
    assert describe_stop([0, sigterm]) == "SIGTERM to rank 1"
    assert (
        describe_stop([sigterm, control, 0, sigterm])
        == "SIGTERM to ranks 0, 3; a stop request to rank 1"
    )
    assert describe_stop([sigterm] * 10, limit=3) == "SIGTERM to ranks 0, 1, 2 and 7 more"


def test_status_of_a_finished_run_says_it_finished_with_its_last_step_and_loss(tmp_path):
    from meshtrain.services.common.errors import ConfigError
    from meshtrain.services.trainer.rpc.client import resolve_target

    (tmp_path / "config.toml").write_text("[train]\ntrain_iters = 20\n")
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 10, "loss": 5.5}\n{"step": 20, "loss": 4.25}\n'
    )
    with pytest.raises(ConfigError) as e:
        resolve_target(str(tmp_path))
    assert "the run has finished: last step 20, loss 4.2500" in str(e.value)
    assert "control_port" not in str(e.value)
    (tmp_path / "metrics.jsonl").unlink()  # no metrics: still the control_port question
    with pytest.raises(ConfigError, match="control_port"):
        resolve_target(str(tmp_path))
