"""Optimizer CPU offload (optim.optimizer_cpu_offload; Megatron-LM's --optimizer-cpu-offload,
DeepSpeed's ZeRO-Offload): AdamW's moments and an fp32 master copy of the parameters live in
host memory, and the update runs on the CPU.

Each step streams the device gradients into a few reused page-locked staging buffers on a side
stream, runs PyTorch's fused CPU AdamW (`torch.optim.AdamW(fused=True)` on CPU tensors: one
OpenMP-parallel pass per parameter, `torch.get_num_threads()` threads) on the host masters, and
copies the updated masters back into the device parameters on the same side stream; the compute
stream only waits for that stream (no host synchronization) before its next kernel. The
parameters are split into chunks of about `chunk_numel` elements with
`optim.overlap_cpu_optimizer_d2h_h2d` (Megatron's --overlap-cpu-optimizer-d2h-h2d), each with
its own CPU AdamW and staging buffer: two chunks' gradients are in flight at once, and each chunk
is updated as soon as its own gradients have arrived and copied back at once, so the copies of
the next chunks run during its update. Without it, all parameters are one chunk.

Two kinds of device parameters:
- fp32 (`bf16_params` off): the device keeps its fp32 parameters and gradients (the model trains
  on them through bf16 autocast or the bf16 weight copies); the masters are page-locked, and the
  update copies them back as they are. Host: master 4 + moments 8 bytes a parameter, plus the
  staging buffers.
- bf16 (`bf16_params`, optim.offload_bf16_params: Megatron's --bf16 with the CPU optimizer):
  the masters are read from the fp32 device parameters once, in the constructor; the caller
  then casts those to bf16 and gives each an fp32 `main_grad` (`main_grads.py`) that the
  micro-batches' gradients add into. The update reads the `main_grad`s, and writes the bf16
  rounding of each updated master into the staging buffer it read the gradients from, whence it
  goes to the device: half the bytes up, and the device holds 2 + 4 bytes a parameter.

`state` is keyed by the device parameters, so checkpoints save and load the offloaded moments
exactly as AdamW's: a run saved with offload resumes without it and the reverse. With bf16
device parameters the checkpoint's weights are the fp32 masters (`master_of`), and a load writes
them with `load_master`.

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

from meshtrain.services.trainer.optim.main_grads import grad_of

# Hyperparameters a device group passes on to its host groups before every step (set_lr
# writes the device groups' lr).
_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


class _Chunk:
    """Parameters updated together: their host masters, one CPU AdamW, and the event that says
    their gradients have reached the host."""

    def __init__(self, members: list[tuple[int, nn.Parameter]], masters: list[nn.Parameter]):
        self.members = members  # (device group index, device parameter)
        self.masters = masters  # host fp32 copies, in the same order
        self.numel = sum(m.numel() for m in masters)
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
        bf16_params: the device parameters (fp32 now) become bf16 with fp32 `main_grad`s after
            this constructor: the masters are read from them here (see the module doc).
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
        bf16_params: bool = False,
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
        self.bf16_params = bf16_params
        odd = [p.dtype for _, p in members if p.dtype != torch.float32]
        if odd:
            raise ValueError(
                f"offloaded parameters are fp32 when the optimizer is built (bf16_params casts "
                f"them after), got {odd[0]}"
            )
        self.master_of: dict[nn.Parameter, nn.Parameter] = {}
        self.chunk_of: dict[nn.Parameter, _Chunk] = {}
        self.chunks: list[_Chunk] = []
        # Staging buffers (page-locked, fp32, the largest chunk's size), allocated at the first
        # step: two with overlap (one chunk's gradients arrive while another updates).
        self.depth = 2 if overlap else 1
        self.staging: list[torch.Tensor] = []
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
        # The masters are (re)read from the device parameters at the next step: a checkpoint
        # load after this constructor writes the device parameters, not the masters. bf16
        # device parameters cannot give them back: read while they are fp32, now.
        self.stale = True
        if bf16_params:
            self._read_parameters()
            if self.stream is not None:
                self.stream.synchronize()

    def _make_chunk(self, run: list[tuple[int, nn.Parameter]]) -> _Chunk:
        # The masters of bf16 device parameters never travel (their bf16 roundings do, from the
        # staging buffers): page-locking them would only slow their allocation.
        pin = self.pinned and not self.bf16_params
        masters = []
        for _, p in run:
            m = nn.Parameter(
                torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
            )
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

    def _side(self) -> contextlib.AbstractContextManager:
        return (
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        )

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
        if not self.staging:
            size = max((c.numel for c in self.chunks), default=0)
            self.staging = [
                torch.empty(size, dtype=torch.float32, device="cpu", pin_memory=self.pinned)
                for _ in range(min(self.depth, len(self.chunks)))
            ]
        n = len(self.chunks)
        # Chunk i uses buffer i % depth. The side stream runs in order: chunk i + depth's
        # gradients are copied into that buffer only after chunk i's parameters have left it.
        for i in range(min(self.depth, n)):
            self._to_host(self.chunks[i], self.staging[i % self.depth])
        for i, chunk in enumerate(self.chunks):
            buffer = self.staging[i % self.depth]
            if chunk.arrived is not None:
                chunk.arrived.synchronize()
            self._update(chunk, buffer)
            self._to_device(chunk, buffer)
            if i + self.depth < n:
                self._to_host(self.chunks[i + self.depth], buffer)
        if self.stream is not None:  # the next kernels that read the parameters come after
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        # No host wait: the host writes a buffer (or a master) only after the arrival of
        # gradients queued behind the copies that last read it.
        return loss

    def _to_host(self, chunk: _Chunk, buffer: torch.Tensor) -> None:
        """Queue the copies of the chunk's gradients into `buffer` (the side stream)."""
        with self._side():
            off = 0
            for (_, p), m in zip(chunk.members, chunk.masters, strict=True):
                g = grad_of(p)
                if g is not None:
                    buffer[off : off + m.numel()].view_as(m).copy_(g, non_blocking=self.pinned)
                off += m.numel()
            if self.stream is not None:
                chunk.arrived = torch.cuda.Event()
                chunk.arrived.record(self.stream)

    def _update(self, chunk: _Chunk, buffer: torch.Tensor) -> None:
        assert chunk.optimizer is not None
        for host_group, gi in zip(chunk.optimizer.param_groups, chunk.group_of, strict=True):
            host_group.update(self._hyper(gi))
        # AdamW skips a parameter without a gradient: so does the offloaded one.
        off = 0
        for (_, p), m in zip(chunk.members, chunk.masters, strict=True):
            has = grad_of(p) is not None
            m.grad = buffer[off : off + m.numel()].view_as(m) if has else None
            off += m.numel()
        chunk.optimizer.step()
        for m in chunk.masters:  # views of a buffer the next chunks reuse
            m.grad = None

    def _to_device(self, chunk: _Chunk, buffer: torch.Tensor) -> None:
        """Queue the copies of the chunk's updated masters into the device parameters: straight
        from the (page-locked) masters, or their bf16 roundings, written into `buffer` (whose
        gradients the update has read) for bf16 device parameters."""
        low = buffer.view(torch.bfloat16)  # twice the elements: the first half is used
        off = 0
        for (_, p), m in zip(chunk.members, chunk.masters, strict=True):
            if p.dtype != torch.float32:
                low[off : off + m.numel()].view_as(m).copy_(m)
            off += m.numel()
        with self._side():
            off = 0
            for (_, p), m in zip(chunk.members, chunk.masters, strict=True):
                src = m if p.dtype == torch.float32 else low[off : off + m.numel()].view_as(m)
                p.detach().copy_(src, non_blocking=self.pinned)
                off += m.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The device gradients (`main_grad`s are zeroed in place: their backward adds into
        them; the staging buffers are overwritten by the next step's copies)."""
        mains = []
        for group in self.param_groups:
            for p in group["params"]:
                main = getattr(p, "main_grad", None)
                if main is not None:
                    mains.append(main)
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        if mains:
            torch._foreach_zero_(mains)

    def reload_parameters(self) -> None:
        """Read the host masters from the device parameters again at the next step: call it
        after something other than `step` wrote those (a load of the weights alone, a
        broadcast). The first step always reads them. bf16 device parameters give back their
        bf16 values: write fp32 weights with `load_master` instead."""
        self.stale = True

    @torch.no_grad()
    def load_master(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Set `p`'s fp32 master to `value` (of its shape) and the device parameter to it (its
        bf16 rounding, for bf16 device parameters): a checkpoint's weights, without the loss of
        a round trip through bf16."""
        m = self.master_of[p]
        m.detach().copy_(value.detach().reshape(m.shape))
        p.detach().copy_(m)

    def _read_parameters(self) -> None:
        """Device parameters -> host masters (on the side stream, which already waits for the
        compute stream; the host waits for the copies before any update)."""
        with self._side():
            for p, m in self.master_of.items():
                m.detach().copy_(p.detach(), non_blocking=m.is_pinned())
        self.stale = False

    def host_bytes(self) -> int:
        """Host memory this optimizer holds: masters, moments and staging buffers."""
        total = sum(m.numel() * m.element_size() for m in self.master_of.values())
        total += sum(b.numel() * b.element_size() for b in self.staging)
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
                # pageable: the moments never leave the host
                host[k] = v.detach().to("cpu", torch.float32, copy=True).reshape(m.shape)
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
