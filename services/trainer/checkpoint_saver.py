"""Saving training checkpoints while the run trains on: the `Checkpointer`.

Every rank hands its boxes (`checkpoint_state`) to one `AsyncSaver` (storage, or the checkpoint
service's client), rank 0 starts each save and commits it once every rank has reported. The
training stall is the device-to-host copy; one save is in flight at a time. A save that fails with
the disk full (DiskFullError) is recorded (`Checkpointer.disk_full`), not raised by the next save,
so the run trains on, and its uncommitted folder is removed once no rank writes into it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshtrain.services.checkpoint.async_save import AsyncSaver, Sink, StorageSink, retry
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.multiwriter import abort_save, begin_save
from meshtrain.services.checkpoint.store import open_root
from meshtrain.services.checkpoint.tokenizer_store import METADATA_KEY, tokenizer_boxes
from meshtrain.services.common.client_security import ClientSecurity
from meshtrain.services.common.errors import CheckpointError, DiskFullError
from meshtrain.services.trainer.checkpoint_state import (
    Parallel,
    TrainedModel,
    TrainState,
    checkpoint_metadata,
    master_loader,
    master_weights,
    optimizer_moments,
    optimizer_step,
    rng_boxes,
    tensor_boxes,
)
from meshtrain.services.trainer.config.sections import JobConfig

if TYPE_CHECKING:
    from meshtrain.services.checkpoint.rpc.client import CheckpointClient

log = logging.getLogger("meshtrain.checkpoint")


class Checkpointer:
    """Saves training state: every rank writes its boxes through one AsyncSaver, rank 0 commits.

    Args:
        root: checkpoint root URL.
        par: the layout.
        asynchronous: return from `save` after the device-to-host copy (else after the commit).
        service_address: a CheckpointService to stream boxes to, instead of writing storage: one
            `host:port`, or several replicas (`host:port,host:port`, `dns:///name:port`).
        direct: with `service_address`, the direct data plane: ranks store their boxes into
            `root` themselves, the service grants and commits each save
            (`checkpoint.service_direct`).
        overwrite: replace committed checkpoints of the same steps (`checkpoint.overwrite`).
        resumed_step: the step the run resumed from, when it loaded from this same root.
        attempts: tries for each stored object, a save's start and its commit
            (`checkpoint.save_attempts`).
        backoff: first retry sleep in seconds, doubling each retry
            (`checkpoint.save_retry_backoff_s`).
        retry_timeout: keep retrying for this many seconds, at least
            (`checkpoint.save_retry_timeout_s`).
        security: token and TLS for the checkpoint service (`auth`; None: $MESHTRAIN_TOKEN if set).
    """

    def __init__(
        self,
        root: str,
        par: Parallel,
        asynchronous: bool = True,
        service_address: str | None = None,
        overwrite: bool = False,
        resumed_step: int | None = None,
        attempts: int = 3,
        backoff: float = 0.2,
        retry_timeout: float = 0.0,
        security: ClientSecurity | None = None,
        direct: bool = False,
    ):
        self.root, self.par, self.asynchronous, self.overwrite = root, par, asynchronous, overwrite
        mesh = par.mesh
        # The checkpoint service's client, in service mode: the sink, which also starts saves.
        self.client: CheckpointClient | None = None
        self.sink: Sink
        if service_address:
            from meshtrain.services.checkpoint.rpc.client import (
                CheckpointClient,
            )  # grpc only when asked for

            self.sink = self.client = CheckpointClient(
                service_address, security=security, direct_root=root if direct else None
            )
        else:
            self.sink = StorageSink(root)
        self.saver = AsyncSaver(
            self.sink,
            writer_id=mesh.rank,
            num_writers=mesh.world_size,
            attempts=attempts,
            backoff=backoff,
            retry_timeout=retry_timeout,
        )
        self.resumed_step = resumed_step
        self._committed_url: tuple[int, str] | None = None  # (step, URL) of `committed_url`
        self._saving: int | None = None  # the step of the save in flight
        # (step, error) of the newest save that failed with the disk full, until a save commits
        self.disk_full: tuple[int | None, DiskFullError] | None = None
        self._leftovers: list[
            int
        ] = []  # rank 0: folders of such saves, removed once every rank has settled
        self._tokenizer: tuple | None = (
            None  # rank 0: (spec, boxes, record) of the carried tokenizer files
        )

    @property
    def own_latest_step(self) -> int | None:
        """This run's most recent checkpoint under the root, which retention must never delete:
        its last committed save (known on rank 0, the committer), else the step it resumed
        from here. In a root holding an earlier run's higher steps, "keep the highest steps"
        alone would delete it before each save, leaving the run no checkpoint of its own
        until that save commits (and `--load` resuming the other run meanwhile)."""
        committed = self.saver.last_committed
        return committed if committed is not None else self.resumed_step

    @property
    def committed_url(self) -> str | None:
        """URL of this run's newest committed save (known on rank 0, the committer; None before
        one): what may be reported as saved, unlike a save still in flight, which can fail."""
        step = self.saver.last_committed
        if step is None:
            return None
        if self._committed_url is None or self._committed_url[0] != step:
            self._committed_url = (step, self.step_url(step))
        return self._committed_url[1]

    def step_url(self, step: int) -> str:
        """URL of checkpoint `step` under this run's save root."""
        return open_root(self.root).step_url(step)

    def _tokenizer_files(
        self, spec: str | None
    ) -> tuple[list[tuple[ShardSpec, torch.Tensor]], dict | None]:
        """The boxes carrying the run's tokenizer files and their metadata record, read at the
        first save and kept (the files the run started with, whatever happens to them later).
        A tokenizer that cannot be read costs its copy, never the checkpoint: a warning, and
        the checkpoint records the spec alone."""
        if self._tokenizer is None or self._tokenizer[0] != spec:
            try:
                self._tokenizer = (spec, *tokenizer_boxes(spec))
            except CheckpointError as e:
                log.warning("%s; the checkpoints record its spec only", e)
                self._tokenizer = (spec, [], None)
        return self._tokenizer[1], self._tokenizer[2]

    def prepare(self, model: TrainedModel, optimizer: torch.optim.Optimizer | None) -> None:
        """Start allocating the host buffers of this rank's parameter and moment boxes in the
        background (`AsyncSaver.prepare`), so the first save stalls no longer than the others.
        Call it once the model and optimizer are built, in a run that will save. The moments
        are fp32 like their parameters and may not exist yet (AdamW creates them at its first
        step): their boxes are laid out from the parameters."""
        trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        # fp32 whatever the parameter's dtype: bf16 parameters' moments and masters are fp32
        fp32 = {
            n: p if p.dtype == torch.float32 else torch.empty(p.shape, device="meta")
            for n, p in trained.items()
        }
        stand_in = (
            {n: {"exp_avg": t, "exp_avg_sq": t} for n, t in fp32.items()}
            if optimizer is not None
            else {}
        )
        masters = fp32 if master_loader(model, optimizer, self.par) is not None else {}
        self.saver.prepare([spec for spec, _ in tensor_boxes(model, self.par, stand_in, masters)])

    def save(
        self,
        model: TrainedModel,
        optimizer: torch.optim.Optimizer | None,
        state: TrainState,
        job: JobConfig,
        extra: dict[str, Any],
    ) -> str:
        """Start saving checkpoint `state.iteration` (collective); returns its URL on every rank."""
        mesh = self.par.mesh
        boxes = tensor_boxes(
            model,
            self.par,
            optimizer_moments(model, optimizer, self.par),
            master_weights(model, optimizer, self.par),
        )
        boxes += rng_boxes(mesh)
        carried = None
        if mesh.rank == 0:
            tokenizer_files, carried = self._tokenizer_files(extra.get("tokenizer"))
            boxes += tokenizer_files
        metadata = {
            **checkpoint_metadata(state, optimizer_step(optimizer, self.par), job, mesh),
            **extra,
            **({METADATA_KEY: carried} if carried else {}),
        }
        # One save in flight: the previous one must have committed (or raise, unless disk full).
        self.settle()
        if mesh.distributed:
            # Every rank's uploads have ended: nothing writes into a failed save's folder now.
            dist.barrier()
        if mesh.rank == 0:
            self._remove_leftovers()
        save_id = self._begin_save(state.iteration)
        self.saver.save(
            state.iteration, save_id, boxes, committer=mesh.rank == 0, metadata=metadata
        )
        self._saving = state.iteration
        if not self.asynchronous:
            self.wait()
        return self.step_url(state.iteration)

    def _begin_save(self, step: int) -> str:
        """The id of save `step` on every rank (collective).

        Rank 0 starts the save, retried like its writes and commit (a transient storage or
        service error must not cost a stop its checkpoint), and tells every rank the id or
        the failure, so no rank waits for an id that never comes.
        """
        mesh = self.par.mesh
        started: list[tuple[str | None, str | None, bool]] = [(None, None, False)]
        if mesh.rank == 0:

            def begin() -> str:
                if self.client is not None:
                    return self.client.begin_save(step, mesh.world_size, overwrite=self.overwrite)
                return begin_save(self.root, step, overwrite=self.overwrite)

            try:
                started[0] = (
                    retry(
                        f"starting the save of step {step}",
                        begin,
                        self.saver.attempts,
                        self.saver.backoff,
                        self.saver.retry_timeout,
                    ),
                    None,
                    False,
                )
            except CheckpointError as e:
                if not mesh.distributed:
                    if isinstance(e, DiskFullError):
                        raise self._note_disk_full(step, e) from e
                    raise
                started[0] = (None, str(e), isinstance(e, DiskFullError))
        if mesh.distributed:
            dist.broadcast_object_list(started, src=0)
        save_id, error, full = started[0]
        if save_id is None:
            error = error or f"the save of step {step} was not started"
            raise (
                self._note_disk_full(step, DiskFullError(error)) if full else CheckpointError(error)
            )
        return save_id

    def wait(self) -> None:
        """Block until the save in flight is stored and committed on every rank (collective).

        Raises:
            CheckpointError: that save failed (DiskFullError: its storage is full; recorded in
                `disk_full` too).
        """
        step = self._saving
        self.settle()
        if self.par.mesh.distributed:
            dist.barrier()
        if self.par.mesh.rank == 0:
            self._remove_leftovers()
        if step is not None and self.disk_full is not None and self.disk_full[0] == step:
            raise self.disk_full[1]

    def settle(self) -> None:
        """Waits for this rank's part of the save in flight (not collective). One that failed
        with the disk full is recorded in `disk_full` and logged, not raised: a run trains on,
        and its next save tries again (the first that commits clears it, logging that saves
        recovered).

        Raises:
            CheckpointError: the save failed otherwise.
        """
        step, self._saving = self._saving, None
        try:
            self.saver.wait()
        except DiskFullError as e:
            self._note_disk_full(step, e)
            return
        if step is None or self.disk_full is None:
            return
        if self.saver.last_committed == step:
            log.warning(
                "checkpoint saves recovered: step %d is committed under %s (the save of step %d "
                "had failed: disk full)",
                step,
                self.root,
                self.disk_full[0],
            )
            self.disk_full = None
        elif self.par.mesh.rank != 0:
            self.disk_full = None  # its part of this save is stored; rank 0 commits it, and says so

    def poll(self) -> tuple[int | None, DiskFullError] | None:
        """`settle`s a save that has ended, committed or failed with the disk full (never
        blocks; another failure is left for the next `save` to raise); returns `disk_full`."""
        ended, error = self.saver.outcome()
        if ended and (error is None or isinstance(error, DiskFullError)):
            self.settle()
        return self.disk_full

    def _note_disk_full(self, step: int | None, error: DiskFullError) -> DiskFullError:
        """Records and logs that the save of `step` failed with the disk full; returns the error
        to raise where it is raised, naming the root, the step and the latest committed one."""
        mesh = self.par.mesh
        via = (
            f" (through the checkpoint service at {self.client.address})"
            if self.client is not None
            else ""
        )
        latest = ""
        if mesh.rank == 0:  # the committer knows
            own = self.own_latest_step
            latest = (
                f"; the latest committed checkpoint is step {own}"
                if own is not None
                else "; this run has no committed checkpoint yet"
            )
        full = DiskFullError(
            f"checkpoint step {step} was not saved: disk full under {self.root}{via}: {error}; "
            f"nothing of it was committed{latest}"
        )
        full.__cause__ = error
        self.disk_full = (step, full)
        if mesh.rank == 0 and mesh.distributed and self.client is None and step is not None:
            self._leftovers.append(step)
        log.error("%s", full)
        return full

    def _remove_leftovers(self) -> None:
        """Rank 0, once no rank writes into them: removes the uncommitted folders of saves that
        failed with the disk full (a save's only writer removed its own at once). Never a
        committed step's (`multiwriter.abort_save`). Best effort."""
        if not isinstance(self.sink, StorageSink):
            return  # only saves to storage note leftovers (`_note_disk_full`)
        while self._leftovers:
            step = self._leftovers.pop()
            try:
                if abort_save(self.sink.root, step):
                    log.info(
                        "removed the uncommitted folder of the failed save of step %d under %s",
                        step,
                        self.root,
                    )
            except Exception as e:  # noqa: BLE001 - leftovers are ignored by readers, collected by retention
                log.warning(
                    "could not remove the folder of the failed save of step %d under %s: %r",
                    step,
                    self.root,
                    e,
                )

    def close_after_failure(self) -> None:
        """`close` for a run that is failing (a peer died, a collective raised): the save in
        flight commits only if every rank's fragment is already stored, else it is given up at
        once (nothing is committed; the previous checkpoint stands) and logged, not raised, so
        the run's own error is the one reported. Without this, rank 0 waited the commit's
        600 s for a dead rank's fragment before it could exit."""
        self.saver.abandon()
        try:
            self.close()
        except CheckpointError as e:
            log.error("the checkpoint in flight was not committed: %s", e)

    def close(self) -> None:
        """Waits for the save in flight, stops the upload thread and, in service mode, closes
        the channel to the checkpoint service (safe to call twice)."""
        try:
            self.saver.close()
        finally:
            if self.client is not None:
                self.client.close()
