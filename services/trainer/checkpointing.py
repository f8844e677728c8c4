"""The trainer's state <-> checkpoint boxes: model, optimizer, RNG and data position.

Every rank saves and loads only its own part of the layout-independent format
(`meshtrain.services.checkpoint`): each parameter is a box of a global array (per-layer tensors
stacked on a leading global-layer axis when every layer 0..n-1 holds them, else one array per layer,
as the experts of MoE blocks between dense ones; tensor-parallel shards at their global offsets,
SwiGLU's fc1 as two boxes, one per half; padded vocabulary rows cut off; an expert-parallel rank's
experts at their global expert ids), written by the dp-rank-0 replica only (experts: by each ep
rank's replica of edp rank 0), so nothing is written twice. AdamW moments are stored per parameter
(`optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`), whole even under the distributed optimizer;
frozen parameters (the router's expert bias) have none. Scalars (iteration, consumed samples,
optimizer step, config, RNG of Python/NumPy) are manifest metadata; global rank 0 commits once every
rank has reported. Saves are asynchronous (`AsyncSaver`): the training stall is the device-to-host
copy; one that fails with the disk full (DiskFullError) is recorded (`Checkpointer.disk_full`), not
raised by the next save, so the run trains on. Loading reads exactly the boxes a rank needs, so any
tp/dp/ep layout loads any checkpoint and a resumed run continues with identical losses.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from meshtrain.services.checkpoint.async_save import AsyncSaver, StorageSink, retry
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.layout import NON_PARAMETER
from meshtrain.services.checkpoint.multiwriter import abort_save, begin_save
from meshtrain.services.checkpoint.reader import (
    latest_step,
    list_checkpoints,
    read_box,
    read_manifest,
    unreadable_manifests,
)
from meshtrain.services.checkpoint.store import open_root
from meshtrain.services.checkpoint.tokenizer_store import METADATA_KEY, tokenizer_boxes
from meshtrain.services.common.config import to_dict
from meshtrain.services.common.errors import CheckpointError, DiskFullError
from meshtrain.services.common.security import ClientSecurity
from meshtrain.services.trainer.checkpoint_boxes import (
    Place,
    is_expert,
    layer_stacks,
    local_pieces,
    save_place,
    stored_places,
)
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.optim.offload import OffloadedAdamW
from meshtrain.services.trainer.parallel.data_parallel import DataParallel
from meshtrain.services.trainer.parallel.fsdp import FullyShardedDataParallel
from meshtrain.services.trainer.parallel.mesh import Mesh

FORMAT = "meshtrain-train/1"
log = logging.getLogger("meshtrain.checkpoint")


@dataclass
class TrainState:
    """Counters a checkpoint restores besides tensors."""

    iteration: int = 0
    consumed_samples: int = 0


@dataclass
class Parallel:
    """What checkpointing needs to know about the layout: the mesh and the DP wrapper."""

    mesh: Mesh
    ddp: DataParallel | FullyShardedDataParallel | None = None


def _moments(
    model: GPT, optimizer: torch.optim.Optimizer | None, par: Parallel
) -> dict[str, dict[str, torch.Tensor]]:
    if par.ddp is not None and par.ddp.dist_opt:
        return par.ddp.full_optimizer_state()  # collective over dp
    if optimizer is None:
        return {}
    names = {p: n for n, p in model.named_parameters()}
    return {
        names[p]: {k: st[k] for k in ("exp_avg", "exp_avg_sq")} for p, st in optimizer.state.items()
    }


def _masters(
    model: GPT, optimizer: torch.optim.Optimizer | None, par: Parallel
) -> dict[str, torch.Tensor]:
    """The fp32 master weights of bf16 device parameters (optim.offload_bf16_params), by name:
    what a checkpoint stores for them (collective over dp under ZeRO-1). Else nothing."""
    if isinstance(par.ddp, DataParallel) and par.ddp.dist_opt and par.ddp.bf16_params:
        return par.ddp.full_master_params()
    if isinstance(optimizer, OffloadedAdamW) and optimizer.bf16_params:
        names = {p: n for n, p in model.named_parameters()}
        return {names[p]: m.detach() for p, m in optimizer.master_of.items()}
    return {}


def _load_masters(
    model: GPT, optimizer: torch.optim.Optimizer | None, par: Parallel
) -> Callable[[dict[str, torch.Tensor]], None] | None:
    """What writes fp32 weights into the masters of bf16 device parameters (and their
    roundings into the parameters), or None where the parameters are the weights."""
    if isinstance(par.ddp, DataParallel) and par.ddp.dist_opt and par.ddp.bf16_params:
        return par.ddp.load_master_params
    if isinstance(optimizer, OffloadedAdamW) and optimizer.bf16_params:
        names = {p: n for n, p in model.named_parameters()}

        def load(weights: dict[str, torch.Tensor]) -> None:
            for p in optimizer.master_of:
                if names[p] in weights:  # a fresh head (`_fresh_score`) keeps its own
                    optimizer.load_master(p, weights[names[p]])

        return load
    return None


def _optimizer_step(optimizer: torch.optim.Optimizer | None, par: Parallel) -> int:
    if par.ddp is not None and par.ddp.dist_opt:
        return par.ddp.optimizer_step_count()
    if optimizer is None:
        return 0
    steps = {int(st["step"]) for st in optimizer.state.values()} or {0}
    if len(steps) != 1:
        raise CheckpointError(f"optimizer parameters disagree on their step count: {sorted(steps)}")
    return steps.pop()


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
        if service_address:
            from meshtrain.services.checkpoint.rpc.client import (
                CheckpointClient,
            )  # grpc only when asked for

            self.sink = CheckpointClient(
                service_address, security=security, direct_root=root if direct else None
            )
        else:
            self.sink = StorageSink(root)
        self.service = bool(service_address)
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
        self.disk_full: tuple[int, DiskFullError] | None = None
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

    def _tensor_boxes(
        self,
        model: GPT,
        moments: dict[str, dict[str, torch.Tensor]],
        masters: dict[str, torch.Tensor] | None = None,
    ) -> list[tuple[ShardSpec, torch.Tensor]]:
        """(box, tensor) of every parameter and moment this rank writes; a parameter with a
        fp32 master (`_masters`: bf16 device parameters) is written as its master."""
        masters = masters or {}
        mesh, v = self.par.mesh, model.vocab_size
        params = dict(model.named_parameters())
        names = params if mesh.pp == 1 else model_parameter_names(model.config)
        stacks = layer_stacks(names)
        # Moments exist for trained parameters only: a family some of whose layers are frozen (a
        # vision encoder's blocks past model.vision.select_layer) stacks its moments only where
        # every layer has them. (Frozen parameters are those this rank holds: a part frozen as a
        # whole has no moments at all, and the encoder sits on one pipeline stage.)
        moment_stacks = layer_stacks(n for n in names if n not in params or params[n].requires_grad)
        boxes: list[tuple[ShardSpec, torch.Tensor]] = []
        # dp and cp replicas hold the same values: one writes. Experts are split over the ep
        # ranks of a dp x cp group: each ep rank's replica in the first such group (edp rank 0)
        # writes its own. (The last pipeline stage's copy of a tied embedding is the first
        # stage's, written there.)
        # Fully sharded (DTensor) parameters: each rank of the first replica writes its own rows
        # (the ranks it is split over include cp's, and for experts edp's).
        first_replica = mesh.dp_rank == 0 and mesh.cp_rank == 0
        own = {
            n: p
            for n, p in params.items()
            if not getattr(p, "pipeline_copy", False)
            and (
                _first_copy(p)
                if isinstance(p, DTensor)
                else (mesh.edp_rank == 0 if is_expert(p) else first_replica)
            )
        }
        tensors = [(n, masters[n] if n in masters else p.detach(), p) for n, p in own.items()]
        tensors += [
            (f"optim.{k}.{n}", t, own[n])
            for n, m in moments.items()
            if n in own
            for k, t in m.items()
        ]
        for name, t, param in tensors:
            place = save_place(name, moment_stacks if name.startswith("optim.") else stacks)
            local, pcs = local_pieces(name, t, param, mesh, v, place)
            for piece in pcs:
                boxes.append((piece.spec, local[piece.local].reshape(piece.spec.shape)))
        return boxes

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

    def prepare(self, model: GPT, optimizer: torch.optim.Optimizer | None) -> None:
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
        masters = fp32 if _load_masters(model, optimizer, self.par) is not None else {}
        self.saver.prepare([spec for spec, _ in self._tensor_boxes(model, stand_in, masters)])

    def save(
        self,
        model: GPT,
        optimizer: torch.optim.Optimizer | None,
        state: TrainState,
        job: JobConfig,
        extra: dict[str, Any],
    ) -> str:
        """Start saving checkpoint `state.iteration` (collective); returns its URL on every rank."""
        mesh = self.par.mesh
        boxes = self._tensor_boxes(
            model, _moments(model, optimizer, self.par), _masters(model, optimizer, self.par)
        )
        boxes += _rng_boxes(mesh)
        carried = None
        if mesh.rank == 0:
            tokenizer_files, carried = self._tokenizer_files(extra.get("tokenizer"))
            boxes += tokenizer_files
        metadata = {
            **_metadata(state, _optimizer_step(optimizer, self.par), job, mesh),
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
                if self.service:
                    return self.sink.begin_save(step, mesh.world_size, overwrite=self.overwrite)
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
        if error is not None:
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

    def poll(self) -> tuple[int, DiskFullError] | None:
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
        via = f" (through the checkpoint service at {self.sink.address})" if self.service else ""
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
        if mesh.rank == 0 and mesh.distributed and not self.service and step is not None:
            self._leftovers.append(step)
        log.error("%s", full)
        return full

    def _remove_leftovers(self) -> None:
        """Rank 0, once no rank writes into them: removes the uncommitted folders of saves that
        failed with the disk full (a save's only writer removed its own at once). Never a
        committed step's (`multiwriter.abort_save`). Best effort."""
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
            if self.service:
                self.sink.close()


def _first_copy(t: DTensor) -> bool:
    """Whether this rank holds the first copy of its rows of fully sharded `t`: index 0 along
    every dim of its device mesh that replicates it (hybrid sharding's dp_replicate)."""
    return all(
        t.device_mesh.get_local_rank(d) == 0
        for d, p in enumerate(t.placements)
        if isinstance(p, Replicate)
    )


def _rng_boxes(mesh: Mesh) -> list[tuple[ShardSpec, torch.Tensor]]:
    """The RNG states this rank saves: the torch generators' on global rank 0, and with pp > 1
    each stage's own (written by the stage's first tp/dp/cp rank)."""
    boxes = []
    if mesh.rank == 0:
        rng = torch.get_rng_state()
        boxes.append(
            (ShardSpec("rng.torch_cpu", tuple(rng.shape), "uint8", (0,), tuple(rng.shape)), rng)
        )
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # This rank's own device: every rank seeds and advances its device's generator
            # alike, so one state restores them all (other visible devices are never used).
            cuda = torch.cuda.get_rng_state().unsqueeze(0)
            boxes.append(
                (
                    ShardSpec(
                        "rng.torch_cuda", tuple(cuda.shape), "uint8", (0, 0), tuple(cuda.shape)
                    ),
                    cuda,
                )
            )
    if mesh.pp > 1 and mesh.tp_rank == 0 and mesh.dp_rank == 0 and mesh.cp_rank == 0:
        # Pipeline stages draw dropout from their generators in different amounts: each
        # stage's own states, one row per stage, so a resume at the same pp is exact.
        r = mesh.pp_rank
        for array, gen in _rng_states().items():
            boxes.append(
                (
                    ShardSpec(
                        f"{array}_by_stage",
                        (mesh.pp, *gen.shape),
                        "uint8",
                        (r, *[0] * gen.dim()),
                        (1, *gen.shape),
                    ),
                    gen.unsqueeze(0),
                )
            )
    return boxes


def _metadata(state: TrainState, optimizer_step: int, job: JobConfig, mesh: Mesh) -> dict:
    """A checkpoint's scalars: its step and data position, the config, the layout that wrote it
    and the Python and NumPy RNG states."""
    np_state = np.random.get_state()
    return {
        "format": FORMAT,
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "optimizer_step": optimizer_step,
        "config": to_dict(job),
        "layout": {
            "tp": mesh.tp,
            "cp": mesh.cp,
            "dp": mesh.dp,
            "pp": mesh.pp,
            "ep": mesh.ep,
            "world_size": mesh.world_size,
        },
        "rng_python": random.getstate(),
        "rng_numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }


def _rng_states() -> dict[str, torch.Tensor]:
    """This process's torch generator states by array name (CUDA: this rank's device, once used)."""
    states = {"rng.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["rng.torch_cuda"] = torch.cuda.get_rng_state()
    return states


def model_parameter_names(config) -> set[str]:
    """Every parameter name of the whole GPT of `config` (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {n for n, _ in GPT(config).named_parameters()}


def _check_model(root: str, meta: dict, model: GPT) -> None:
    """Compares the saved model config with `model` where the shapes cannot tell them apart.

    Refuses a model that would read the checkpoint's attention heads as other heads: the fused
    QKV weight has (heads + 2*groups) * hidden/heads rows, the same for every head count at a
    fixed heads/groups ratio (3*hidden for plain MHA), so GPT-2's 12 heads load into a 4-head
    model with every shape matching and the rows read as other heads' queries, keys and values.
    Warns when the RoPE base or scaling, the norm epsilon or a MoE model's routing (top-k, score
    function, pre-softmax, scaling) differ: the weights then compute another function (an imported
    Llama 3 resumed without rope_theta=500000), but a new RoPE base is also how a context is
    extended on purpose.
    """
    saved = (meta.get("config") or {}).get("model")
    if not isinstance(saved, dict) or "num_attention_heads" not in saved:
        return  # not saved by the trainer or an import: nothing to compare with
    heads = saved["num_attention_heads"]
    groups = saved.get("num_query_groups") or heads
    c = model.config
    if (heads, groups) != (c.num_attention_heads, c.groups):
        raise CheckpointError(
            f"{root}: the checkpoint's model has num_attention_heads={heads} in {groups} query "
            f"groups, but model.num_attention_heads={c.num_attention_heads} in {c.groups} query "
            "groups here: its attention weights would be read as other heads (the shapes happen "
            "to match); set model.num_attention_heads and model.num_query_groups as saved "
            "(`meshtrain ckpt inspect` shows the saved config)"
        )
    rope = [
        "rotary_base",
        "rope_scaling_factor",
        "rope_scaling_low_freq_factor",
        "rope_scaling_high_freq_factor",
        "rope_scaling_original_max_positions",
    ]
    keys = ["norm_epsilon"] + (rope if c.position_embedding_type == "rope" else [])
    if c.num_experts is not None:  # the routing: same weights, other experts chosen or weighted
        keys += [
            "moe_router_topk",
            "moe_router_score_function",
            "moe_router_pre_softmax",
            "moe_router_topk_scaling_factor",
        ]
    defaults = {f.name: f.default for f in fields(c)}  # a saved config leaves out keys set to None
    for key in keys:
        value = saved.get(key, defaults[key])
        if value != getattr(c, key):
            log.warning(
                "%s: the checkpoint's model was saved with model.%s=%s, this run has %s: the "
                "weights compute another function from here on (set it as saved unless the change "
                "is meant)",
                root,
                key,
                value,
                getattr(c, key),
            )


def _model_differences(saved: dict, config) -> list[str]:
    """`model.KEY=NOW (VALUE saved)` for each key of the saved model config `saved` (the
    checkpoint metadata's config.model) that `config` sets otherwise."""
    now = to_dict(config)
    return [
        f"model.{key}={now.get(key)} ({saved.get(key)} saved)"
        for key in [f.name for f in fields(config)]
        if saved.get(key) != now.get(key)
    ]


def _naming_the_settings(
    error: CheckpointError, root: str, meta: dict, model: GPT
) -> CheckpointError:
    """`error` (a tensor the model lacks, or of another shape), led by the model settings in which
    this run differs from the checkpoint's recorded config, which a user knows and can fix: most
    often a resume without the run's own config. Unchanged where the checkpoint records none."""
    saved = (meta.get("config") or {}).get("model")
    differ = _model_differences(saved, model.config) if isinstance(saved, dict) else []
    if not differ:
        return error
    detail = str(error).removeprefix(f"{root}: ")
    shown = ", ".join(differ[:6]) + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
    return CheckpointError(
        f"{root}: this run's model differs from the checkpoint's in {shown}; resume with the run's "
        "own config (--config RUN/config.toml, RUN the run directory that saved it) or set these "
        f"keys as saved. In detail: {detail}"
    )


def refuse_damaged_newer(root: str, latest: int | None) -> None:
    """Raise if a step newer than `latest` (the newest committed one, None: none) has a
    manifest.json no reader accepts.

    A manifest is written whole or not at all, so one that does not parse (or is of a format
    this version cannot read) is storage damage or a newer writer's. Readers pass over such a
    step as uncommitted, so resuming "the latest" would quietly go back to an older step, and
    the run would fail hours later when its save of the damaged step finds the folder taken.
    That is the operator's call: resume the older step on purpose, or delete the damaged one.
    """
    damaged = {
        s: why for s, why in unreadable_manifests(root).items() if latest is None or s > latest
    }
    if not damaged:
        return
    first = min(damaged)
    older = "no committed step" if latest is None else f"committed step {latest}"
    choices = (
        [] if latest is None else [f"resume step {latest} on purpose with --ckpt-step {latest}"]
    )
    choices.append(f"delete the damaged step (meshtrain ckpt delete {root} --step {first})")
    raise CheckpointError(
        f"{root}: checkpoint step(s) {sorted(damaged)}, newer than {older}, hold a manifest.json "
        f"that cannot be read ({damaged[first]}); "
        + " or ".join(choices)
        + f", after `meshtrain ckpt verify {root} --all`"
    )


def restore(
    root: str,
    model: GPT,
    optimizer: torch.optim.Optimizer | None,
    par: Parallel,
    step: int | None = None,
    rng: bool = True,
    masters: torch.optim.Optimizer | None = None,
) -> tuple[TrainState, dict]:
    """Load checkpoint `step` (latest committed if None) into `model` and `optimizer` in place.

    Each rank reads only the boxes its shards cover. `optimizer` None: the weights only (the
    RNG states are restored all the same, unless `rng` is false). The weights of bf16 device
    parameters go into the fp32 masters of the offloaded optimizer that holds them: `optimizer`,
    or `masters` where the moments are not loaded (optim.offload_bf16_params).

    Raises:
        CheckpointError: the checkpoint is missing, corrupt or does not fit the model.
    """
    step, manifest = _training_manifest(root, step)
    meta = manifest.get("metadata", {})
    mesh = par.mesh
    params = dict(model.named_parameters())
    reader = _BoxReader(root, step, manifest, stored_places(manifest), mesh, model.vocab_size)
    _check_model(root, meta, model)
    fresh = _fresh_score(root, meta, model, optimizer)
    load_masters = _load_masters(model, optimizer if optimizer is not None else masters, par)
    if load_masters is None and any(hasattr(p, "main_grad") for p in params.values()):
        raise CheckpointError(
            "the model's bf16 parameters have fp32 master weights in an offloaded optimizer: "
            "pass it (as the optimizer, or as masters= to load the weights alone)"
        )
    try:
        _check_names(root, model, params, set(reader.places) | fresh, mesh)
        weights: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in params.items():
                if name in fresh:
                    continue
                if load_masters is not None and p.requires_grad:  # fp32, into the masters
                    weights[name] = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                    reader.read_into(name, weights[name], p)
                else:
                    reader.read_into(name, p.data, p)
            if load_masters is not None:
                load_masters(weights)
    except CheckpointError as e:
        raise _naming_the_settings(e, root, meta, model) from None
    opt_step = meta["optimizer_step"]
    if opt_step > 0 and optimizer is not None:
        _restore_moments(reader, params, optimizer, par, opt_step)
    if rng:
        _restore_rng(root, step, manifest, mesh)
    return TrainState(meta["iteration"], meta["consumed_samples"]), meta


def _fresh_score(root: str, meta: dict, model: GPT, optimizer) -> set[str]:
    """{"score.weight"} where a reward model starts from the weights of a language model (its
    saved config has no reward head, and only the weights are loaded): the scalar head keeps its
    initialization. Else nothing."""
    saved = (meta.get("config") or {}).get("model") or {}
    if getattr(model.config, "reward_head", False) and not saved.get("reward_head"):
        if optimizer is not None:
            raise CheckpointError(
                f"{root}: a language model's checkpoint (no scalar head) resumed as a reward "
                "model: start from its weights with checkpoint.finetune (--finetune)"
            )
        log.info("%s: a language model's weights; the reward head starts fresh", root)
        return {"score.weight"}
    return set()


def _training_manifest(root: str, step: int | None) -> tuple[int, dict]:
    """(step, manifest) of training checkpoint `step` under `root` (latest committed if None)."""
    if step is None:
        step = latest_step(root)
        refuse_damaged_newer(root, step)
        if step is None:
            raise CheckpointError(f"no committed checkpoint under {root!r}")
    elif step not in list_checkpoints(root):
        raise CheckpointError(f"no committed checkpoint for step {step} under {root!r}")
    manifest = read_manifest(root, step)
    meta = manifest.get("metadata", {})
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{root}: not a meshtrain training checkpoint (format {meta.get('format')!r})"
        )
    _check_position(root, step, meta)
    return step, manifest


def _check_position(root: str, step: int, meta: dict) -> None:
    """Refuses a checkpoint whose recorded position disagrees with itself: a resume starts at
    `iteration` and skips `consumed_samples`, so a wrong one would repeat or skip data in
    silence. The manifest's digest catches an edit; this catches a writer that got them wrong."""

    def count(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    iteration = meta.get("iteration")
    if iteration != step:
        raise CheckpointError(
            f"{root}: checkpoint step {step} records iteration {iteration!r}; a resume would "
            "start from the wrong step"
        )
    for key in ("consumed_samples", "optimizer_step"):
        if not count(meta.get(key)):
            raise CheckpointError(
                f"{root}: checkpoint step {step} records {key} {meta.get(key)!r}, not a count"
            )


def _check_names(
    root: str, model: GPT, params: dict[str, nn.Parameter], stored: set[str], mesh: Mesh
) -> None:
    """Refuse a checkpoint that lacks a parameter of the model or holds one it does not have."""
    missing = [n for n in params if n not in stored]
    if missing:
        raise CheckpointError(
            f"{root}: checkpoint lacks parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    # A pipeline stage holds some of the model's parameters: compare with the whole model's names.
    names = params if mesh.pp == 1 else model_parameter_names(model.config)
    extra = [n for n in stored if not n.startswith(NON_PARAMETER) and n not in names]
    if extra:
        raise CheckpointError(f"{root}: checkpoint has tensors the model does not: {extra[:5]}")


@dataclass
class _BoxReader:
    """Reads the boxes of one checkpoint that this rank's tensors cover."""

    root: str
    step: int
    manifest: dict
    places: dict[str, Place]
    mesh: Mesh
    vocab_size: int

    def read_into(self, name: str, dst: torch.Tensor, param: torch.Tensor) -> None:
        """Fill `dst`, this rank's tensor `name` (of parameter `param`), from the checkpoint."""
        if name not in self.places:
            raise CheckpointError(
                f"{self.root}: checkpoint step {self.step} has no tensor {name!r} (optimizer_step "
                f"{self.manifest.get('metadata', {}).get('optimizer_step')}); load the weights "
                "only (no optimizer) or another step"
            )
        place, v = self.places[name], self.vocab_size
        dst, pcs = local_pieces(name, dst, param, self.mesh, v, place, reading=True)
        dst.zero_()  # padded vocabulary rows are not stored: they restart at zero
        for piece in pcs:
            spec = piece.spec
            entry = self.manifest["arrays"].get(spec.array)
            if entry is None or tuple(entry["shape"]) != spec.global_shape:
                raise self._shape_error(name, spec, entry)
            box = read_box(
                self.root, self.step, spec.array, spec.offsets, spec.shape, self.manifest
            )
            dst[piece.local].copy_(box.view(dst[piece.local].shape))

    def _shape_error(self, name: str, spec: ShardSpec, entry: dict | None) -> CheckpointError:
        have = tuple(entry["shape"]) if entry else None
        v = self.vocab_size
        hint = ""
        if (
            have
            and len(have) == len(spec.global_shape)
            and have[1:] == spec.global_shape[1:]
            and have[0] != spec.global_shape[0]
            and spec.global_shape[0] == v
        ):
            # Only the vocabulary differs: the usual cause is a resume without the run's
            # data flags (another --tokenizer, hence another vocab_size).
            hint = (
                f"; the vocabulary differs ({have[0]} saved, {v} now), most likely a resume "
                f"without the run's data flags: pass --config RUN/config.toml (or the "
                f"run's --tokenizer / --vocab-size)"
            )
        return CheckpointError(
            f"{self.root}: tensor {name!r} is stored as {spec.array!r} of shape {have}; the model "
            f"needs shape {spec.global_shape}{hint}"
        )


def _restore_moments(
    reader: _BoxReader,
    params: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    par: Parallel,
    opt_step: int,
) -> None:
    """AdamW's moments and step count, into the distributed optimizer or `optimizer`."""
    # Frozen parameters (the router's expert bias, moved by its own rule) have no moments.
    trained = {n: p for n, p in params.items() if p.requires_grad}
    moments = {}
    for name, p in trained.items():
        moments[name] = {}
        for k in ("exp_avg", "exp_avg_sq"):
            t = torch.zeros_like(p.data, dtype=torch.float32)
            reader.read_into(f"optim.{k}.{name}", t, p)
            moments[name][k] = t
    if par.ddp is not None and par.ddp.dist_opt:
        par.ddp.load_optimizer_state(moments, opt_step)
    else:
        fused = any(g.get("fused") for g in optimizer.param_groups)
        # an offloaded optimizer keeps its moments on the host: no round trip through the device
        offloaded = isinstance(optimizer, OffloadedAdamW)
        for name, p in trained.items():
            optimizer.state[p] = {
                "step": torch.tensor(float(opt_step), device=p.device if fused else "cpu"),
                **{k: v if offloaded else v.to(p.device) for k, v in moments[name].items()},
            }


def _restore_rng(root: str, step: int, manifest: dict, mesh: Mesh) -> None:
    """The torch (CPU, this rank's CUDA device, or this pipeline stage's own), Python and
    NumPy RNG states the checkpoint saved."""
    arrays, meta = manifest["arrays"], manifest.get("metadata", {})
    rng = arrays["rng.torch_cpu"]["shape"]
    torch.set_rng_state(read_box(root, step, "rng.torch_cpu", (0,), tuple(rng), manifest))
    staged = arrays.get("rng.torch_cpu_by_stage")
    if staged is not None and staged["shape"][0] == mesh.pp:  # saved at this pp: this stage's own
        for array, gen in _rng_states().items():
            entry = arrays.get(f"{array}_by_stage")
            if entry is not None and tuple(entry["shape"][1:]) == tuple(gen.shape):
                row = read_box(
                    root,
                    step,
                    f"{array}_by_stage",
                    (mesh.pp_rank, *[0] * gen.dim()),
                    (1, *gen.shape),
                    manifest,
                )[0]
                (torch.set_rng_state if array == "rng.torch_cpu" else torch.cuda.set_rng_state)(row)
    elif "rng.torch_cuda" in arrays and torch.cuda.is_available():
        shape = tuple(arrays["rng.torch_cuda"]["shape"])
        # Row 0: the saving rank's device (older checkpoints stored every visible device, of
        # which rank 0 only ever advanced its own, device 0). Set on this rank's device.
        state = read_box(root, step, "rng.torch_cuda", (0, 0), (1, shape[1]), manifest)[0]
        torch.cuda.set_rng_state(state)
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in meta["rng_python"]))
    name, keys, *rest = meta["rng_numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))


def _unwrap(model: nn.Module, optimizer, mesh: Mesh | None):
    """(GPT, torch optimizer or None, Parallel) from what a hand-written loop holds: a GPT or
    its DistributedDataParallel wrapper, an optimizer or the wrapper's DistributedOptimizer."""
    from meshtrain.services.trainer.parallel.ddp import (
        DistributedDataParallel,
        DistributedOptimizer,
    )

    ddp = None
    if isinstance(model, DistributedDataParallel):
        model.finish_param_sync()  # a ZeRO-1 step's parameters may still be on their way
        ddp, mesh, model = model.ddp, model.mesh, model.module
    if isinstance(optimizer, DistributedOptimizer):
        optimizer = optimizer.inner
    if not isinstance(model, GPT):
        raise CheckpointError(
            f"checkpoints hold a meshtrain GPT (or its DistributedDataParallel), not a "
            f"{type(model).__name__}"
        )
    return model, optimizer, Parallel(mesh if mesh is not None else Mesh.single(), ddp)


def save_checkpoint(
    root: str,
    step: int,
    model: nn.Module,
    optimizer,
    *,
    mesh: Mesh | None = None,
    consumed_samples: int = 0,
    job: JobConfig | None = None,
    service_address: str | None = None,
    overwrite: bool = False,
) -> str:
    """Save a committed checkpoint of step `step` and return its URL (every rank calls it).

    The same format `meshtrain train` writes: any layout loads it, `meshtrain ckpt export`
    exports it, `meshtrain train --load` resumes from it.

    Args:
        root: checkpoint root (a folder, `file://`, `s3://bucket/prefix`, `memory://`).
        step: the step to save as (the number of optimizer steps taken).
        model: a GPT (sharded by `parallelize` or not) or its `DistributedDataParallel`.
        optimizer: its optimizer (the wrapper's, or a torch AdamW); None saves the weights only.
        mesh: the layout (taken from a DistributedDataParallel; unset: one process).
        consumed_samples: samples trained on so far, recorded for a resume.
        job: the config recorded with the checkpoint (unset: the model's, defaults elsewhere).
        service_address: stream the shards to a checkpoint service (`meshtrain ckpt serve`)
            instead of writing storage from this process.
        overwrite: replace a committed checkpoint of the same step.

    Returns:
        The checkpoint's URL, once it is committed.
    """
    gpt, opt, par = _unwrap(model, optimizer, mesh)
    saver = Checkpointer(
        root, par, asynchronous=False, service_address=service_address, overwrite=overwrite
    )
    try:
        return saver.save(
            gpt, opt, TrainState(step, consumed_samples), job or JobConfig(model=gpt.config), {}
        )
    except BaseException:
        saver.close_after_failure()
        raise
    finally:
        saver.close()


def load_checkpoint(
    root: str,
    model: nn.Module,
    optimizer=None,
    *,
    mesh: Mesh | None = None,
    step: int | None = None,
) -> TrainState:
    """Load checkpoint `step` (unset: the newest committed one) into `model` and `optimizer`, in
    place, whatever layout saved it (collective only in that every rank reads its own part).

    Args:
        root: checkpoint root.
        model: a GPT (sharded or not) or its `DistributedDataParallel`.
        optimizer: its optimizer, to restore the Adam moments too; None: the weights only.
        mesh: the layout (taken from a DistributedDataParallel; unset: one process).
        step: which step; unset: the newest committed one.

    Returns:
        The step and consumed samples the checkpoint recorded.

    Raises:
        CheckpointError: no such checkpoint, a corrupt one, or one that does not fit the model.
    """
    gpt, opt, par = _unwrap(model, optimizer, mesh)
    state, _ = restore(root, gpt, opt, par, step)
    return state
