"""The device mesh: named process groups for tp, cp, ep, dp, pp, passed explicitly everywhere.

Rank order is Megatron's default `tp-cp-ep-dp-pp` with tp fastest:

    global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so tensor-parallel peers are neighbours (same node, fastest links). Expert parallelism folds ep
out of dp×cp for MoE layers (ep must divide dp×cp): group "ep" is ep consecutive ranks of a
dp×cp group (cp fastest), which split each MoE block's experts and exchange tokens by
all-to-all; group "edp" is the ranks holding the same experts (every ep-th rank of the dp×cp
group, dp·cp/ep of them), over which the experts' gradients are averaged. Every other
parameter is replicated over the whole dp×cp group as without experts. For example tp=2,
dp=4, ep=2 on 8 ranks: dp×cp groups {0,2,4,6} and {1,3,5,7}; ep groups {0,2} {4,6} {1,3}
{5,7}; edp groups {0,4} {2,6} {1,5} {3,7}. There are no module-level groups: code that
communicates takes a `Mesh` (or one of its groups) as an argument.

The same groups make a torch `DeviceMesh` (`Mesh.device_mesh`, dims pp, dp_replicate, dp_shard,
cp, tp, slowest first), so torch-native pieces (FSDP2's `fully_shard`, DTensor) run over them.
dp splits as dp = dp_replicate x dp_shard with dp_shard fastest (dp_rank = dp_shard_rank +
dp_shard x dp_replicate_rank); only fully sharded data parallelism tells the two apart. ep is no
dim of that mesh (it folds out of dp x cp): `Mesh.expert_device_mesh` (dims pp, edp, ep, tp) is
the same ranks seen by the experts. Fully sharded parameters are split over dp_shard and cp
together (cp ranks hold the same parameters): `Mesh.shard_device_mesh` (dims pp, dp_replicate,
dp_shard_cp, tp) flattens the two adjacent dims into one, group "dp_shard_cp".

    init_process_group()                       # under torchrun / srun: reads RANK, WORLD_SIZE, ...
    mesh = Mesh.build(tp=2)                    # dp = world / tp
    mesh = initialize_model_parallel(2)        # Megatron-flavoured spelling of the same two lines
    mesh = initialize_model_parallel(expert_model_parallel_size=2)   # experts split over 2 dp ranks
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshtrain.services.common.errors import ConfigError

AXES = ("tp", "cp", "dp", "pp")
DEVICE_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The DeviceMesh's dims, slowest first (Megatron's rank order: tp fastest)."""


def env_rank_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's or Slurm's environment; (0, 1, 0) when
    alone."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return (
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", 0)),
        )
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return (
            int(os.environ["SLURM_PROCID"]),
            int(os.environ["SLURM_NTASKS"]),
            int(os.environ.get("SLURM_LOCALID", 0)),
        )
    return 0, 1, 0


TIMEOUT_S = 600.0
"""How long a collective waits for a peer before it raises (Megatron's --distributed-timeout-minutes
default, 10): a rank that hangs (SIGSTOP, stuck I/O) is seen by the others only through it."""


def init_process_group(backend: str | None = None, timeout_s: float = TIMEOUT_S) -> None:
    """Initialize torch.distributed from the environment if it is not already (no-op alone).

    Slurm's variables are translated to torchrun's (MASTER_ADDR/PORT must be set by the
    sbatch script). Backend: NCCL with CUDA, gloo otherwise. `timeout_s`: how long a
    collective of the world group waits for a peer (`Mesh.build` gives its groups the same).
    """
    if dist.is_initialized():
        return
    rank, world, local_rank = env_rank_world()
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:  # torch's env:// rendezvous would raise a ValueError with a traceback
        source = (
            "RANK/WORLD_SIZE"
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ
            else "SLURM_PROCID/SLURM_NTASKS"
        )
        raise ConfigError(
            f"rank {rank} of {world} (from {source}) needs {' and '.join(missing)} in its "
            "environment to reach rank 0: under srun, export MASTER_ADDR (rank 0's host) and "
            "MASTER_PORT (a free port there) first; or launch with torchrun or "
            "`meshtrain train --nproc-per-node N`"
        )
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


@dataclass
class Mesh:
    """Process groups of one rank, by axis name, plus the combinations the engine needs.

    Attributes:
        tp, cp, dp, pp, ep: degrees. `*_rank` are this rank's coordinates.
        groups: axis name -> ProcessGroup (None when running alone); also "dp_cp" (gradient
            reduction), "tp_cp" (the ranks splitting one micro-batch's activations: FP8 amaxes),
            "mp" (tp×pp: model-parallel, for norms of sharded tensors), "world", and
            with pp > 1 "pp_ends" (the first and the last pipeline stage of this rank's pipeline:
            the tied word embedding's gradient is summed over it; absent on middle stages).
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    rank: int = 0
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)
    dp_replicate: int = 1
    """Data-parallel replicas of a fully sharded model (hybrid sharding); dp_shard = dp / it."""
    _device_meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The torch DeviceMesh over this mesh's groups (dims `DEVICE_MESH_DIMS`); None alone.
        Made on first use from the groups `build` made (no collective)."""
        if not self.distributed:
            return None
        if "dense" not in self._device_meshes:
            # global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)), dp split
            # as dp_replicate x dp_shard: the ranks laid out (pp, dp_replicate, dp_shard, cp, tp)
            layout = torch.arange(self.world_size).view(
                self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp
            )
            self._device_meshes["dense"] = self._device_mesh(DEVICE_MESH_DIMS, layout)
        return self._device_meshes["dense"]

    @property
    def shard_device_mesh(self) -> DeviceMesh | None:
        """The DeviceMesh (dims pp, dp_replicate, dp_shard_cp, tp) fully sharded parameters are
        split over: dp_shard and cp flattened (cp fastest), as torchtitan shards under context
        parallelism; the same ranks as `device_mesh`. None alone."""
        if not self.distributed:
            return None
        if "shard" not in self._device_meshes:
            layout = torch.arange(self.world_size).view(
                self.pp, self.dp_replicate, self.dp_shard * self.cp, self.tp
            )
            dims = ("pp", "dp_replicate", "dp_shard_cp", "tp")
            self._device_meshes["shard"] = self._device_mesh(dims, layout)
        return self._device_meshes["shard"]

    @property
    def expert_device_mesh(self) -> DeviceMesh | None:
        """With ep > 1, the DeviceMesh (dims pp, edp, ep, tp) of the expert groups; else None."""
        if self.ep == 1:
            return None
        if "expert" not in self._device_meshes:  # a dp x cp index (cp fastest) is (edp, ep)
            edp = self.dp * self.cp // self.ep
            layout = torch.arange(self.world_size).view(self.pp, edp, self.ep, self.tp)
            self._device_meshes["expert"] = self._device_mesh(("pp", "edp", "ep", "tp"), layout)
        return self._device_meshes["expert"]

    def _device_mesh(self, dims: tuple[str, ...], layout: torch.Tensor) -> DeviceMesh:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        groups = [self.groups[d] for d in dims]
        return DeviceMesh.from_group(groups, device, layout, mesh_dim_names=dims)  # type: ignore[arg-type]

    @property
    def dp_shard(self) -> int:
        """Ranks a fully sharded model's parameters are split over (dp / dp_replicate)."""
        return self.dp // self.dp_replicate

    @property
    def dp_shard_rank(self) -> int:
        return self.dp_rank % self.dp_shard

    @property
    def dp_replicate_rank(self) -> int:
        return self.dp_rank // self.dp_shard

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """This (or another) rank's coordinate on each axis."""
        r = self.rank if rank is None else rank
        out = {}
        for axis in AXES:
            size = getattr(self, axis)
            out[axis] = r % size
            r //= size
        return out

    @property
    def tp_rank(self) -> int:
        return self.coords()["tp"]

    @property
    def cp_rank(self) -> int:
        return self.coords()["cp"]

    @property
    def dp_rank(self) -> int:
        return self.coords()["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords()["pp"]

    def group(self, name: str) -> dist.ProcessGroup | None:
        return self.groups.get(name)

    def size(self, name: str) -> int:
        return len(self.ranks.get(name, [self.rank]))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @staticmethod
    def single() -> "Mesh":
        """The trivial mesh of one process (no groups; collectives become no-ops)."""
        return Mesh(
            ranks={
                name: [0]
                for name in (
                    *AXES,
                    *("dp_cp", "tp_cp", "mp", "world", "cp_a2a", "cp_ring", "ep", "edp"),
                    *("dp_shard", "dp_replicate", "dp_shard_cp"),
                )
            }
        )

    @staticmethod
    def build(
        tp: int = 1,
        dp: int | None = None,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        timeout_s: float = TIMEOUT_S,
        cp_a2a: int = 1,
        dp_replicate: int = 1,
    ) -> "Mesh":
        """Create every group for the current process group (collective: all ranks call it).

        Args:
            tp, pp, cp, ep: degrees; dp defaults to world / (tp·pp·cp).
            cp_a2a: context parallelism's all-to-all size (it divides cp): groups "cp_a2a" of
                that many consecutive cp ranks and "cp_ring" across them (1: the ring is the
                whole cp group; cp: the all-to-all is).
            timeout_s: how long the groups' collectives wait for a peer before raising. Passed
                explicitly: `new_group` does not inherit the world group's timeout but takes
                torch's default (30 min), so a hung peer held every tp/dp collective that long.
            dp_replicate: replicas of a fully sharded model (it divides dp); the parameters
                are split over the dp / dp_replicate ranks of each replica ("dp_shard").
        """
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        model = tp * pp * cp
        if world % model:
            raise ConfigError(f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
        dp = dp if dp is not None else world // model
        if tp * cp * dp * pp != world:
            raise ConfigError(f"tp*cp*dp*pp = {tp}*{cp}*{dp}*{pp} != world size {world}")
        if cp % cp_a2a:
            raise ConfigError(
                f"the context-parallel all-to-all size {cp_a2a} must divide parallel.cp={cp}"
            )
        if (dp * cp) % ep:
            raise ConfigError(f"parallel.ep={ep} must divide dp*cp = {dp * cp}")
        if dp_replicate < 1 or dp % dp_replicate:
            raise ConfigError(
                f"parallel.dp_replicate={dp_replicate} must divide the data-parallel size {dp}"
            )
        mesh = Mesh(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, rank=rank, dp_replicate=dp_replicate)
        combos = {
            "tp": ("tp",),
            "cp": ("cp",),
            "dp": ("dp",),
            "pp": ("pp",),
            "dp_cp": ("cp", "dp"),
            "tp_cp": ("tp", "cp"),
            "mp": ("tp", "pp"),
            "world": AXES,
        }
        for name, axes in combos.items():
            members = mesh._members(axes)
            mesh.ranks[name] = next(m for m in members if rank in m)
            for m in members:  # new_group is collective: every rank creates every group
                g = (
                    dist.new_group(m, timeout=datetime.timedelta(seconds=timeout_s))
                    if world > 1
                    else None
                )
                if rank in m:
                    mesh.groups[name] = g
        mesh._build_cp_subgroups(cp_a2a, timeout_s)
        mesh._build_expert_groups(timeout_s)
        if pp > 1:
            ends = [[m[0], m[-1]] for m in mesh._members(("pp",))]
            for m in ends:
                g = dist.new_group(m, timeout=datetime.timedelta(seconds=timeout_s))
                if rank in m:
                    mesh.groups["pp_ends"], mesh.ranks["pp_ends"] = g, m
        if world > 1:
            mesh._build_dp_subgroups(timeout_s)
        return mesh

    def _build_dp_subgroups(self, timeout_s: float) -> None:
        """The "dp_shard" and "dp_replicate" groups (one of them is the dp group whenever the
        other is of size 1), and "dp_shard_cp" (the dp_shard x cp ranks of one replica: dp_shard
        without cp, dp_cp without replicas). Collective."""
        shard_members = [
            [m[r * self.dp_shard + i] for i in range(self.dp_shard)]
            for m in self._members(("dp",))
            for r in range(self.dp_replicate)
        ]
        replicate_members = [
            [m[r * self.dp_shard + i] for r in range(self.dp_replicate)]
            for m in self._members(("dp",))
            for i in range(self.dp_shard)
        ]
        for name, members, same in (
            ("dp_shard", shard_members, self.dp_replicate == 1),
            ("dp_replicate", replicate_members, self.dp_shard == 1),
        ):
            if same:  # the whole dp group: no new group
                self.groups[name], self.ranks[name] = self.groups["dp"], self.ranks["dp"]
                continue
            for m in members:
                g = dist.new_group(m, timeout=datetime.timedelta(seconds=timeout_s))
                if self.rank in m:
                    self.groups[name], self.ranks[name] = g, m
        if self.cp == 1 or self.dp_replicate == 1:
            whole = "dp_shard" if self.cp == 1 else "dp_cp"
            self.groups["dp_shard_cp"], self.ranks["dp_shard_cp"] = (
                self.groups[whole],
                self.ranks[whole],
            )
            return
        n = self.dp_shard * self.cp  # a dp x cp group (cp fastest) is dp_replicate runs of n
        for m in self._members(("cp", "dp")):
            for r in range(self.dp_replicate):
                run = m[r * n : (r + 1) * n]
                g = dist.new_group(run, timeout=datetime.timedelta(seconds=timeout_s))
                if self.rank in run:
                    self.groups["dp_shard_cp"], self.ranks["dp_shard_cp"] = g, run

    def _build_cp_subgroups(self, a2a: int, timeout_s: float) -> None:
        """ "cp_a2a" (consecutive cp ranks) and "cp_ring" (every a2a-th): the whole cp group or
        this rank alone when the other is; new groups only for a hierarchical split."""
        cp_ranks, alone = self.ranks["cp"], [self.rank]
        ring = self.cp // a2a
        if a2a in (1, self.cp):
            whole, single = ("cp_ring", "cp_a2a") if a2a == 1 else ("cp_a2a", "cp_ring")
            self.ranks[whole], self.groups[whole] = cp_ranks, self.groups.get("cp")
            self.ranks[single], self.groups[single] = alone, None
            return
        for name, members in (
            (
                "cp_a2a",
                [
                    [m[g * a2a + i] for i in range(a2a)]
                    for m in self._members(("cp",))
                    for g in range(ring)
                ],
            ),
            (
                "cp_ring",
                [
                    [m[g * a2a + i] for g in range(ring)]
                    for m in self._members(("cp",))
                    for i in range(a2a)
                ],
            ),
        ):
            for m in members:
                g = dist.new_group(m, timeout=datetime.timedelta(seconds=timeout_s))
                if self.rank in m:
                    self.groups[name], self.ranks[name] = g, m

    def _build_expert_groups(self, timeout_s: float) -> None:
        """ "ep" (ep consecutive ranks of a dp x cp group, cp fastest: the ranks that split the
        experts) and "edp" (every ep-th: the ranks holding the same experts, over which expert
        gradients are reduced); with ep 1 they are this rank alone and the dp x cp group."""
        if self.ep == 1:
            self.ranks["ep"], self.groups["ep"] = [self.rank], None
            self.ranks["edp"], self.groups["edp"] = self.ranks["dp_cp"], self.groups.get("dp_cp")
            return
        n = self.dp * self.cp
        for name, pick in (
            (
                "ep",
                lambda m: [
                    [m[g * self.ep + i] for i in range(self.ep)] for g in range(n // self.ep)
                ],
            ),
            (
                "edp",
                lambda m: [
                    [m[g * self.ep + i] for g in range(n // self.ep)] for i in range(self.ep)
                ],
            ),
        ):
            for members in self._members(("cp", "dp")):
                for m in pick(members):
                    g = dist.new_group(m, timeout=datetime.timedelta(seconds=timeout_s))
                    if self.rank in m:
                        self.groups[name], self.ranks[name] = g, m

    def host_group(
        self, axis: str, timeout_s: float = TIMEOUT_S
    ) -> tuple[dist.ProcessGroup, list[int]]:
        """A gloo group (host tensors, whatever the backend) of this rank's `axis` group, and its
        ranks. Collective: every rank calls it, and every such group of the axis is made."""
        mine = None
        for members in self._members(
            (axis,)
        ):  # new_group is collective: every rank makes every group
            group = dist.new_group(
                members, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
            )
            if self.rank in members:
                mine = (group, members)
        assert mine is not None  # the groups of an axis cover every rank
        return mine

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group (which slice of the experts it holds)."""
        return self.ranks.get("ep", [self.rank]).index(self.rank)

    @property
    def edp_rank(self) -> int:
        """This rank's index among the ranks holding the same experts (0 writes them to
        checkpoints)."""
        return self.ranks.get("edp", [self.rank]).index(self.rank)

    def _members(self, axes: tuple[str, ...]) -> list[list[int]]:
        """All rank lists that vary along `axes` with the other coordinates fixed."""
        sizes = {a: getattr(self, a) for a in AXES}
        strides, s = {}, 1
        for a in AXES:
            strides[a] = s
            s *= sizes[a]
        fixed = [a for a in AXES if a not in axes]
        groups = []

        def rec(i: int, base: int) -> None:
            if i == len(fixed):
                members = [base]
                for a in axes:
                    members = [m + k * strides[a] for m in members for k in range(sizes[a])]
                groups.append(sorted(members))
                return
            a = fixed[i]
            for k in range(sizes[a]):
                rec(i + 1, base + k * strides[a])

        rec(0, 0)
        return groups


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    cp_comm_type: str = "p2p",
    hierarchical_context_parallel_sizes: list[int] | None = None,
) -> Mesh:
    """Megatron-style entry point: init the process group from the environment, return the Mesh.

    `cp_comm_type` ('p2p', 'a2a', 'a2a+p2p' with `hierarchical_context_parallel_sizes` =
    [all-to-all size, ring size]) lays out the context-parallel groups the model's
    `parallelize_context(model, mesh, cp_comm_type)` will use. `expert_model_parallel_size`
    lays out the "ep" and "edp" groups `expert.parallelize_experts(model, mesh)` uses.

    Raises:
        ConfigError: degrees that do not fit the world size (ep must divide dp x cp).
    """
    if cp_comm_type == "a2a+p2p":
        sizes = hierarchical_context_parallel_sizes
        if not sizes or len(sizes) != 2 or sizes[0] * sizes[1] != context_parallel_size:
            raise ConfigError(
                "cp_comm_type='a2a+p2p' needs hierarchical_context_parallel_sizes = [all-to-all "
                f"size, ring size] multiplying to context_parallel_size={context_parallel_size}, "
                f"got {sizes}"
            )
        a2a = sizes[0]
    else:
        a2a = context_parallel_size if cp_comm_type == "a2a" else 1
    init_process_group()
    return Mesh.build(
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        ep=expert_model_parallel_size,
        cp_a2a=a2a,
    )
