"""Expert parallelism: each MoE block's experts split over the ep ranks, tokens moved by all-to-all.

`parallelize_experts(model, mesh)` gives every MoE block a `GroupedExperts` holding only this ep
rank's `num_experts / ep` experts (global ids `first_expert ..`, first_expert = ep_rank *
num_local), sliced from the full weights, so one seed builds the same model at any ep; and an
`AllToAllDispatcher` that sends each permuted token row to the rank owning its expert and brings
the expert's output back:

    rows in global-expert order (this rank's tokens)
      -> all-to-all over ep (uneven splits: rows per destination rank)
      -> (source rank, local expert)-major rows, reordered to local-expert-major
      -> grouped GEMMs on the local experts
      -> the inverse reorder, the reverse all-to-all
      -> rows in the order the block gave them

Both all-to-alls are differentiable (`mappings.all_to_all`: the backward of one is the other's
exchange), so the experts' gradients come from every ep rank's tokens. The ep ranks are ep
consecutive ranks of a dp x cp group (`Mesh`): each has its own tokens; the ranks holding the same
experts ("edp") average the experts' gradients (`DataParallel`). Expert weight parameters carry
`expert_shard = (first_expert, num_experts)` (and, under tensor parallelism, `tp_split`).

It also points every block's load-balancing statistics at the ranks of one global micro-batch
(`tensor.set_moe_shares`), which any data-parallel MoE run needs, ep or not: call it for every
MoE model (ep = 1 leaves the experts whole and the dispatcher local).

    mesh = Mesh.build(ep=2)                 # 2 ranks: dp=2, each dp pair splits the experts
    model = parallelize_experts(parallelize(GPT(cfg), mesh), mesh)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.model.moe import GroupedExperts, LocalDispatcher, MoE, moe_layers
from meshtrain.services.trainer.parallel import mappings as M
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor import set_moe_shares
from meshtrain.services.trainer.parallel.tensor_layers import reshard_param


def expert_major_order(recv_counts: torch.Tensor, total: int) -> torch.Tensor:
    """Rows received grouped by (source rank, local expert) -> permutation to local-expert-major.

    Args:
        recv_counts: (ep, num_local) rows from each source rank for each local expert.
        total: recv_counts.sum() (known on the host from the split sizes: no sync here).

    Returns:
        (total,) int64: position j of the expert-major order takes received row order[j].
    """
    ep, n = recv_counts.shape
    dev = recv_counts.device
    by_source = recv_counts.flatten()  # block (s, l) at s*n + l, in received order
    by_expert = recv_counts.t().flatten()  # block (l, s) at l*ep + s, in expert-major order
    start_source = torch.cumsum(by_source, 0) - by_source
    start_expert = torch.cumsum(by_expert, 0) - by_expert
    block = torch.repeat_interleave(
        torch.arange(ep * n, device=dev), by_expert, output_size=total
    )  # (total,)
    expert, source = block // ep, block % ep
    return torch.arange(total, device=dev) - start_expert[block] + start_source[source * n + expert]


class AllToAllDispatcher:
    """Moves permuted rows to the ep ranks owning their experts and back (replaces
    `LocalDispatcher`).

    Holds the split sizes and the permutation from `dispatch` until the matching `combine`
    (a block calls them back to back, also when recomputed).
    """

    def __init__(self, group: dist.ProcessGroup | None, ep: int, num_experts: int):
        if num_experts % ep:
            raise ConfigError(f"parallel.ep={ep} must divide model.num_experts={num_experts}")
        self.group, self.ep, self.num_local = group, ep, num_experts // ep
        self._pending: tuple[list[int], list[int], torch.Tensor, int] | None = None

    def dispatch(
        self, rows: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rows (n, hidden) in global expert order, counts (experts,) -> (rows, counts) of the
        local experts. Rows past counts.sum() (choices a capacity dropped) stay here.

        Returns:
            (m, hidden) rows for this rank's experts from every ep rank, local-expert-major (source
            rank order inside an expert), and (num_local,) int64 rows per local expert.
        """
        send = counts.view(self.ep, self.num_local).contiguous()  # (dest rank, its local expert)
        recv = torch.empty_like(send)  # (source rank, local expert)
        dist.all_to_all_single(recv, send, group=self.group)
        splits = torch.cat(
            [send.sum(1), recv.sum(1)]
        ).tolist()  # the one host sync: the split sizes
        send_splits, recv_splits = splits[: self.ep], splits[self.ep :]
        n = rows.shape[0]
        rows = rows[: sum(send_splits)]  # (kept, hidden)
        got = M.all_to_all(rows, self.group, recv_splits, send_splits)  # (m, hidden), source-major
        order = expert_major_order(recv, sum(recv_splits))
        self._pending = (send_splits, recv_splits, order, n)
        return got.index_select(0, order), recv.sum(0)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """The local experts' outputs (as `dispatch` returned them) -> outputs of the rows it was
        given."""
        if self._pending is None:
            raise RuntimeError("AllToAllDispatcher.combine without a dispatch before it")
        send_splits, recv_splits, order, n = self._pending
        self._pending = None
        source_major = rows.new_zeros(rows.shape).index_copy(0, order, rows)  # undo the reorder
        back = M.all_to_all(source_major, self.group, send_splits, recv_splits)  # (kept, hidden)
        if back.shape[0] == n:
            return back
        return torch.cat([back, back.new_zeros(n - back.shape[0], back.shape[1])])  # dropped


def _local_experts(moe: MoE, ep_rank: int, ep: int) -> GroupedExperts:
    """A GroupedExperts of this rank's experts, weights sliced from the block's full ones."""
    full = moe.experts
    n = moe.num_experts // ep
    first = ep_rank * n
    local = GroupedExperts(moe.config, num_local=n, first_expert=first)
    for name in ("fc1", "fc2"):
        old = getattr(full, name).weight
        # (experts, ...) -> (n, ...); a tensor-parallel split (dims 1 and 2) is kept
        getattr(local, name).weight = reshard_param(
            old, old[first : first + n], expert_shard=(first, moe.num_experts)
        )
    return local.to(full.fc1.weight.device)


def parallelize_experts(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Split every MoE block's experts over mesh.ep, in place; returns the model.

    Also sets each block's `stats_group` and `aux_share_scale` for the mesh (needed at ep = 1
    too whenever dp x cp > 1). Before or after `tensor.parallelize`.

    Args:
        model: a GPT (or a pipeline stage) built with full weights, the same seed on every rank.
        mesh: the layout; its "ep" group exchanges the tokens.

    Raises:
        ConfigError: ep > 1 on a model without MoE blocks; ep not dividing model.num_experts;
            blocks whose experts were split already; a capacity factor under context
            parallelism (capacity is counted per sequence, and a cp rank holds only part of
            each).
    """
    layers = moe_layers(model)
    if not layers:
        if mesh.ep > 1:
            raise ConfigError(
                f"parallel.ep={mesh.ep} splits experts, but the model has no MoE blocks "
                "(model.num_experts unset)"
            )
        return model
    cfg = layers[0][1].config
    if layers[0][1].num_experts % mesh.ep:
        raise ConfigError(f"parallel.ep={mesh.ep} must divide model.num_experts={cfg.num_experts}")
    if mesh.cp > 1 and cfg.moe_expert_capacity_factor is not None:
        raise ConfigError(
            f"model.moe_expert_capacity_factor counts capacity per sequence, and under context "
            f"parallelism (parallel.cp={mesh.cp}) a rank holds only part of each: unset it "
            "(dropless) or train with cp=1"
        )
    for name, moe in layers:
        if moe.experts.num_local != moe.num_experts or not isinstance(
            moe.dispatcher, LocalDispatcher
        ):
            raise ConfigError(
                f"{name}: its experts are split over ep already (parallelize_experts ran twice)"
            )
        if mesh.ep > 1:
            moe.experts = _local_experts(moe, mesh.ep_rank, mesh.ep)
            moe.dispatcher = AllToAllDispatcher(mesh.group("ep"), mesh.ep, moe.num_experts)
        set_moe_shares(moe, mesh)
    return model


def gather_experts(local: torch.Tensor, param: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Every expert of `param`'s kind (leading axis: global experts) from each ep rank's slice.

    Args:
        local: this rank's (num_local, ...) slice (the parameter, its gradient, a moment).
        param: the parameter (`expert_shard` says whether it is split over ep).
        mesh: the layout (collective over ep).
    """
    if getattr(param, "expert_shard", None) is None or mesh.ep == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(mesh.ep)]
    dist.all_gather(parts, local.contiguous(), group=mesh.group("ep"))
    return torch.cat(parts, 0)
