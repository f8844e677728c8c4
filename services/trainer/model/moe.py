"""Mixture of experts on one device: router, token permutation, grouped expert GEMMs, shared expert.

A MoE block replaces a dense `MLP` in the blocks `ModelConfig.is_moe_layer` names. Per token:

    scores = router(x)                                  # fp32, (tokens, experts)
    experts, weights = top-k(scores [+ expert bias])    # (tokens, k) each
    y = sum_j weights_j * expert_{experts_j}(x)  [+ shared_expert(x) * gate]

Tokens are permuted into expert order (a stable sort of their (token, choice) pairs by expert),
run through the experts as one grouped GEMM per projection (`torch._grouped_mm` where it runs:
CUDA, bf16/fp16, sm90+; elsewhere a loop over the experts, which is also the reference the tests
hold the grouped path to: `model/grouped_gemm.py`), and added back to their tokens weighted by
their routing weight.

Parameters (canonical checkpoint names, experts numbered globally on the leading axis):

    mlp.router.weight            (experts, hidden)             fp32 routing logits
    mlp.router.expert_bias       (experts,)                    auxiliary-loss-free balance
                                                               (no gradient)
    mlp.experts.fc1.weight       (experts, 2*moe_ffn, hidden)  [gate; up] per expert (SwiGLU;
                                                               GELU: moe_ffn rows)
    mlp.experts.fc2.weight       (experts, hidden, moe_ffn)
    mlp.shared_expert.fc{1,2}.*  a dense MLP of moe_shared_expert_intermediate_size
    mlp.shared_expert_gate.weight (1, hidden)

Hooks for `parallel/`: `dispatcher` moves permuted tokens to the ranks owning their experts and
back (`LocalDispatcher` keeps them here); `stats_group` is the process group whose ranks share
one global micro-batch (load-balancing statistics are summed over it); `aux_share_scale`
multiplies this rank's share of the auxiliary losses so the data-parallel gradient mean comes
out right; `loss_scale` is what the trainer multiplies the language-model loss by before
backward (1 / micro-batches), applied to the auxiliary losses' gradients too.

Auxiliary losses never change the forward values: their gradients are injected in backward
(`_InjectAuxGrad`), so the loss the trainer reports stays the language-model loss, and on a
pipeline stage without the head they still reach the router.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshtrain.kernels import dispatch
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.model.grouped_gemm import grouped_linear
from meshtrain.services.trainer.model.main_grad import fused_main_grad
from meshtrain.services.trainer.model.mlp import MLP


# ----------------------------------------------------------------------------- routing
@dataclass
class Routing:
    """One micro-batch's routing decision on this rank.

    Attributes:
        experts: (tokens, k) int64 chosen global expert ids.
        weights: (tokens, k) fp32 routing weights.
        order: (tokens*k,) indices into the flattened choices: the kept ones in expert order
            (stable: ties keep token order), then the dropped ones (none when dropless). Its
            length does not depend on the routing, so torch.compile traces it without a break.
        counts: (experts,) int64 choices kept per expert (sum = kept: order's first rows).
        routed: (experts,) int64 choices per expert before any drop (for statistics).
    """

    experts: torch.Tensor
    weights: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor
    routed: torch.Tensor


def _num_experts(config: ModelConfig) -> int:
    """`config.num_experts`, which every MoE module needs (ModelConfig checks it when MoE is on)."""
    assert config.num_experts is not None, "a MoE module needs model.num_experts"
    return config.num_experts


class Router(nn.Module):
    """Top-k router with softmax or sigmoid scores, optional pre-softmax, scaling and expert
    bias."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e = _num_experts(config)
        self.num_experts, self.topk = e, config.moe_router_topk
        self.score_function = config.moe_router_score_function
        self.pre_softmax = config.moe_router_pre_softmax
        self.scaling = config.moe_router_topk_scaling_factor
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size))
        # Not trained by the optimizer: moved by `update_expert_bias` after each step.
        self.expert_bias = (
            nn.Parameter(torch.zeros(e), requires_grad=False)
            if config.moe_router_enable_expert_bias
            else None
        )

    def forward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, hidden) -> (logits (T, E) fp32, scores (T, E) fp32, experts (T, k), weights
        (T, k) fp32).

        `scores` are what the load-balancing loss averages: softmax over all experts, or the
        sigmoids normalized to sum to 1 per token.
        """
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())  # (T, E)
        if self.score_function == "softmax":
            probs = torch.softmax(logits, dim=-1)
            choose = probs if self.expert_bias is None else probs + self.expert_bias
            experts = torch.topk(choose, self.topk, dim=-1, sorted=True).indices
            if self.pre_softmax:
                weights = probs.gather(-1, experts)
            else:  # softmax among the chosen logits (Mixtral's renormalized top-k)
                weights = torch.softmax(logits.gather(-1, experts), dim=-1)
            scores = probs
        else:
            sig = torch.sigmoid(logits)
            choose = sig if self.expert_bias is None else sig + self.expert_bias
            experts = torch.topk(choose, self.topk, dim=-1, sorted=True).indices
            weights = sig.gather(-1, experts)
            if self.topk > 1:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            scores = sig / (sig.sum(-1, keepdim=True) + 1e-20)
        if self.scaling is not None:
            weights = weights * self.scaling
        return logits, scores, experts, weights


def route(
    experts: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    drop_policy: str,
    tokens_per_group: int,
) -> Routing:
    """Sort the (token, choice) pairs into expert order, dropping beyond `capacity` if set.

    Args:
        experts, weights: (tokens, k) from the router.
        capacity: most choices one expert keeps per group of `tokens_per_group` consecutive
            tokens (one sequence); None: dropless.
        drop_policy: 'probs' keeps an expert's highest-weighted choices, 'position' its earliest.

    Dropped choices are sorted behind the kept ones rather than cut off (a cut would give a
    tensor whose length depends on the routing: a graph break under torch.compile); the block
    computes nothing for them.
    """
    t, k = experts.shape
    flat = experts.reshape(-1)
    routed = expert_counts(flat, num_experts)
    if capacity is None:
        order = torch.sort(flat, stable=True).indices
        return Routing(experts, weights, order, routed, routed)
    # Within each (sequence, expert) pair, rank the choices by the policy; keep rank < capacity.
    group = torch.arange(t * k, device=flat.device) // k // tokens_per_group
    key = group * num_experts + flat  # choices of one expert in one sequence share a key
    if drop_policy == "probs":
        pre = torch.sort(weights.reshape(-1), descending=True, stable=True).indices
    else:
        pre = torch.arange(t * k, device=flat.device)
    by_key = pre[torch.sort(key[pre], stable=True).indices]  # key-major, policy order inside
    sorted_key = key[by_key]
    starts = torch.searchsorted(sorted_key, sorted_key, right=False)
    rank = torch.arange(t * k, device=flat.device) - starts
    dropped = torch.zeros_like(flat, dtype=torch.bool).scatter(0, by_key, rank >= capacity)
    # Expert order for the GEMMs, token order inside each expert (as the dropless path); the
    # dropped choices sort as an expert past the last, so they come after every kept one.
    order = torch.sort(torch.where(dropped, num_experts, flat), stable=True).indices
    counts = torch.zeros_like(routed).scatter_add_(0, flat, (~dropped).long())
    return Routing(experts, weights, order, counts, routed)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(n,) int64 expert ids -> (num_experts,) int64 occurrences of each.

    A scatter-add into a zero vector of fixed length rather than `torch.bincount`, whose output
    length depends on the ids' values: torch.compile cannot trace that without a graph break.
    """
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, experts, torch.ones_like(experts))


def expert_capacity(config: ModelConfig, seq_tokens: int) -> int | None:
    """Choices one expert keeps per sequence of `seq_tokens` tokens; None when dropless."""
    f = config.moe_expert_capacity_factor
    if f is None:
        return None
    return max(1, math.ceil(f * seq_tokens * config.moe_router_topk / _num_experts(config)))


# ----------------------------------------------------------------------------- experts
class StackedWeight(nn.Module):
    """Holds one stacked expert weight (experts, out, in), so the parameter is named
    `<name>.weight` like nn.Linear's; `WeightCopies` gives it a bf16 copy as it does a linear's
    weight.

    Under train.expert_gradient_accumulation_fusion `WeightCopies` also sets `main_weight`, the
    fp32 weight (as `MainGradLinear`'s), whose `.grad` the experts' GEMMs then add into.
    """

    main_weight: tuple[torch.Tensor] | None = None  # in a tuple: not registered twice

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))

    def main_grad(self) -> torch.Tensor | None:
        """The fp32 `.grad` the backward adds this weight's gradient into, or None (through
        autograd): `main_grad.fused_main_grad` of the weight, as `MainGradLinear` takes it."""
        if self.main_weight is None:
            return None
        return fused_main_grad(self.weight, self.main_weight[0])


class GroupedExperts(nn.Module):
    """`num_local` experts as stacked weights: fc1 -> activation -> fc2, on rows in expert order.

    `first_expert` is the global id of local expert 0 (expert parallelism sets it).
    """

    def __init__(self, config: ModelConfig, num_local: int | None = None, first_expert: int = 0):
        super().__init__()
        n = _num_experts(config) if num_local is None else num_local
        f, h = config.moe_ffn_size, config.hidden_size
        self.swiglu = config.activation == "swiglu"
        self.grouped = config.moe_grouped_gemm
        self.num_local, self.first_expert = n, first_expert
        self.fc1 = StackedWeight(n, 2 * f if self.swiglu else f, h)
        self.fc2 = StackedWeight(n, h, f)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (rows, hidden) grouped by local expert (counts (num_local,) rows each) -> (rows,
        hidden)."""
        h = grouped_linear(x, self.fc1.weight, counts, self.grouped, self.fc1.main_grad())
        h = dispatch.swiglu(h) if self.swiglu else dispatch.gelu(h)
        return grouped_linear(h, self.fc2.weight, counts, self.grouped, self.fc2.main_grad())


class Dispatcher(Protocol):
    """Moves a block's permuted rows to the experts that own them and their outputs back:
    `LocalDispatcher` here, parallel/expert's all-to-all over the ep ranks."""

    def dispatch(
        self, rows: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def combine(self, rows: torch.Tensor) -> torch.Tensor: ...


class LocalDispatcher:
    """Every expert is on this rank: permuted rows go straight to the experts and back."""

    def dispatch(
        self, rows: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rows (n, hidden) in global expert order, counts (experts,) -> (rows, counts) for the
        local experts."""
        return rows, counts

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """The local experts' outputs -> the outputs of the rows `dispatch` was given, same
        order."""
        return rows


# ----------------------------------------------------------------------------- aux losses
def _in_backward(like: torch.Tensor) -> bool | torch.Tensor:
    """Whether this code runs inside an autograd backward pass: a forward there is activation
    recompute (torch.utils.checkpoint, reentrant or not, reruns the block while unpacking the
    tensors the backward needs), never a training step's own forward.

    Eager: a bool. While torch.compile traces: a 0-dim bool tensor on `like`'s device that the
    compiled graph computes each time it runs (`in_backward_flag`), since a compiled block that
    recompute reruns must answer for that run, not for the tracing.
    """
    if torch.compiler.is_compiling():
        return in_backward_flag(like)
    return torch._C._current_graph_task_id() != -1


@torch.library.custom_op("meshtrain::moe_in_backward", mutates_args=())
def in_backward_flag(like: torch.Tensor) -> torch.Tensor:
    """`_in_backward` as a 0-dim bool tensor on `like`'s device (a fill: no host-device copy)."""
    return torch.full((), torch._C._current_graph_task_id() != -1, device=like.device)


@in_backward_flag.register_fake
def _(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((), dtype=torch.bool)


def _unless(recomputing: bool | torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value`, or zero where `recomputing` (a traced flag) holds."""
    if isinstance(recomputing, torch.Tensor):
        return torch.where(recomputing, torch.zeros_like(value), value)
    return value


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on `x`; in backward, also d(aux)/d(aux) = scale, so `aux` is trained without
    being added to the reported loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


@dataclass
class MoEStats:
    """A step's routing statistics of one layer (summed over micro-batches, this rank's tokens)."""

    tokens_per_expert: torch.Tensor  # (experts,) choices kept
    routed_per_expert: torch.Tensor  # (experts,) choices before drops
    aux_loss: torch.Tensor  # summed global aux loss values, fp32 scalar
    z_loss: torch.Tensor
    # 0-dim int64 forwards recorded; a tensor, so that counting in a compiled graph neither
    # recompiles (a Python int is specialized on) nor breaks the graph
    micro_batches: torch.Tensor

    def to(self, device: torch.device) -> MoEStats:
        """These statistics on `device`."""
        return MoEStats(
            self.tokens_per_expert.to(device),
            self.routed_per_expert.to(device),
            self.aux_loss.to(device),
            self.z_loss.to(device),
            self.micro_batches.to(device),
        )


class MoE(nn.Module):
    """Router + grouped experts (+ shared expert): a drop-in for `MLP` on (batch, seq, hidden)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.num_experts = _num_experts(config)
        self.router = Router(config)
        self.experts = GroupedExperts(config)
        self.shared_expert = (
            MLP(config, ffn_size=config.moe_shared_expert_intermediate_size)
            if config.moe_shared_expert_intermediate_size
            else None
        )
        self.shared_expert_gate = (
            nn.Linear(config.hidden_size, 1, bias=False) if config.moe_shared_expert_gate else None
        )
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.stats_group: dist.ProcessGroup | None = None
        self.aux_share_scale = 1.0
        self.loss_scale = 1.0
        self.stats = self._empty_stats(torch.device("cpu"))

    def _empty_stats(self, device: torch.device) -> MoEStats:
        z = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        s = torch.zeros((), dtype=torch.float32, device=device)
        return MoEStats(
            z, z.clone(), s, s.clone(), torch.zeros((), dtype=torch.int64, device=device)
        )

    def reset_stats(self) -> MoEStats:
        """Return the statistics gathered since the last reset and start new ones.

        The counters are zeroed in place and a copy returned: a captured CUDA graph
        (train.cuda_graph) adds into the tensors it was captured with, so they must outlive
        every step."""
        counters = [getattr(self.stats, f.name) for f in fields(MoEStats)]
        old = MoEStats(*(t.clone() for t in counters))
        torch._foreach_zero_(counters)
        return old

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (batch, seq, hidden) -> (batch, seq, hidden)."""
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        logits, scores, experts, weights = self.router(flat)
        routing = route(
            experts,
            weights,
            self.num_experts,
            expert_capacity(self.config, s),
            self.config.moe_token_drop_policy,
            s,
        )
        k = experts.shape[1]
        token = routing.order // k
        rows = flat[token]  # (tokens*k, hidden)
        w = weights.reshape(-1)[routing.order].unsqueeze(1)
        kept = None
        if self.config.moe_expert_capacity_factor is not None:
            # The rows past the kept ones are dropped choices. The experts leave their outputs
            # unwritten (torch._grouped_mm; its backward leaves their input gradients so too) or
            # zero: `where`s, not products (0 * an unwritten NaN is NaN), keep them out of both.
            kept = (torch.arange(token.shape[0], device=x.device) < routing.counts.sum())[:, None]
            rows, w = torch.where(kept, rows, 0), torch.where(kept, w, 0)
        rows, local_counts = self.dispatcher.dispatch(rows, routing.counts)
        out_rows = self.dispatcher.combine(self.experts(rows, local_counts))
        if kept is not None:
            out_rows = torch.where(kept, out_rows, 0)
        y = torch.zeros(b * s, h, dtype=out_rows.dtype, device=x.device)
        y = y.index_add(0, token, (out_rows.float() * w).to(out_rows.dtype))
        y = y.view(b, s, h)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x))
            y = y + shared.to(y.dtype)
        # Under activation recompute this forward runs twice: once in the forward pass, once
        # inside the backward (torch.utils.checkpoint rebuilding the block's activations). The
        # rerun must rebuild the same autograd graph (the aux terms' saved tensors included), but
        # its outputs are thrown away, so its _InjectAuxGrad is never backpropagated: the aux
        # gradient comes once, through the first pass's graph. Statistics count the first pass only.
        # Evaluation and generation leave the step's statistics alone.
        if not self.training:
            return y
        recomputing = _in_backward(x)
        aux = z = None
        if torch.is_grad_enabled():
            y, aux, z = self._with_aux_losses(y, logits, scores, routing)
        self._record(routing, aux, z, recomputing)
        return y

    def _with_aux_losses(
        self,
        y: torch.Tensor,
        logits: torch.Tensor,
        scores: torch.Tensor,
        routing: Routing,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Attach the load-balancing and z-loss gradients to `y` (values unchanged).

        Returns:
            y, and the (detached) load-balancing and z-loss values, None for a term that is off.
        """
        c = self.config
        terms = []
        # a fill, not a host-to-device copy: a CUDA graph captures it
        tokens = logits.new_full((), float(logits.shape[0]))
        routed = routing.routed.float()
        if c.moe_aux_loss_coeff > 0 or (c.moe_z_loss_coeff or 0) > 0:
            if (
                self.stats_group is not None
            ):  # global micro-batch: counts and token totals of every rank
                both = torch.cat([routed, tokens.view(1)])
                dist.all_reduce(both, group=self.stats_group)
                routed, tokens = both[:-1], both[-1]
        if c.moe_aux_loss_coeff > 0:
            # E * sum_i f_i * P_i with f_i = routed_i / (T*k), P_i = sum_t scores_ti / T (all ranks'
            # T); this rank's share uses its own scores' sum, the shares add up to the global loss.
            e, k = self.num_experts, self.router.topk
            share = (routed * scores.sum(0)).sum() * (e / (k * tokens * tokens))
            terms.append(c.moe_aux_loss_coeff * share)
        if c.moe_z_loss_coeff:
            z = torch.logsumexp(logits, dim=-1).square().sum() / tokens
            terms.append(c.moe_z_loss_coeff * z)
        if not terms:
            return y, None, None
        aux = torch.stack(terms)
        y = _InjectAuxGrad.apply(y, aux.sum() * self.aux_share_scale, self.loss_scale)
        return (
            y,
            terms[0].detach() if c.moe_aux_loss_coeff > 0 else None,
            terms[-1].detach() if c.moe_z_loss_coeff else None,
        )

    # Statistics are tensors added to in place, inside compiled graphs too: no graph break, and
    # nothing Dynamo specializes on changes between micro-batches (no recompiles).
    @torch.no_grad()
    def _record(
        self,
        routing: Routing,
        aux: torch.Tensor | None,
        z: torch.Tensor | None,
        recomputing: bool | torch.Tensor,
    ) -> None:
        """Add this forward's counts and aux values to the step's statistics, unless it is the
        rerun of activation recompute."""
        if recomputing is True:
            return
        dev = routing.counts.device
        if self.stats.micro_batches.device != dev:  # built on the CPU, run elsewhere
            self.stats = self.stats.to(dev)
        st = self.stats
        st.tokens_per_expert.add_(_unless(recomputing, routing.counts))
        st.routed_per_expert.add_(_unless(recomputing, routing.routed))
        st.micro_batches.add_(_unless(recomputing, torch.ones_like(st.micro_batches)))
        if aux is not None:
            st.aux_loss.add_(_unless(recomputing, aux.to(st.aux_loss.dtype)))
        if z is not None:
            st.z_loss.add_(_unless(recomputing, z.to(st.z_loss.dtype)))

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """After an optimizer step: move the expert bias toward balance by the routed counts of
        the step (summed over `group`, the ranks of one global batch), sign-scaled as DeepSeek-V3.
        Every rank computes the same update, so the bias stays replicated."""
        bias = self.router.expert_bias
        if bias is None:
            return
        counts = self.stats.routed_per_expert.to(bias.device, torch.float32)
        if group is not None:
            dist.all_reduce(counts, group=group)
        bias.add_(self.config.moe_router_bias_update_rate * torch.sign(counts.mean() - counts))


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, layer) of every MoE block in `model`, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def set_moe_loss_scale(model: nn.Module, scale: float) -> None:
    """Set the factor the auxiliary losses' gradients get (the trainer's 1 / micro-batches)."""
    for _, m in moe_layers(model):
        m.loss_scale = scale
