"""The `meshtrain` command as a user runs it: train, resume, inspect, preprocess, errors."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.services.trainer.conftest import corpus_cache, small_job_args  # noqa: F401  (a fixture, found by name)
from tests.small_disk import small_disk

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "deploy" / "configs" / "tiny.toml")


def meshtrain(*args, cwd=None):
    # ROOT first on the path: from another working directory `-m meshtrain.services.cli` would
    # otherwise import whichever checkout the environment has installed, not this one.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "meshtrain.services.cli", *map(str, args)],
        cwd=cwd or ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.e2e
def test_train_then_resume_with_tiny_config(tmp_path):
    small = [
        "--data.default_corpus_bytes=300000",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--data.default_vocab_size=512",
        "--data.split=80,20,0",
        "--eval-interval",
        "4",
        "--eval-iters",
        "2",
        "--log.plot=false",
    ]
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    first = meshtrain(
        "train", "--config", TINY, "--train-iters", 4, "--save", ckpt, "--run-dir", run, *small
    )
    assert first.returncode == 0, first.stderr
    assert f"checkpoint    : {ckpt}/step_00000004" in first.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 4
    listed = meshtrain("ckpt", "list", ckpt)
    assert listed.stdout.split() == ["4"]
    second = meshtrain(
        "train",
        "--config",
        TINY,
        "--train-iters",
        8,
        "--load",
        ckpt,
        "--save",
        ckpt,
        "--run-dir",
        tmp_path / "run2",
        *small,
    )
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr and "at step 4" in second.stderr
    assert meshtrain("ckpt", "list", ckpt).stdout.split() == ["4", "8"]
    inspect = meshtrain("ckpt", "inspect", ckpt)
    assert "layers.attention.qkv.weight" in inspect.stdout and "iteration: 8" in inspect.stdout


@pytest.mark.e2e
def test_a_run_whose_checkpoint_storage_keeps_failing_exits_74_saying_so(tmp_path):
    """A save whose storage failed through its retries (here a read-only disk: EROFS on every
    write) ends the run with exit status 74 and a line naming the failure, not with 2, the
    status of a user's mistake: deploy/train.sh and the Slurm job tell it apart from a crash."""
    with small_disk(tmp_path / "ro", 1, read_only=True) as ro:
        proc = meshtrain(
            "train",
            "--config",
            TINY,
            "--train-iters",
            2,
            "--save-interval",
            1,
            "--save",
            ro / "ckpt",
            "--run-dir",
            tmp_path / "run",
            "--micro-batch-size",
            2,
            "--global-batch-size",
            2,
            "--data.default_corpus_bytes=300000",
            f"--data.cache_dir={tmp_path / 'cache'}",
            "--data.default_vocab_size=512",
            "--data.split=80,20,0",
            "--eval-iters",
            1,
            "--log.plot=false",
            "--checkpoint.save_attempts=1",
        )
    assert proc.returncode == 74, proc.stderr
    assert "meshtrain: error: checkpoint storage failed:" in proc.stderr
    assert "Read-only file system" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_a_run_on_the_embedded_corpus_exports_its_tokenizer_from_any_working_directory(tmp_path):
    """The embedded corpus is cached under the relative `.cache/meshtrain`, and its tokenizer
    was recorded in the checkpoint by that relative path: `ckpt export` run anywhere but the
    training's working directory could not find it and asked for --tokenizer."""
    (tmp_path / "train").mkdir()
    (tmp_path / "elsewhere").mkdir()
    run = meshtrain(
        "train",
        "--config",
        TINY,
        "--train-iters",
        1,
        "--save",
        "ckpt",
        "--run-dir",
        "run",
        "--data.default_corpus_bytes=300000",
        "--data.default_vocab_size=300",
        "--eval-interval",
        "0",
        "--log.plot=false",
        cwd=tmp_path / "train",
    )
    assert run.returncode == 0, run.stderr
    inspect = meshtrain("ckpt", "inspect", tmp_path / "train" / "ckpt", cwd=tmp_path / "elsewhere")
    recorded = re.search(r"tokenizer: (\S+)", inspect.stdout).group(1)
    assert Path(recorded).is_absolute() and Path(recorded).is_file(), inspect.stdout
    out = meshtrain(
        "ckpt",
        "export",
        "--format",
        "hf",
        tmp_path / "train" / "ckpt",
        "hf",
        cwd=tmp_path / "elsewhere",
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "elsewhere" / "hf" / "tokenizer.json").read_bytes() == Path(
        recorded
    ).read_bytes()


@pytest.mark.e2e
def test_user_errors_exit_2_with_the_key_named(tmp_path):
    bad = meshtrain("train", "--config", TINY, "--model.hidden_sz=3")
    assert bad.returncode == 2 and "model.hidden_sz" in bad.stderr and "Traceback" not in bad.stderr
    ep = meshtrain("train", "--expert-model-parallel-size", "2")
    assert ep.returncode == 2 and "parallel.ep=2" in ep.stderr and "model.num_experts" in ep.stderr
    pp = meshtrain("train", "--config", TINY, "--pipeline-model-parallel-size", "2")
    assert pp.returncode == 2 and "parallel.pp=2 needs 2 processes" in pp.stderr
    cp = meshtrain("train", "--config", TINY, "--context-parallel-size", "2")
    assert cp.returncode == 2 and "parallel.cp=2 needs 2 processes" in cp.stderr
    missing = meshtrain("train", "--config", tmp_path / "nope.toml")
    assert missing.returncode == 2 and "nope.toml" in missing.stderr
    empty = meshtrain("ckpt", "inspect", tmp_path)
    assert empty.returncode == 2 and "no committed checkpoint" in empty.stderr


@pytest.mark.e2e
def test_launcher_errors_exit_2_before_any_rank_starts():
    bad = meshtrain("train", "--nproc-per-node", "2", "--config", TINY, "--model.hidden_sz=3")
    assert (
        bad.returncode == 2 and "model.hidden_sz" in bad.stderr and "started rank" not in bad.stderr
    )
    assert "Traceback" not in bad.stderr
    zero = meshtrain("train", "--nproc-per-node", "2", "--grace", "0", "--config", TINY)
    assert zero.returncode == 2 and "--grace must be a positive" in zero.stderr
    alone = meshtrain("train", "--grace", "30", "--config", TINY)
    assert (
        alone.returncode == 2 and "--grace applies to the ranks of --nproc-per-node" in alone.stderr
    )


@pytest.mark.e2e
@pytest.mark.parametrize("missing", [("MASTER_ADDR", "MASTER_PORT"), ("MASTER_PORT",)])
def test_srun_without_master_addr_or_port_is_a_user_error(tmp_path, missing):
    """README: under srun, export MASTER_ADDR/MASTER_PORT first. A rank whose Slurm environment
    lacks them exits 2 with one line naming each variable, not torch's rendezvous traceback."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        SLURM_PROCID="0",
        SLURM_NTASKS="2",
        SLURM_LOCALID="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    for name in missing:
        del env[name]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtrain.services.cli",
            "train",
            "--config",
            TINY,
            "--train-iters",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    error = _errors(proc.stderr)
    assert len(error) == 1 and "SLURM_PROCID" in error[0], proc.stderr
    assert all(name in error[0] for name in missing), error


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("flags", "env", "named"),
    [
        (["--train.kernels=triton"], {}, "train.kernels='triton'"),
        ([], {"MESHTRAIN_KERNELS": "triton"}, "MESHTRAIN_KERNELS=triton"),
        ([], {"MESHTRAIN_KERNELS": "bogus"}, "MESHTRAIN_KERNELS='bogus'"),
    ],
)
def test_kernel_mode_that_cannot_run_is_a_user_error(tmp_path, flags, env, named):
    """README: train.kernels picks auto, triton or reference, MESHTRAIN_KERNELS overrides; the
    Triton kernels run on CUDA. 'triton' on a CPU run, or an unknown mode, exits 2 with one line
    naming the setting before anything is built, not a traceback from the first forward."""
    environ = {k: v for k, v in os.environ.items() if k != "MESHTRAIN_KERNELS"} | env
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtrain.services.cli",
            "train",
            "--config",
            TINY,
            "--train-iters",
            "1",
            "--run-dir",
            str(run),
            *flags,
        ],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    error = _errors(proc.stderr)
    assert len(error) == 1 and named in error[0], proc.stderr
    assert not run.exists()


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["cudnn", "efficient"])
def test_cuda_only_attention_backend_on_cpu_is_a_user_error(tmp_path, backend):
    """README: model.attention_backend pins one of SDPA's backends. cuDNN and memory-efficient
    attention have no CPU kernel: a CPU run that pins one exits 2 naming the key before anything
    is built, not with SDPA's "No viable backend" traceback."""
    run = tmp_path / "run"
    proc = meshtrain(
        "train",
        "--config",
        TINY,
        "--train-iters",
        1,
        f"--model.attention_backend={backend}",
        "--run-dir",
        run,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    error = _errors(proc.stderr)
    assert len(error) == 1 and f"model.attention_backend='{backend}'" in error[0], proc.stderr
    assert not run.exists()


@pytest.mark.e2e
def test_data_from_another_tokenizer_is_a_user_error(tmp_path):
    """README: --data-path must be data preprocessed with the run's tokenizer. Data whose token ids
    pass the model's vocabulary (a BPE's ids under --tokenizer byte) exits 2 naming the id, the
    vocabulary, the tokenizer and the data, not an embedding IndexError traceback."""
    text = tmp_path / "corpus.txt"
    text.write_text(Path(__file__).read_text() * 4)
    assert (
        meshtrain(
            "data",
            "train-tokenizer",
            "--input",
            text,
            "--vocab-size",
            400,
            "--output",
            tmp_path / "tok.json",
        ).returncode
        == 0
    )
    pre = meshtrain(
        "data",
        "preprocess",
        "--input",
        text,
        "--output-prefix",
        tmp_path / "data",
        "--tokenizer",
        tmp_path / "tok.json",
        "--append-eod",
        "--quiet",
    )
    assert pre.returncode == 0, pre.stderr
    proc = meshtrain(
        "train",
        "--config",
        TINY,
        "--train-iters",
        1,
        "--eval-interval",
        0,
        "--split",
        "100,0,0",
        "--data-path",
        tmp_path / "data",
        "--tokenizer",
        "byte",
        "--run-dir",
        tmp_path / "run",
        "--log.plot=false",
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    error = _errors(proc.stderr)
    assert len(error) == 1, proc.stderr
    assert (
        "outside the model's vocabulary of 257 (tokenizer byte)" in error[0]
        and str(tmp_path / "data") in error[0]
    )


@pytest.mark.parametrize("nproc", ["0", "-2"])
def test_nproc_per_node_below_one_is_refused(nproc, monkeypatch, capsys):
    # it fell through to a single in-process run, exit 0, as if the flag were not given
    import meshtrain.services.trainer.train as trainer
    from meshtrain.services.cli import main

    monkeypatch.setattr(trainer, "train", lambda job: pytest.fail("a single process trained"))
    assert main(["train", "--nproc-per-node", nproc, "--config", TINY]) == 2
    assert (
        capsys.readouterr().err
        == f"meshtrain: error: --nproc-per-node needs at least 1 rank (got {nproc})\n"
    )


@pytest.mark.e2e
def test_help_config_lists_keys():
    out = meshtrain("train", "--help-config")
    assert (
        out.returncode == 0
        and "--model.hidden_size" in out.stdout
        and "--tensor-model-parallel-size" in out.stdout
    )


@pytest.mark.e2e
def test_preprocess_and_train_tokenizer(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "\n".join(json.dumps({"text": f"document number {i} " * 20}) for i in range(30)) + "\n"
    )
    out = meshtrain(
        "data",
        "preprocess",
        "--input",
        docs,
        "--output-prefix",
        tmp_path / "ds",
        "--tokenizer",
        "byte",
        "--append-eod",
    )
    assert out.returncode == 0, out.stderr
    from meshtrain.services.dataloader.indexed import IndexedDataset

    ds = IndexedDataset(str(tmp_path / "ds"))
    assert len(ds) == 30 and ds[0][-1] == 256  # EOD appended
    tok = meshtrain(
        "data",
        "train-tokenizer",
        "--input",
        docs,
        "--vocab-size",
        300,
        "--output",
        tmp_path / "t.json",
    )
    assert tok.returncode == 0, tok.stderr and (tmp_path / "t.json").exists()
    none = meshtrain(
        "data",
        "preprocess",
        "--input",
        tmp_path / "*.nothing",
        "--output-prefix",
        tmp_path / "x",
        "--tokenizer",
        "byte",
    )
    assert none.returncode == 2 and "matches no file" in none.stderr


@pytest.mark.e2e
@pytest.mark.dist
def test_nproc_per_node_launches_tensor_parallel_ranks(tmp_path):
    small = [
        "--data.default_corpus_bytes=300000",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--data.tokenizer=byte",
        "--data.split=80,20,0",
        "--eval-interval",
        "0",
        "--log.plot=false",
        "--train-iters",
        "3",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--num-layers",
        "2",
    ]
    run = tmp_path / "run"
    out = meshtrain(
        "train",
        "--nproc-per-node",
        "2",
        "--config",
        TINY,
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--run-dir",
        run,
        *small,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh tp=2 cp=1 pp=1 dp=1 ep=1 (world 2)" in out.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 3
    assert meshtrain("ckpt", "list", run / "checkpoints").stdout.split() == ["3"]


def _losses(run):
    return {
        r["step"]: r["loss"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }


@pytest.mark.slow  # test_cli_ranks and test_topology cover SIGTERM under the launcher and up
@pytest.mark.e2e
def test_sigterm_saves_exits_0_and_resume_continues_identically(tmp_path):
    """Preemption: SIGTERM mid-run commits a checkpoint and exits 0; the next launch resumes from
    it and the losses of both parts equal an uninterrupted run's exactly (CPU, fp32)."""

    small = [
        "--data.default_corpus_bytes=300000",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--data.tokenizer=byte",
        "--data.split=80,20,0",
        "--eval-interval",
        "0",
        "--log.plot=false",
        "--log-interval",
        "1",
        "--train-iters",
        "150",
        "--num-layers",
        "1",
        "--hidden-size",
        "32",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "4",
    ]
    whole = meshtrain("train", "--config", TINY, "--run-dir", tmp_path / "whole", *small)
    assert whole.returncode == 0, whole.stderr[-2000:]
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshtrain.services.cli",
            "train",
            "--config",
            TINY,
            "--save",
            str(ckpt),
            "--run-dir",
            str(tmp_path / "a"),
            *small,
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "a" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (
        not metrics.exists() or len(metrics.read_text().splitlines()) < 5
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    steps = meshtrain("ckpt", "list", ckpt).stdout.split()
    assert len(steps) == 1 and 5 <= int(steps[0]) < 150, (steps, err[-1000:])
    stopped = int(steps[0])
    resumed = meshtrain(
        "train",
        "--config",
        TINY,
        "--load",
        ckpt,
        "--save",
        ckpt,
        "--run-dir",
        tmp_path / "b",
        *small,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    first, second, reference = (
        _losses(tmp_path / "a"),
        _losses(tmp_path / "b"),
        _losses(tmp_path / "whole"),
    )
    assert max(first) == stopped and min(second) == stopped + 1 and max(second) == 150
    combined = {**{s: v for s, v in first.items() if s <= stopped}, **second}
    assert combined == reference


def _errors(text: str) -> list[str]:
    """The 'meshtrain: error:' lines of a command's stderr."""
    return [line for line in text.splitlines() if line.startswith("meshtrain: error:")]


# SIGTERM after the trainer's loop has ended: right after `train()` returns (the summary is yet
# to be printed), or while the interpreter exits (an atexit hook registered before the run's own).
_LATE_SIGTERM_CHILD = """
import atexit, os, signal, sys, time
import meshtrain.services.trainer.train as T
from meshtrain.services.cli import main

def late_sigterm():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)  # handled meanwhile; unhandled, it kills us here

if sys.argv[1] == "exit":
    atexit.register(late_sigterm)  # atexit hooks run last-registered first: this one last
else:
    train = T.train
    def train_then_sigterm(*args, **kwargs):
        result = train(*args, **kwargs)
        late_sigterm()
        return result
    T.train = train_then_sigterm
sys.exit(main(["train", *sys.argv[2:]]))
"""


@pytest.mark.e2e
@pytest.mark.parametrize("when", ["after-run", "exit"])
def test_a_sigterm_after_the_loop_ended_does_not_change_the_exit_status(
    tmp_path, corpus_cache, when
):  # noqa: F811
    """Slurm and torchrun each pass a preemption's SIGTERM on, so a second one can come once the
    run has committed its checkpoint and returned: it killed the process (exit 143) while it
    printed its summary or shut down. Now it is logged and the run exits as it would have (0)."""
    ckpt = tmp_path / "ckpt"
    args = small_job_args(
        corpus_cache,
        tmp_path / "run",
        **{"train.train_iters": 3, "train.eval_interval": 0, "checkpoint.save": str(ckpt)},
    )
    proc = subprocess.run(
        [sys.executable, "-c", _LATE_SIGTERM_CHILD, when, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert f"checkpoint    : {ckpt}/step_00000003" in proc.stdout
    if when == "after-run":
        assert "SIGTERM: the training loop has ended; already stopping" in proc.stderr, proc.stderr[
            -3000:
        ]
    assert meshtrain("ckpt", "list", ckpt).stdout.split() == ["3"]


@pytest.mark.e2e
def test_a_run_dir_config_written_under_up_trains_outside_up_and_up_still_resumes_it(
    tmp_path, corpus_cache
):  # noqa: F811
    """RUN/config.toml of a run under `meshtrain up` held the addresses of up's data worker and
    checkpoint service, dead once up exits: `meshtrain train --config RUN/config.toml` retried
    them until data.service_give_up_s and failed. up's own wiring is left out of it now, so the
    file trains outside up (data in-process, checkpoints straight to the root), and `up --config
    RUN/config.toml` still gives the run new services and resumes it."""
    args = small_job_args(corpus_cache, "RUN", **{"train.train_iters": 3, "train.eval_interval": 0})
    first = meshtrain("up", "--config", TINY, *args, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    text = (tmp_path / "RUN" / "config.toml").read_text()
    outside = meshtrain(
        "train",
        "--config",
        "RUN/config.toml",
        "--train-iters",
        4,
        "--load",
        "RUN/checkpoints",
        "--data.service_give_up_s=10",
        cwd=tmp_path,
    )
    assert outside.returncode == 0, outside.stderr[-3000:]
    assert (
        "resumed from RUN/checkpoints at step 3" in outside.stderr
        and "in-process" in outside.stderr
    )
    config = tomllib.loads(text)
    assert (
        "service_addresses" not in config["data"] and "service_address" not in config["checkpoint"]
    ), text
    again = meshtrain("up", "--config", "RUN/config.toml", "--train-iters", 5, cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "RUN/checkpoints holds committed step 4: the trainer resumes from it" in again.stdout, (
        again.stdout[-3000:]
    )
    assert meshtrain("ckpt", "list", tmp_path / "RUN" / "checkpoints").stdout.split() == [
        "3",
        "4",
        "5",
    ]


# Ctrl-C right after a scheduled save was handed to its upload thread (slowed, so it is still
# in flight when the interrupt lands).
_CTRL_C_CHILD = """
import os, signal, sys, time
import meshtrain.services.checkpoint.async_save as A
import meshtrain.services.trainer.train as T
from meshtrain.services.cli import main

upload = A.AsyncSaver._upload
def slow_upload(self, *args, **kwargs):
    time.sleep(1.0)
    return upload(self, *args, **kwargs)
A.AsyncSaver._upload = slow_upload
save = T.Trainer.save
def save_then_ctrl_c(self):
    url = save(self)
    os.kill(os.getpid(), signal.SIGINT)
    return url
T.Trainer.save = save_then_ctrl_c
# as in a terminal: a shell without job control starts background jobs with SIGINT ignored,
# and Python then installs no KeyboardInterrupt handler
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.e2e
def test_ctrl_c_of_a_single_process_commits_the_save_in_flight_and_exits_130(
    tmp_path, corpus_cache
):  # noqa: F811
    """What README says Ctrl-C does to one `meshtrain train` process (unlike SIGTERM): it
    interrupts the run, saves nothing more, but the save already in flight commits; exit 130."""
    ckpt = tmp_path / "ckpt"
    args = small_job_args(
        corpus_cache,
        tmp_path / "run",
        **{
            "train.train_iters": 40,
            "train.eval_interval": 0,
            "checkpoint.save": str(ckpt),
            "checkpoint.save_interval": 2,
        },
    )
    proc = subprocess.run(
        [sys.executable, "-c", _CTRL_C_CHILD, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 130 and proc.stderr.endswith("meshtrain: interrupted\n"), proc.stderr[
        -3000:
    ]
    assert "committed checkpoint" in proc.stderr.split("saving in the background")[1], proc.stderr[
        -3000:
    ]
    assert meshtrain("ckpt", "list", ckpt).stdout.split() == ["2"]
    assert "Traceback" not in proc.stderr
