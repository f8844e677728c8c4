"""The training loop (single process): data -> model -> AdamW, with eval, metrics and checkpoints.

    meshtrain train --config deploy/configs/tiny.toml --train-iters 50 --save CKPT --run-dir RUN
    meshtrain train --config deploy/configs/tiny.toml --load CKPT --save CKPT   # resume

Each step runs `global_batch_size / micro_batch_size` micro-batches (gradient accumulation),
clips the global gradient norm, and updates with the learning rate of that step. The loop
keeps losses on the device and synchronizes with the host only on logging steps. A run
stopped at step k and resumed from its checkpoint produces exactly the same losses as one
that never stopped (CPU, fp32): data is a pure function of the step, and model, optimizer
and RNG states are restored bit for bit. The steps that put a `Trainer` together (device, mesh,
the sharded model and its wrappers, the checkpointer) are in `build.py`. `Trainer` reads in
that order: its build (data, model, optimizer and restore, the step's forward, checkpointer),
one `train_step`, evaluation and saving, then the loop (`run`) that logs, evaluates and saves
(when it saves, and what a failed save costs: `run_saves.py`).
What differs between objectives (language modeling, DPO, GRPO: batches, head, forward inputs,
extra metrics, evaluation) is the `Objective`'s (objectives/base.py); the step and the loop
are the same for all.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import tomllib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshtrain.services.checkpoint.store import open_root
from meshtrain.services.common.errors import (
    CheckpointError,
    ConfigError,
    MeshtrainError,
)
from meshtrain.services.trainer import run_saves
from meshtrain.services.trainer.build import (
    build_data_parallel,
    build_mesh,
    build_model,
    build_weight_copies,
    check_attention_backend,
    check_coordinate_descent_tuning,
    check_cuda_graph,
    check_document_attention,
    check_kernel_mode,
    compile_model,
    compile_options,
    compiles_per_block,
    log_model_summary,
    open_checkpointer,
    pick_device,
    seed_everything,
    set_kernel_mode,
)
from meshtrain.services.trainer.checkpoint_state import Parallel
from meshtrain.services.trainer.config.load import LAUNCHER_KEYS_ENV, replace
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.cuda_graphs import MicroBatchGraph
from meshtrain.services.trainer.device_uploads import Uploader
from meshtrain.services.trainer.fp8.weights import Fp8WeightCache
from meshtrain.services.trainer.metrics import (
    MetricsLog,
    ModelSize,
    RouterStats,
    model_size,
    peak_tflops,
    plot_losses,
)
from meshtrain.services.trainer.objectives.base import Objective, objective_for
from meshtrain.services.trainer.optim.optimizer import (
    build_optimizer,
    clip_grad_norm,
    offload_bf16_params,
    set_lr,
)
from meshtrain.services.trainer.optim.schedule import lr_at
from meshtrain.services.trainer.resume import refuse_a_root_with_later_steps, resume
from meshtrain.services.trainer.run_dir import make_run_dir, release_run_dir, run_dir_toml
from meshtrain.services.trainer.run_requests import (
    CONTROL_STOP,
    RunRequests,
    agree_on_requests,
)
from meshtrain.services.trainer.step_log import StepLog
from meshtrain.services.trainer.tracking import open_trackers, require_packages
from meshtrain.services.trainer.weight_copies import forward_on_copies

log = logging.getLogger("meshtrain.train")


@dataclass
class TrainResult:
    """What a finished run produced."""

    run_dir: Path
    rank: int = 0
    """Global rank of the process that ran it (only rank 0 writes the run directory)."""
    losses: dict[int, float] = field(default_factory=dict)
    """Train loss at each logged step (1-based step numbers)."""
    eval_losses: dict[int, float] = field(default_factory=dict)
    checkpoint: str | None = None
    """URL of the last checkpoint saved."""
    plot: Path | None = None
    stopped_early: bool = False
    """True when a stop request (SIGTERM, the control endpoint) ended the run before train_iters."""


class Trainer:
    """Owns the model, optimizer, data and run directory of one job."""

    def __init__(self, job: JobConfig):
        set_kernel_mode(job.train)
        self.device = pick_device(job.train.device)
        check_kernel_mode(self.device)
        check_attention_backend(job.model.attention_backend, self.device)
        check_document_attention(job, self.device)
        check_coordinate_descent_tuning(job.train.compile_coordinate_descent_tuning, self.device)
        self.uploader = Uploader(self.device)
        self.mesh = build_mesh(job, self.device)
        self.is_main = self.mesh.rank == 0
        if not self.is_main:
            logging.getLogger("meshtrain").setLevel(logging.WARNING)
        t = job.train
        if t.global_batch_size % (t.micro_batch_size * self.mesh.dp):
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} must be a multiple of "
                f"train.micro_batch_size={t.micro_batch_size} x data-parallel size {self.mesh.dp}"
            )
        # what differs between language modeling, DPO and GRPO (objectives/)
        self.objective: Objective = objective_for(job, self.mesh)
        self.run_dir = make_run_dir(job.log.run_dir, self.mesh)
        self._run_dir_released = False
        try:
            self._build(job)
        except BaseException:
            self.release_run_dir(failed_start=True)  # a trainer that never ran holds no folder
            raise

    def release_run_dir(self, failed_start: bool = False) -> None:
        """Rank 0 lets go of the run directory (`run_dir.release_run_dir`), once; `run` does
        this when it ends, so another process may train into the folder while this one lives.
        failed_start: the run never started; a new folder with nothing in it is removed."""
        if self.is_main and not self._run_dir_released:
            self._run_dir_released = True
            release_run_dir(self.run_dir, failed_start)

    def _build(self, job: JobConfig) -> None:
        """The rest of `__init__`, once the run directory is held: data, model, optimizer and
        restore, the step's forward, checkpointer, in that order (the data first: the model's
        vocabulary is its tokenizer's)."""
        self.job = self._build_data(job)
        seed_everything(self.job.train.seed)
        size = self._build_model()
        resumed_here = self._build_optimizer()
        self._build_forward()
        self.peak = peak_tflops(self.device, self.job.train.peak_tflops)
        log_model_summary(
            self.job, self.mesh, self.device, size, self.fp8, self.weight_copies, self.pipeline
        )
        self._build_checkpointer(resumed_here)
        # Requests from other threads (SIGTERM's relay, the control endpoint), acted on between
        # steps.
        self.requests = RunRequests()
        self.stop_cause: str | None = None  # the agreed stop's cause, which ranks asked and why
        self.progress: dict[str, float | int | str | None] = {
            "step": self.state.iteration,
            "train_iters": self.job.train.train_iters,
            "loss": None,
            "tokens_per_s": None,
            "eta_s": None,
            "last_checkpoint": None,
        }

    def _build_data(self, job: JobConfig) -> JobConfig:
        """This rank's batch sources; returns the job completed by them (the vocabulary size, the
        checkpoint folder), which rank 0 writes to RUN_DIR/config.toml."""
        self.data = self.objective.build_data(job, self.mesh)
        if job.model.vocab_size is None:
            job = replace(job, model={"vocab_size": self.data.vocab_size})
        if job.checkpoint.save is None:
            job = replace(job, checkpoint={"save": str(self.run_dir / "checkpoints")})
        if self.is_main:
            launcher_keys = os.environ.get(LAUNCHER_KEYS_ENV, "").split()
            (self.run_dir / "config.toml").write_text(run_dir_toml(job, launcher_keys))
        return job

    def _build_model(self) -> ModelSize:
        """This rank's share of the model, parallelized over the mesh, and its routers'
        statistics; returns the size of the whole model, whatever this rank holds of it."""
        job = self.job
        self.model, self.fp8, self.pipeline = build_model(job, self.mesh, self.device)
        self.objective.use_head(self.model)  # DPO, GRPO: the policy's loss becomes theirs
        size = model_size(job.model)
        self.flops_per_token, self.num_parameters = size.flops_per_token, size.parameters
        self.active_parameters = size.active_parameters
        # the ranks of one global batch: routing counts add up over them
        batch_group = self.mesh.group("dp_cp") if self.mesh.cp > 1 else self.mesh.group("dp")
        self.router_stats = RouterStats(
            self.model,
            job.model.num_layers,
            batch_group,
            self.mesh.group("pp") if self.mesh.pp > 1 else None,
        )
        return size

    def _build_optimizer(self) -> int | None:
        """The data-parallel wrapper and the optimizer, and the state they resume from; returns
        the step resumed from this run's own checkpoint root, or None (`resume`)."""
        job = self.job
        # optim.offload_bf16_params: the optimizer reads its fp32 host masters, then makes the
        # device parameters bf16 (services/trainer/optim/main_grads.py)
        bf16_params = offload_bf16_params(job.optim, job.train)
        self.ddp = build_data_parallel(
            self.model, self.mesh, job.parallel, job.optim, self.pipeline, bf16_params
        )
        self.optimizer = (
            self.ddp.optimizer
            if self.ddp and self.ddp.optimizer
            else build_optimizer(self.model, job.optim, bf16_params)
        )
        self.par = Parallel(self.mesh, self.ddp)
        self.state, resumed_here = resume(job, self.model, self.optimizer, self.par)
        return resumed_here

    def _build_forward(self) -> None:
        """What a step runs the model through: the bf16 weight copies (and FP8 weights cast from
        them), the compiled forward, autocast, the pipeline's hooks and the CUDA graph."""
        job = self.job
        self.weight_copies = build_weight_copies(self.model, job.train, self.mesh, self.device)
        # this step's FP8 weights, cast with the copies once a step
        # (services/trainer/fp8/weights.py)
        self.fp8_weights = (
            Fp8WeightCache.for_run(self.model, self.fp8) if self.weight_copies is not None else None
        )
        options = compile_options(job.train)
        pipelined = self.pipeline is not None
        fully_sharded = self.ddp is not None and job.parallel.fully_sharded
        self.forward = compile_model(
            self.model, job.train, options, job.parallel, pipelined, fully_sharded
        )
        # what a micro-batch's forward and backward run inside (`_micro_batch`)
        self.weights_held: Callable[
            [dict[str, torch.Tensor] | None], AbstractContextManager[None]
        ] = lambda copies: contextlib.nullcontext()
        if self.weight_copies is None:
            self.train_forward = lambda copies, *batch: self.forward(*batch)
        else:
            per_block = compiles_per_block(job.train, job.parallel, pipelined, fully_sharded)
            self.train_forward, self.weights_held = forward_on_copies(
                self.model, self.forward, per_block, job.train.compile, options
            )
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if job.train.bf16
            else contextlib.nullcontext()
        )
        if self.pipeline is not None:
            self.pipeline.attach(self.ddp, self.autocast)
        self.objective.build(self)  # e.g. DPO's frozen reference, GRPO's rollouts
        self.graph = None
        if job.train.cuda_graph:
            check_cuda_graph(self.device, self.mesh, job)
            copies = self._copies() if self.weight_copies is not None else None
            n_micro = job.train.global_batch_size // job.train.micro_batch_size
            self.graph = MicroBatchGraph(
                functools.partial(self._graph_micro_batch, copies, n_micro),
                list(self.model.parameters()),
                self.device,
            )

    def _build_checkpointer(self, resumed_here: int | None) -> None:
        """The checkpointer, once the root is known to take this run's saves. Opened last, so an
        __init__ that fails (a restore, a config check) leaves no channel to the checkpoint
        service open; `run` closes it."""
        c, job = self.job.checkpoint, self.job
        if not c.overwrite:
            refuse_a_root_with_later_steps(c, self.state.iteration)
        self.checkpointer = open_checkpointer(c, self.par, resumed_here, job.auth)
        self.last_saved: int | None = resumed_here  # newest step saved (or resumed) in c.save
        # the run saves, at its end at the latest
        if c.save and self.state.iteration < job.train.train_iters:
            self.checkpointer.prepare(self.model, self.optimizer)

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over the global batch of `step` (0-based); returns (loss, grad_norm)
        on device."""
        # a middle pipeline stage reads no data: it receives activations and sends gradients
        reads = self.pipeline is None or self.pipeline.reads_data
        micro = self.objective.micro_batches(step, reads)
        set_lr(self.optimizer, lr_at(step, self.job.optim, self.job.train.train_iters))
        copies = None
        if self.weight_copies is not None:
            self.weight_copies.refresh()  # this step's weights: after the last update or a load
            if self.fp8_weights is not None:
                self.fp8_weights.refresh(self.weight_copies.copies)
            copies = self._copies()
        if self.pipeline is not None:
            total = self.pipeline.step(list(self.objective.inputs(micro, self.pipeline.n_micro)))
        else:
            total = self._accumulate(micro, copies)
        if self.ddp is not None:
            self.ddp.finish_grad_sync()
            grad_norm = self.ddp.grad_norm_and_clip(self.job.optim.clip_grad)
            self.optimizer.step()
            self.ddp.gather_params()
            self.ddp.zero_grad()
        else:
            grad_norm = clip_grad_norm(self.model, self.job.optim.clip_grad)
            self.optimizer.step()
            # a captured graph adds into the .grad tensors it was captured with: keep them
            self.optimizer.zero_grad(set_to_none=self.graph is None)
        self.objective.end_step()  # e.g. the step's loss statistics
        if self.fp8 is not None:
            self.fp8.step_end()  # delayed scaling: the next step's scales from this step's amaxes
        # Expert biases move by this step's loads; its statistics are kept for the log.
        self.router_stats.end_step()
        return total, grad_norm

    def _copies(self) -> dict[str, torch.Tensor]:
        """What the model trains on in place of its parameters: the weight copies, and the
        FP8 weights cast from them where there are any (both refreshed in place each step)."""
        assert self.weight_copies is not None  # asked for only where there are copies
        if self.fp8_weights is None:
            return self.weight_copies.copies
        return {**self.weight_copies.copies, **self.fp8_weights.entries}

    def _accumulate(self, micro, copies) -> torch.Tensor:
        """Forward and backward of every micro-batch of a step (no pipeline); the step's loss."""
        total = torch.zeros((), device=self.device)
        for i, inputs in enumerate(self.objective.inputs(micro, len(micro))):
            if self.graph is not None:
                present = [t for t in inputs if t is not None]  # no document ids (refused)
                if not self.graph.captured:  # the first step's start: gradients are zero
                    self.graph.capture(*present)
                    self.router_stats.discard()  # the capture's warm-up routed tokens too
                total += self.graph.replay(*present)
                continue
            last = i == len(micro) - 1
            sync = (
                self.ddp.no_sync()
                if self.ddp is not None and not last
                else contextlib.nullcontext()
            )
            with sync:
                total += self._micro_batch(copies, len(micro), *inputs)
        return total

    def _micro_batch(
        self,
        copies,
        n_micro: int,
        tokens,
        labels,
        mask,
        document_ids=None,
        position_ids=None,
        images=None,
    ) -> torch.Tensor:
        """Forward and backward of one of a step's `n_micro` micro-batches; its (detached) share of
        the loss."""
        with self.weights_held(copies):
            with self.autocast:
                batch: tuple[torch.Tensor | None, ...] = (
                    tokens,
                    labels,
                    mask,
                    document_ids,
                    position_ids,
                )
                if images is not None:  # a text-only model's forward takes no images
                    batch += (images,)
                loss = self.train_forward(copies, *batch) / n_micro
            loss.backward()
        return loss.detach()

    def _graph_micro_batch(self, copies, n_micro: int, tokens, labels, mask, *positions):
        """`_micro_batch` on the CUDA graph's static inputs: (tokens, labels, mask[, position
        ids]); document ids never (`check_cuda_graph`)."""
        position_ids = positions[0] if positions else None
        return self._micro_batch(copies, n_micro, tokens, labels, mask, None, position_ids)

    @property
    def reference(self):
        """The objective's frozen reference model (DPO), or None."""
        return self.objective.reference

    @property
    def rollouts(self):
        """The objective's batches of rollouts (GRPO), or None."""
        return self.objective.rollouts

    def evaluate(self) -> float:
        """The validation loss of the current weights (identical on every rank)."""
        assert self.data.valid is not None
        return self.objective.evaluate()

    def save(self) -> str | None:
        """Start saving the current state (`run_saves.save`: asynchronous unless
        checkpoint.async_save is off); its URL, or None where a disk-full failure is left to the
        next save."""
        return run_saves.save(self)

    def run(self, until_exit: bool = False, keep_run_dir: bool = False) -> TrainResult:
        """Train to `train.train_iters` steps, or until a stop; SIGTERM is a stop meanwhile.
        The run directory is released when it returns or raises (`release_run_dir`).

        Args:
            until_exit: the process ends with the run (`meshtrain train`): a SIGTERM after the
                loop ended is logged, not fatal, until the process exits (`RunRequests`).
            keep_run_dir: the caller releases it (`train`, whose control endpoint removes its
                control.addr after the run: a run let in before that would lose its own).
        """
        try:
            return self._run(until_exit)
        finally:
            if not keep_run_dir:
                self.release_run_dir()

    def _run(self, until_exit: bool) -> TrainResult:
        job, t = self.job, self.job.train
        result = TrainResult(self.run_dir, rank=self.mesh.rank)
        start = self.state.iteration
        if start == t.train_iters:
            # A relaunch of a finished run (a requeue after the last save): success, as in
            # Megatron-LM, so requeue scripts and `meshtrain up` do not see a failure.
            self.checkpointer.close()  # the run ends here: nothing to save
            log.info(
                "the run already finished: its checkpoint is at train.train_iters=%d; nothing to "
                "do (raise --train-iters to continue it)",
                start,
            )
            loaded = job.checkpoint.load
            assert loaded is not None  # a run at train_iters (>= 1) resumed a checkpoint
            result.checkpoint = open_root(loaded).step_url(start)  # the one it loaded
            return result
        if start > t.train_iters:
            self.checkpointer.close()  # the run ends here: nothing to save
            raise CheckpointError(
                f"checkpoint is at step {start}, which is not before "
                f"train.train_iters={t.train_iters}; raise --train-iters to continue"
            )
        tokens_per_step = t.global_batch_size * job.model.seq_length
        try:
            # every rank: none goes on to wait for a main rank that stopped here
            require_packages(job.log)
            trackers = (
                open_trackers(job.log, self.run_dir, tomllib.loads(run_dir_toml(job)))
                if self.is_main
                else []
            )
        except BaseException:
            self.checkpointer.close()  # the run ends before its loop: nothing to save
            raise
        metrics = MetricsLog(
            self.run_dir,
            t.train_iters,
            start,
            job.log.progress if self.is_main else "none",
            trackers,
        )
        with self.requests.sigterm_stops(until_exit):
            failed = True
            try:
                try:
                    self._loop(result, metrics, start, tokens_per_step)
                finally:
                    self.requests.end()
                if self.ddp is not None:
                    self.ddp.wait_param_gather()  # the model a caller gets back is whole
                self.checkpointer.wait()  # the last save is committed before the run returns
                self.progress["last_checkpoint"] = self.checkpointer.committed_url
                if result.checkpoint:
                    log.info("checkpoint committed: %s", result.checkpoint)
                failed = False
            finally:
                metrics.close()
                if failed:  # e.g. a peer died: its fragment of the save in flight never comes
                    self.checkpointer.close_after_failure()
                else:
                    self.checkpointer.close()
        if job.log.plot and self.is_main:
            result.plot = plot_losses(self.run_dir)
        return result

    def _loop(
        self, result: TrainResult, metrics: MetricsLog, start: int, tokens_per_step: int
    ) -> None:
        """Steps `start`..train.train_iters, each logged, evaluated and saved when due; returns
        early after the save of an agreed stop."""
        job, t = self.job, self.job.train
        window = StepLog(self, result, metrics, start, tokens_per_step)
        for step in range(start, t.train_iters):
            loss, grad_norm = self.train_step(step)
            self.state.iteration = step + 1
            self.state.consumed_samples += t.global_batch_size
            window.pending.append((loss, grad_norm))
            n = step + 1
            self.progress["step"] = n  # a Python int: no host sync
            # The first step this run computes is logged too: the run summary shows its loss,
            # and metrics.jsonl must hold every loss the summary reports.
            if n % job.log.log_interval == 0 or n == t.train_iters or n == start + 1:
                window.log(n)
            pause_start = time.perf_counter()
            if self.data.valid is not None and (n % t.eval_interval == 0 or n == t.train_iters):
                result.eval_losses[n] = self.evaluate()
                metrics.eval(n, result.eval_losses[n])
                extra = self.objective.eval_metrics()
                if extra and self.is_main:
                    metrics.write({"step": n, **{f"eval_{k}": v for k, v in extra.items()}})
            stop, checkpoint_now = self._agreed_requests(at_log_step=not window.pending)
            if stop and window.pending:  # alone, a stop is acted on at any step: log what it ran
                window.log(n)
            if stop:
                log.warning(
                    "%s: saving a checkpoint after step %d, then stopping", self.stop_cause, n
                )
            run_saves.save_if_due(self, n, stop or checkpoint_now, stop, result)
            window.paused += time.perf_counter() - pause_start
            if stop and n < t.train_iters:
                log.warning(
                    "stopped at step %d on request; resume with --load %s", n, job.checkpoint.save
                )
                result.stopped_early = True
                return

    def request_stop(self) -> None:
        """Save a checkpoint after the current step and end the run (what SIGTERM does).

        Raises:
            MeshtrainError: the training loop has already ended (nothing would act on it).
        """
        self._refuse_if_finished("stop")
        self.requests.stop(CONTROL_STOP)

    def request_checkpoint(self) -> None:
        """Save a checkpoint after the current step and continue.

        Raises:
            MeshtrainError: the training loop has already ended (nothing would act on it).
        """
        self._refuse_if_finished("checkpoint")
        self.requests.checkpoint()

    def _refuse_if_finished(self, what: str) -> None:
        if self.requests.ended:
            last = self.progress.get("last_checkpoint")
            raise MeshtrainError(
                f"the run's training loop has ended at step {self.progress['step']}, so no {what} "
                f"will follow; its last checkpoint is {last or 'none'}"
            )

    def pending_requests(self) -> tuple[bool, bool]:
        """(stop requested, checkpoint requested) and not yet acted on, on this rank."""
        return self.requests.pending()

    def _agreed_requests(self, at_log_step: bool) -> tuple[bool, bool]:
        """(stop, checkpoint) as every rank sees them (`agree_on_requests`); a stop sets
        `self.stop_cause`."""
        stop, checkpoint, cause = agree_on_requests(
            self.requests, self.mesh, self.device, at_log_step
        )
        if stop or not self.mesh.distributed:
            self.stop_cause = cause
        return stop, checkpoint


def train(job: JobConfig, until_exit: bool = False) -> TrainResult:
    """Run the job to `train.train_iters` steps and return what it produced.

    Args:
        job: the job.
        until_exit: the process ends with the run (`Trainer.run`).
    """
    trainer = Trainer(job)
    t = job.train
    if t.control_port is None or not trainer.is_main:
        return trainer.run(until_exit)
    from meshtrain.services.trainer.rpc.server import serve_control  # grpc only when asked for

    try:
        endpoint = serve_control(
            trainer, t.control_port, host=t.control_host, metrics_port=t.metrics_port, auth=job.auth
        )
    except BaseException:
        # `run`, which would close it and release the folder, never starts.
        trainer.checkpointer.close()
        trainer.release_run_dir(failed_start=True)
        raise
    try:
        return trainer.run(until_exit, keep_run_dir=True)
    finally:
        endpoint.stop()
        trainer.release_run_dir()
