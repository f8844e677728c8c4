"""Optimizer CPU offload (optim.optimizer_cpu_offload; Megatron-LM's --optimizer-cpu-offload,
DeepSpeed's ZeRO-Offload): AdamW's moments and an fp32 master copy of the parameters live in
host memory (pinned where CUDA is), and the update runs on the CPU.

Each step copies the device gradients into pinned host buffers on a side stream, runs PyTorch's
fused CPU AdamW (`torch.optim.AdamW(fused=True)` on CPU tensors: one OpenMP-parallel pass per
parameter, `torch.get_num_threads()` threads) on the host masters, and copies the updated
masters back into the device parameters on the same side stream; the compute stream only waits
for that stream (no host synchronization) before its next kernel. With
`optim.overlap_cpu_optimizer_d2h_h2d` (Megatron's --overlap-cpu-optimizer-d2h-h2d) the
parameters are split into chunks of about `chunk_numel` elements, each with its own CPU AdamW:
all gradient copies are queued at once, and each chunk is updated as soon as its own gradients
have arrived and copied back at once, so the copies of the other chunks run during its update.

The device keeps its fp32 parameters (the model trains on them, through bf16 autocast or the
bf16 weight copies) and their gradients; what leaves it are the Adam moments, 8 bytes per
parameter, or, under ZeRO-1, each rank's 1/dp slice of them (the optimizer is built over the
slices). `state` is keyed by the device parameters, so checkpoints save and load the offloaded
moments exactly as AdamW's: a run saved with offload resumes without it and the reverse.

    optimizer = OffloadedAdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, overlap=True)
    loss.backward(); clip_grad_norm(model, 1.0)
    optimizer.step()                          # D2H, CPU AdamW, H2D
    optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any

import torch
from torch import nn

# Hyperparameters a device group passes on to its host groups before every step (set_lr
# writes the device groups' lr).
_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def _host_empty(like: torch.Tensor, pin: bool) -> torch.Tensor:
    """An fp32 host tensor of `like`'s shape, page-locked when `pin` (needed for copies that
    do not block the host)."""
    return torch.empty(like.shape, dtype=torch.float32, device="cpu", pin_memory=pin)


class _Chunk:
    """Parameters updated together: their host masters and gradients, one CPU AdamW, and the
    event that says their gradients have reached the host."""

    def __init__(self, members: list[tuple[int, nn.Parameter]], masters: list[nn.Parameter]):
        self.members = members  # (device group index, device parameter)
        self.masters = masters  # host fp32 copies, in the same order
        self.optimizer: torch.optim.AdamW | None = None
        self.group_of: list[int] = []  # host group -> device group index
        self.arrived: torch.cuda.Event | None = None


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW whose state and fp32 master weights live in host memory (see the module doc).

    Args:
        params: device parameters, or groups of them (dicts with "params" and any of AdamW's
            options); the parameters may be views (the ZeRO-1 slices of a flat buffer).
        lr, betas, eps, weight_decay: AdamW's defaults for groups that do not set them.
        overlap: update in chunks, each as soon as its gradients are on the host, its copy
            back starting at once (optim.overlap_cpu_optimizer_d2h_h2d).
        chunk_numel: elements per chunk with `overlap` (a parameter is never split).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        overlap: bool = False,
        chunk_numel: int = 32 * 2**20,
    ):
        if chunk_numel <= 0:
            raise ValueError(f"chunk_numel must be > 0, got {chunk_numel}")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False
        )
        super().__init__(params, defaults)
        members = [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]
        devices = {p.device for _, p in members}
        if len(devices) > 1:
            raise ValueError(f"offloaded parameters must share one device, got {sorted(devices)}")
        self.device = devices.pop() if devices else torch.device("cpu")
        cuda = self.device.type == "cuda"
        self.pinned = cuda  # page-locked memory needs a CUDA runtime to register it with
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.overlap = overlap
        self.master_of: dict[nn.Parameter, nn.Parameter] = {}
        self.chunk_of: dict[nn.Parameter, _Chunk] = {}
        self.chunks: list[_Chunk] = []
        # The masters are (re)read from the device parameters at the next step: a checkpoint
        # load after this constructor writes the device parameters, not the masters.
        self.stale = True
        run: list[tuple[int, nn.Parameter]] = []
        size = 0
        for gi, p in members:
            run.append((gi, p))
            size += p.numel()
            if overlap and size >= chunk_numel:
                self.chunks.append(self._make_chunk(run))
                run, size = [], 0
        if run:
            self.chunks.append(self._make_chunk(run))
        self.state = _HostState(self)  # type: ignore[assignment]

    def _make_chunk(self, run: list[tuple[int, nn.Parameter]]) -> _Chunk:
        masters = []
        for _, p in run:
            m = nn.Parameter(_host_empty(p, self.pinned))
            m.grad = _host_empty(p, self.pinned)
            self.master_of[p] = m
            masters.append(m)
        chunk = _Chunk(run, masters)
        for _, p in run:
            self.chunk_of[p] = chunk
        groups: dict[int, list[nn.Parameter]] = {}
        for (gi, _), m in zip(run, masters, strict=True):
            groups.setdefault(gi, []).append(m)
        chunk.group_of = list(groups)
        chunk.optimizer = torch.optim.AdamW(
            [{"params": ms, **self._hyper(gi)} for gi, ms in groups.items()],
            fused=True,  # PyTorch's fused CPU AdamW: one OpenMP-parallel pass per tensor
        )
        return chunk

    def _hyper(self, gi: int) -> dict[str, Any]:
        return {k: self.param_groups[gi][k] for k in _HYPER}

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure=None):
        """Gradients to the host, AdamW there, updated parameters back (see the module doc).
        Returns the closure's loss, if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # The side stream starts after everything the compute stream has queued: the last
        # backward, the reduction of the gradients, their clipping.
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.stale:
            self._read_parameters()
        for chunk in self.chunks:
            self._to_host(chunk)
        for chunk in self.chunks:
            if chunk.arrived is not None:
                chunk.arrived.synchronize()
            self._update(chunk)
            self._to_device(chunk)
        if self.stream is not None:  # the next kernels that read the parameters come after
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return loss

    def _to_host(self, chunk: _Chunk) -> None:
        """Queue the chunk's gradient copies into its pinned buffers (the side stream)."""
        with (
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        ):
            for (_, p), m in zip(chunk.members, chunk.masters, strict=True):
                if p.grad is None:
                    continue
                if m.grad is None:
                    m.grad = _host_empty(p, self.pinned)
                m.grad.copy_(p.grad, non_blocking=self.pinned)
            if self.stream is not None:
                chunk.arrived = torch.cuda.Event()
                chunk.arrived.record(self.stream)

    def _update(self, chunk: _Chunk) -> None:
        assert chunk.optimizer is not None
        for host_group, gi in zip(chunk.optimizer.param_groups, chunk.group_of, strict=True):
            host_group.update(self._hyper(gi))
        # AdamW skips a parameter without a gradient: so does the offloaded one.
        hidden = []
        for (_, p), m in zip(chunk.members, chunk.masters, strict=True):
            if p.grad is None and m.grad is not None:
                hidden.append((m, m.grad))
                m.grad = None
        chunk.optimizer.step()
        for m, g in hidden:
            m.grad = g

    def _to_device(self, chunk: _Chunk) -> None:
        """Queue the copies of the chunk's updated masters into the device parameters."""
        with (
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        ):
            for (_, p), m in zip(chunk.members, chunk.masters, strict=True):
                p.detach().copy_(m, non_blocking=self.pinned)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The device gradients (the host buffers are overwritten by the next step's copies)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def reload_parameters(self) -> None:
        """Read the host masters from the device parameters again at the next step: call it
        after something other than `step` wrote those (a load of the weights alone, a
        broadcast). The first step always reads them."""
        self.stale = True

    def _read_parameters(self) -> None:
        """Device parameters -> host masters (on the side stream, which already waits for the
        compute stream; the host waits for the copies before any update)."""
        with (
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        ):
            for p, m in self.master_of.items():
                m.detach().copy_(p.detach(), non_blocking=self.pinned)
        self.stale = False

    def host_bytes(self) -> int:
        """Host memory this optimizer holds: masters, gradient buffers and moments."""
        total = 0
        for m in self.master_of.values():
            total += m.numel() * m.element_size() * 2
        for st in self.state.values():
            total += sum(t.numel() * t.element_size() for t in st.values() if t.dim())
        return total

    # ---------------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        """AdamW's layout (state by parameter index, then the groups), with host tensors."""
        index: dict[torch.Tensor, int] = {}
        groups = []
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                index.setdefault(p, len(index))
                ids.append(index[p])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        state = {index[p]: dict(st) for p, st in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)
        ):
            raise ValueError("the state dict's parameter groups do not match this optimizer's")
        for s, g in zip(saved, self.param_groups):
            g.update({k: v for k, v in s.items() if k != "params"})
            for i, p in zip(s["params"], g["params"]):
                if i in state_dict["state"]:
                    self.state[p] = state_dict["state"][i]


class _HostState(MutableMapping):
    """`OffloadedAdamW.state`: AdamW's per-parameter state keyed by the device parameters,
    held by the host masters' optimizers. Whatever is stored lands on the host (in the masters'
    dtype; the step count a CPU tensor, as fused CPU AdamW keeps it)."""

    def __init__(self, owner: OffloadedAdamW):
        self.owner = owner

    def _host(self, p: nn.Parameter) -> tuple[torch.optim.AdamW, nn.Parameter]:
        if p not in self.owner.master_of:
            raise KeyError(p)
        opt = self.owner.chunk_of[p].optimizer
        assert opt is not None
        return opt, self.owner.master_of[p]

    def __getitem__(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        opt, m = self._host(p)
        if m not in opt.state or not opt.state[m]:
            raise KeyError(p)
        return opt.state[m]

    def __setitem__(self, p: nn.Parameter, value: dict[str, torch.Tensor]) -> None:
        opt, m = self._host(p)
        host = {}
        for k, v in value.items():
            v = torch.as_tensor(v)
            if k == "step":
                host[k] = v.detach().to("cpu", torch.float32).clone()
            else:
                t = _host_empty(m, self.owner.pinned)
                t.copy_(v.detach().reshape(m.shape))
                host[k] = t
        opt.state[m] = host

    def __delitem__(self, p: nn.Parameter) -> None:
        opt, m = self._host(p)
        del opt.state[m]

    def __iter__(self) -> Iterator[nn.Parameter]:
        for p, m in self.owner.master_of.items():
            opt = self.owner.chunk_of[p].optimizer
            if opt is not None and opt.state.get(m):
                yield p

    def __len__(self) -> int:
        return sum(1 for _ in self)
