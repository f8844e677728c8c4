"""Expert parallelism (with data and tensor parallelism) trains as one process does
on the whole batch.

Each case spawns gloo ranks that split a MoE GPT's experts over ep (`parallelize_experts`),
optionally its layers over tp (`parallelize`, with and without sequence parallelism), and
reduce gradients with `DataParallel` (plain, or ZeRO-1 with overlapped reduction); every rank
runs 3 optimizer steps of 2 micro-batches, each rank on its dp slice of every global
micro-batch. A single process runs the same steps on the whole micro-batches. Compared: each
step's loss, every gradient after the reduction (gathered over tp and ep into global
coordinates, before clipping), the gradient norm (clipping is active: clip_grad 0.5), and
every parameter after the last update, the expert bias included (it moves by the step's
routed counts summed over the ranks of one global batch); under ZeRO-1 also the Adam moments
`full_optimizer_state()` gathers for checkpoints.

The cases cover top-1 and top-2 routing, dropless and per-sequence capacity (both drop
policies), the aux and z losses (their gradients through `aux_share_scale` and the statistics
group), the shared expert with its gate, the expert bias, softmax and sigmoid scores, Llama
(RMSNorm, SwiGLU, RoPE) and GPT-2 (LayerNorm, GELU, biases, tied embeddings) blocks, and
`parallelize_experts` before and after `parallelize`, and (slow) full recompute, where the
all-to-alls run again inside the backward.

Tolerance: fp32 on CPU; the sharded runs add the same terms in another order (per-rank partial
sums, all-to-all'd rows, all-reduces). Measured: losses and norms within 5e-7 relative (held to
1e-5); first-step gradients within 5e-7 of each tensor's largest entry (held to 1e-5 relative
plus 1e-5 of that entry: elements that cancel to near zero keep only rounding); later steps
start from parameters that differ by rounding, their gradients within 2e-5 of the largest
entry (held to 1e-4); parameters within 3e-6 (held to 1e-5 relative plus 1e-5). Adam's eps is
1e-5 here: with torch's 1e-8, a gradient element a million times below its tensor's largest
(there are such) gets an update of lr times its sign, so its rounding decides a step of up to
6e-5 on its own, and the next steps' gradients follow it. With the aux share left at 1 instead
of dp (or tp's 1/tp missing), the router gradients are off by 50-150%, the losses by 1e-4.
"""

import contextlib
from dataclasses import dataclass, field

import pytest
import torch

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.parallel import ParallelConfig
from meshtrain.services.trainer.config.sections import OptimConfig
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.model.moe import moe_layers, set_moe_loss_scale
from meshtrain.services.trainer.optim.optimizer import build_optimizer, clip_grad_norm
from meshtrain.services.trainer.parallel import mappings as M
from meshtrain.services.trainer.parallel.data_parallel import DataParallel
from meshtrain.services.trainer.parallel.expert import gather_experts, parallelize_experts
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.recompute import apply as apply_recompute
from meshtrain.services.trainer.parallel.tensor import parallelize
from meshtrain.services.trainer.parallel.tensor_layers import gather_tp
from tests.dist_utils import run_ranks

LLAMA = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    seq_length=16,
    vocab_size=97,
    make_vocab_size_divisible_by=8,
    normalization="rmsnorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    moe_ffn_hidden_size=16,
    moe_aux_loss_coeff=1e-2,
    moe_z_loss_coeff=1e-3,
)
GPT2 = dict(
    LLAMA,
    num_query_groups=None,
    normalization="layernorm",
    activation="gelu",
    position_embedding_type="learned",
    add_bias_linear=True,
    untie_embeddings_and_output_weights=False,
)
OPTIM = OptimConfig(lr=1e-2, clip_grad=0.5, weight_decay=0.1, adam_eps=1e-5)
STEPS, MICRO, BATCH = (
    3,
    2,
    4,
)  # optimizer steps, micro-batches per step, sequences per global micro-batch


@dataclass(frozen=True)
class Case:
    world: int
    tp: int
    ep: int
    model: dict
    sp: bool = False  # sequence parallelism
    ddp: dict = field(default_factory=dict)  # DataParallel options
    experts_first: bool = True  # parallelize_experts before parallelize
    recompute: bool = False  # full recompute of every block: the all-to-alls run again in backward


CASES = {
    "ep2-top2-dropless-shared-gate": Case(
        2,
        1,
        2,
        dict(
            LLAMA,
            num_experts=4,
            moe_router_topk=2,
            moe_shared_expert_intermediate_size=32,
            moe_shared_expert_gate=True,
        ),
    ),
    "ep4-top1-capacity-expert-bias": Case(
        4,
        1,
        4,
        dict(
            LLAMA,
            num_experts=8,
            moe_router_topk=1,
            moe_expert_capacity_factor=1.0,
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=1e-2,
        ),
    ),
    "ep2-dp2-zero1-gpt2-top2-capacity-position": Case(
        4,
        1,
        2,
        dict(
            GPT2,
            num_experts=4,
            moe_router_topk=2,
            moe_expert_capacity_factor=1.0,
            moe_token_drop_policy="position",
        ),
        ddp=dict(distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=3000),
    ),
    "ep2-tp2-sp-shared": Case(
        4,
        2,
        2,
        dict(LLAMA, num_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=32),
        sp=True,
    ),
    "ep2-tp2-gpt2-shared-gate-tp-first": Case(
        4,
        2,
        2,
        dict(
            GPT2,
            num_experts=4,
            moe_router_topk=2,
            moe_shared_expert_intermediate_size=32,
            moe_shared_expert_gate=True,
        ),
        experts_first=False,
    ),
}
SLOW = {
    "ep2-dp2-sigmoid-bias-zero1": Case(
        4,
        1,
        2,
        dict(
            LLAMA,
            num_experts=4,
            moe_router_topk=2,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=1e-2,
            moe_layer_freq=1,
        ),
        ddp=dict(distributed_optimizer=True, bucket_size=3000),
    ),
    "ep1-dp2-statistics-only": Case(
        2, 1, 1, dict(LLAMA, num_experts=4, moe_router_topk=2, moe_router_pre_softmax=True)
    ),
    "ep2-tp2-sp-gpt2-capacity-zero1": Case(
        4,
        2,
        2,
        dict(GPT2, num_experts=4, moe_router_topk=1, moe_expert_capacity_factor=1.5),
        sp=True,
        ddp=dict(distributed_optimizer=True),
        experts_first=False,
    ),
    "ep2-recompute-full-capacity": Case(
        2,
        1,
        2,
        dict(
            LLAMA,
            num_experts=4,
            moe_router_topk=2,
            moe_expert_capacity_factor=1.0,
            moe_shared_expert_intermediate_size=32,
        ),
        recompute=True,
    ),
}


def _batch(step: int, micro: int) -> torch.Tensor:
    """A global micro-batch: (BATCH, seq + 1) token ids."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, 97, (BATCH, 17), generator=g)


def _model(cfg: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(**cfg))


def _reference(cfg: dict):
    """One process, whole micro-batches: per-step losses, grads (before clipping), norms;
    final parameters."""
    model = _model(cfg)
    opt = build_optimizer(model, OPTIM)
    set_moe_loss_scale(model, 1 / MICRO)
    losses, grads, norms = [], [], []
    for step in range(STEPS):
        total = 0.0
        for m in range(MICRO):
            tokens = _batch(step, m)
            loss = model(tokens[:, :-1], tokens[:, 1:]) / MICRO
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        norms.append(clip_grad_norm(model, OPTIM.clip_grad).item())
        opt.step()
        opt.zero_grad()
        for _, moe in moe_layers(model):
            moe.update_expert_bias()
            moe.reset_stats()
    moments = {
        n: {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    return (
        losses,
        grads,
        norms,
        {n: p.detach().clone() for n, p in model.named_parameters()},
        moments,
    )


def _global(t: torch.Tensor, p: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """A parameter-shaped local tensor in global coordinates (gathered over tp, then ep)."""
    return gather_experts(gather_tp(t, p, mesh), p, mesh)


def _reduced_grads(ddp: DataParallel, mesh: Mesh) -> dict[str, torch.Tensor]:
    """Every gradient the optimizer is given, whole:
    ZeRO-1 slices gathered over their bucket's group."""
    out = {}
    for b in ddp.buckets:
        flat = M.all_gather(b.local_grad, 0, b.group) if ddp.dist_opt else b.grad
        for i, p in enumerate(b.params):
            out[ddp.names[p]] = _global(b.view(flat, i).clone(), p, mesh)
    return out


def _sharded(rank, world, case: Case):
    mesh = Mesh.build(tp=case.tp, ep=case.ep)
    model = _model(case.model)
    if case.recompute:
        apply_recompute(model, ParallelConfig(recompute_granularity="full"))
    if case.experts_first:
        parallelize(parallelize_experts(model, mesh), mesh, sequence_parallel=case.sp)
    else:
        parallelize_experts(parallelize(model, mesh, sequence_parallel=case.sp), mesh)
    ddp = DataParallel(model, mesh, OPTIM, **case.ddp)
    for b in (
        ddp.buckets
    ):  # expert weights in buckets of their own, over the ranks holding the same experts
        assert {getattr(p, "expert_shard", None) is not None and case.ep > 1 for p in b.params} == {
            b.expert
        }
        assert b.group is (mesh.group("edp") if b.expert else mesh.group("dp"))
    assert not any(ddp.names[p].endswith("expert_bias") for b in ddp.buckets for p in b.params)
    opt = ddp.optimizer if ddp.optimizer is not None else build_optimizer(model, OPTIM)
    set_moe_loss_scale(model, 1 / MICRO)
    per = BATCH // mesh.dp
    losses, grads, norms = [], [], []
    for step in range(STEPS):
        total = torch.zeros(())
        for m in range(MICRO):
            tokens = _batch(step, m)[mesh.dp_rank * per : (mesh.dp_rank + 1) * per]
            with ddp.no_sync() if m < MICRO - 1 else contextlib.nullcontext():
                loss = model(tokens[:, :-1], tokens[:, 1:]) / MICRO
                loss.backward()
            total += loss.detach()
        ddp.finish_grad_sync()
        grads.append(_reduced_grads(ddp, mesh))
        norms.append(ddp.grad_norm_and_clip(OPTIM.clip_grad).item())
        opt.step()
        ddp.gather_params()
        ddp.zero_grad()
        for _, moe in moe_layers(model):
            moe.update_expert_bias(moe.stats_group)
            moe.reset_stats()
        losses.append((M.all_reduce(total, mesh.group("dp")) / mesh.dp).item())
    params = {n: _global(p.detach(), p, mesh).clone() for n, p in model.named_parameters()}
    moments = None
    if (
        ddp.dist_opt
    ):  # what checkpointing saves: each rank's whole moments of the parameters it holds
        named = dict(model.named_parameters())
        moments = {
            n: {k: _global(v, named[n], mesh) for k, v in st.items()}
            for n, st in ddp.full_optimizer_state().items()
        }
    return losses, grads, norms, params, moments


def _close(got: torch.Tensor, ref: torch.Tensor, what: str, atol: float) -> None:
    got = (
        got[: ref.shape[0]] if got.shape[0] > ref.shape[0] else got
    )  # vocabulary rows padded for tp
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def _check_case(case: Case) -> None:
    ref_losses, ref_grads, ref_norms, ref_params, ref_moments = _reference(case.model)
    for losses, grads, norms, params, moments in run_ranks(_sharded, case.world, case, timeout=300):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for step in range(STEPS):
            assert set(grads[step]) == set(ref_grads[step])
            for name, ref in ref_grads[step].items():
                scale = (1e-5 if step == 0 else 1e-4) * float(ref.abs().max())
                _close(grads[step][name], ref, f"step {step} grad {name}", scale)
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert set(params) == set(ref_params)
        for name, ref in ref_params.items():
            _close(params[name], ref, name, 1e-5)
        if moments is not None:  # ZeRO-1: Adam's moments gathered from the shards, by parameter
            assert set(moments) == set(ref_moments)
            for name, ref in ref_moments.items():
                for key in ("exp_avg", "exp_avg_sq"):
                    _close(
                        moments[name][key],
                        ref[key],
                        f"{key} {name}",
                        1e-4 * float(ref[key].abs().max()),
                    )


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_training_matches_one_process(case):
    _check_case(CASES[case])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW))
def test_expert_parallel_training_matches_one_process_slow(case):
    _check_case(SLOW[case])
