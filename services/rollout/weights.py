"""How a rollout worker receives a policy's weights: from a committed checkpoint (the layout-free
reader, so whatever tensor/pipeline/data-parallel layout saved it loads on one device) or as
tensors streamed by the trainer in chunks (raw little-endian bytes + dtype + shape, each chunk
under the gRPC message limit), assembled here and checked against the model before anything is
applied. No gRPC here; the service's `rpc/` feeds the chunks in.

    config, tensors, step = read_checkpoint(root, step=None)
    engine.set_weights(tensors, version=step)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from meshtrain.services.common.errors import InvalidRequestError
from meshtrain.services.common.model_config import ModelConfig

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def checkpoint_config(root: str, step: int | None = None) -> tuple[ModelConfig, int]:
    """The model config a committed checkpoint records, and its step (None: the newest)."""
    from meshtrain.services.checkpoint.convert import model_config, resolve_step, tensor_specs
    from meshtrain.services.checkpoint.reader import read_manifest

    step = resolve_step(root, step)
    manifest = read_manifest(root, step)
    config = model_config(manifest.get("metadata", {}), tensor_specs(manifest), f"{root} {step}")
    return config, step


def read_checkpoint(root: str, step: int, names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors `names` of committed checkpoint `step` under `root`, every object verified.

    Raises:
        CheckpointError: no such step, or it lacks one of `names`.
    """
    from meshtrain.services.checkpoint.reader import load_checkpoint

    tensors, _ = load_checkpoint(root, step, names)
    return tensors


def check_weights(
    tensors: dict[str, torch.Tensor], params: dict[str, torch.Tensor], vocab_size: int
) -> dict[str, torch.Tensor]:
    """`tensors` converted to each parameter's dtype and device, ready to copy in.

    Vocabulary tensors may come with the model's padded rows or without them (checkpoints never
    store padding): missing rows are zero.

    Raises:
        InvalidRequestError: a parameter missing, a name the model does not have, a shape that
            does not fit.
    """
    missing = sorted(set(params) - set(tensors))
    unknown = sorted(set(tensors) - set(params))
    if missing or unknown:
        raise InvalidRequestError(
            "weights do not match the model: "
            + (f"missing {missing[:5]}{'...' if len(missing) > 5 else ''} " if missing else "")
            + (f"unknown {unknown[:5]}{'...' if len(unknown) > 5 else ''}" if unknown else "")
        )
    staged = {}
    for name, p in params.items():
        t = tensors[name]
        if (
            name in _VOCAB_ROWS
            and t.dim() == 2
            and t.shape[0] == vocab_size < p.shape[0]
            and t.shape[1:] == p.shape[1:]
        ):
            full = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            full[:vocab_size] = t
            t = full
        if tuple(t.shape) != tuple(p.shape):
            raise InvalidRequestError(
                f"weight {name!r} has shape {tuple(t.shape)}; the model needs {tuple(p.shape)}"
            )
        staged[name] = t.to(device=p.device, dtype=p.dtype)
    return staged


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name."""
    if name not in DTYPES:
        raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def tensor_chunks(
    tensors: dict[str, torch.Tensor], chunk_bytes: int
) -> Iterator[tuple[str, str, tuple[int, ...], int, bytes]]:
    """(name, dtype, shape, byte offset, data) pieces of every tensor, each <= chunk_bytes."""
    names = {v: k for k, v in DTYPES.items()}
    for name, t in tensors.items():
        if t.dtype not in names:
            raise InvalidRequestError(f"weight {name!r}: dtype {t.dtype} cannot be sent")
        # bf16 has no numpy dtype: its bits travel as int16.
        flat = t.detach().contiguous().cpu().reshape(-1)
        raw = flat.view(torch.int16) if t.dtype == torch.bfloat16 else flat
        data = raw.numpy().tobytes()
        for off in range(0, max(len(data), 1), chunk_bytes):
            yield name, names[t.dtype], tuple(t.shape), off, data[off : off + chunk_bytes]


class WeightAssembler:
    """Collects streamed chunks into whole tensors, bounded by the model it fills: a tensor is
    accepted only under a parameter's name and shape, so no chunk makes the worker allocate
    more than the model's own size."""

    def __init__(self, params: dict[str, torch.Tensor], vocab_size: int):
        self.params = params
        self.vocab_size = vocab_size
        self.version: int | None = None
        self._buffers: dict[str, tuple[torch.dtype, tuple[int, ...], bytearray, int]] = {}

    def _allowed(self, name: str, shape: tuple[int, ...]) -> bool:
        p = self.params.get(name)
        if p is None:
            return False
        if shape == tuple(p.shape):
            return True
        return name in _VOCAB_ROWS and shape == (self.vocab_size, *p.shape[1:])

    def add(
        self, version: int, name: str, dtype: str, shape: tuple[int, ...], offset: int, data: bytes
    ) -> None:
        """One chunk: `data` at byte `offset` of tensor `name` (dtype, shape) of `version`."""
        if self.version is None:
            if version < 0:
                raise InvalidRequestError(f"version must be >= 0, got {version}")
            self.version = version
        elif version != self.version:
            raise InvalidRequestError(
                f"one update carries one version: got {version} after {self.version}"
            )
        torch_dtype = dtype_of(dtype)
        if not self._allowed(name, shape):
            p = self.params.get(name)
            raise InvalidRequestError(
                f"weight {name!r} of shape {shape}: "
                + ("the model has no such parameter" if p is None else f"needs {tuple(p.shape)}")
            )
        nbytes = torch.Size(shape).numel() * torch_dtype.itemsize
        if name not in self._buffers:
            self._buffers[name] = (torch_dtype, shape, bytearray(nbytes), 0)
        have_dtype, have_shape, buf, filled = self._buffers[name]
        if (have_dtype, have_shape) != (torch_dtype, shape):
            raise InvalidRequestError(f"weight {name!r}: chunks disagree on dtype or shape")
        if offset != filled or offset + len(data) > nbytes:
            raise InvalidRequestError(
                f"weight {name!r}: chunk at byte {offset} of {len(data)} bytes; expected byte "
                f"{filled} of {nbytes}"
            )
        buf[offset : offset + len(data)] = data
        self._buffers[name] = (have_dtype, have_shape, buf, filled + len(data))

    def finish(self) -> tuple[dict[str, torch.Tensor], int]:
        """The whole tensors and their version.

        Raises:
            InvalidRequestError: nothing sent, or a tensor cut short.
        """
        if self.version is None:
            raise InvalidRequestError("the update carried no weights")
        out = {}
        for name, (dtype, shape, buf, filled) in self._buffers.items():
            if filled != len(buf):
                raise InvalidRequestError(
                    f"weight {name!r}: {filled} of its {len(buf)} bytes arrived"
                )
            wire = torch.int16 if dtype == torch.bfloat16 else dtype
            t = torch.frombuffer(buf, dtype=wire) if buf else torch.empty(0, dtype=wire)
            out[name] = t.view(dtype).reshape(shape)
        return out, self.version
