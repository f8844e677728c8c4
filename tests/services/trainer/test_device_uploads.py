"""Micro-batches to the device on a side stream (services/trainer/device_uploads.py).

The CUDA cases skip without a GPU and run on the H200 with `make test-gpu`; the training step
that uses the uploader is covered there too (test_gpu.py, including the no-host-sync test).
"""

import pytest
import torch

from meshtrain.services.trainer.device_uploads import Uploader

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _batches(n: int, rows: int = 4, seq: int = 64) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(n)
    return [
        (
            torch.randint(0, 50_000, (rows, seq), generator=g),
            torch.randint(0, 50_000, (rows, seq), generator=g),
            torch.rand(rows, seq, generator=g),
        )
        for _ in range(n)
    ]


def test_off_cuda_the_tensors_pass_through_in_order():
    batches = _batches(3)
    got = list(Uploader(torch.device("cpu")).upload(batches))
    assert len(got) == 3
    for sent, received in zip(batches, got, strict=True):
        assert all(a is b for a, b in zip(sent, received, strict=True))


@pytest.mark.gpu
@cuda
def test_uploads_arrive_whole_and_in_order():
    batches = _batches(5)
    uploader = Uploader(torch.device("cuda"))
    on_device = list(uploader.upload(batches))
    assert uploader.device.index is not None  # "cuda" resolves to the current device
    for sent, received in zip(batches, on_device, strict=True):
        for a, b in zip(sent, received, strict=True):
            assert b.device == uploader.device and b.dtype == a.dtype
            assert torch.equal(b.cpu(), a)
    already = torch.arange(8, device="cuda")
    (kept,) = list(uploader.upload([(already,)]))[0]
    assert kept.data_ptr() == already.data_ptr()  # a device tensor is not copied again


@pytest.mark.gpu
@cuda
def test_uploads_run_while_the_compute_stream_is_busy():
    """The copies do not queue behind the compute stream's work: with that stream held by a
    half-second sleep kernel, the uploaded values can already be read from another stream
    while the sleep still runs; the compute stream itself sees them after its wait."""
    batches = _batches(4)
    uploader = Uploader(torch.device("cuda"))
    torch.cuda.synchronize()
    busy_until = torch.cuda.Event()
    torch.cuda._sleep(int(1e9))  # ~0.5 s of one SM spinning, on the compute (current) stream
    busy_until.record()
    uploads = uploader.upload(batches)
    first = next(uploads)  # issues every copy on the side stream
    reader = torch.cuda.Stream()
    reader.wait_stream(uploader.stream)  # only the copies, not the compute stream
    with torch.cuda.stream(reader):
        early = [t.to("cpu") for t in first]  # blocks the host on the reader stream alone
    assert not busy_until.query(), "the sleep ended first: the check below proves nothing"
    for a, b in zip(batches[0], early, strict=True):
        assert torch.equal(a, b)
    rest = list(uploads)
    sums = [t.double().sum() for batch in [first, *rest] for t in batch]  # on the compute stream
    torch.cuda.synchronize()
    want = [t.double().sum() for batch in batches for t in batch]
    assert [s.item() for s in sums] == pytest.approx([w.item() for w in want])
