"""Vision-language streams over real gRPC: the same batches as in-process, exactly once across
worker kills, bounded messages, and bad records named through the service."""

import random
import shutil
import tarfile
from dataclasses import replace

import pytest
import torch

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.rpc.client import ServiceBatchSource
from meshtrain.services.dataloader.rpc.multimodal import (
    MAX_MULTIMODAL_BATCH_BYTES,
    check_batch_bytes,
    max_batch_bytes,
)
from meshtrain.services.dataloader.rpc.server import start_server
from meshtrain.services.dataloader.vision.dataset import (
    MultimodalBatchSource,
    MultimodalSpec,
    open_multimodal,
)

from .conftest import WorkerProcess, served_limits
from .test_vision import load_shapes, same

IMG, TPI = 257, 8


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes-service")
    return load_shapes().write_shapes(out, samples=48, seed=4, image_size=64, shard_size=16)


@pytest.fixture(scope="module")
def server():
    srv, port, _ = start_server(0, limits=served_limits())
    yield f"127.0.0.1:{port}"
    srv.stop(0)


def mm_spec(path, **kw):
    base = dict(
        tokenizer="byte",
        seq_length=96,
        num_samples=40 * 8,
        seed=11,
        image_token_id=IMG,
        tokens_per_image=TPI,
        image_size=64,
        split="100,0,0",
    )
    base.update(kw)
    return MultimodalSpec((str(path),), **base)


@pytest.mark.parametrize("wire", ["uint8", "bfloat16"])
@pytest.mark.parametrize("dp_rank", [0, 1])
def test_stream_equals_in_process(server, shapes, wire, dp_rank):
    spec = mm_spec(shapes["wds"], wire_dtype=wire, resize_mode="pad", normalization="siglip")
    local = MultimodalBatchSource(open_multimodal(spec), 2, 8, dp_rank, 2)
    with ServiceBatchSource([server], spec, 2, 8, dp_rank, 2, prefetch=4) as remote:
        for step in (0, 1, 2, 7):  # 7: a jump reopens the stream there
            for a, b in zip(remote.micro_batches(step), local.micro_batches(step)):
                same(a, b)
                assert a.images.shape[0] * TPI == int((a.tokens == IMG).sum())


@pytest.mark.e2e
def test_a_worker_killed_mid_stream_loses_or_repeats_nothing(shapes):
    """Two worker processes; the one streaming is SIGKILLed every few steps and restarted:
    every micro-batch still equals the in-process one, in order."""
    spec = mm_spec(shapes["jsonl"])
    local = MultimodalBatchSource(open_multimodal(spec), 2, 8, 0, 1)
    workers = [WorkerProcess().wait_ready() for _ in range(2)]
    rng = random.Random(0)
    kills = 0
    try:
        with ServiceBatchSource(
            [w.address for w in workers],
            spec,
            2,
            8,
            prefetch=2,
            backoff_s=(0.01, 0.1),
            give_up_s=60,
            rebalance_s=0,
        ) as remote:
            for step in range(40):
                for a, b in zip(remote.micro_batches(step), local.micro_batches(step)):
                    same(a, b)
                if step % 6 == 3:
                    i = next(
                        i for i, w in enumerate(workers) if w.address == remote.current_address
                    )
                    workers[i].kill()
                    kills += 1
                    workers[i] = WorkerProcess(workers[i].port)
                    if rng.random() < 0.5:
                        workers[i].wait_ready()
            assert kills >= 5 and remote.reconnects >= kills
    finally:
        for w in workers:
            w.stop()


def test_message_size_is_bounded_before_anything_is_opened(server, shapes):
    # LLaVA-1.5 sizes: 336^2 images of 576 tokens, seq 4096 -> at most 7 images a sample
    llava = mm_spec("x", seq_length=4096, tokens_per_image=576, image_size=336)
    assert max_batch_bytes(llava, 8) < MAX_MULTIMODAL_BATCH_BYTES
    check_batch_bytes(replace(llava, wire_dtype="bfloat16"), 8)
    with pytest.raises(DataError, match="over the .* limit: lower the micro-batch size"):
        check_batch_bytes(replace(llava, wire_dtype="bfloat16"), 16)
    big = mm_spec(shapes["wds"], seq_length=4096, tokens_per_image=576, image_size=336)
    # the client refuses it at once; a client that did not is refused by the worker
    with pytest.raises(DataError, match="over the"):
        ServiceBatchSource([server], replace(big, wire_dtype="bfloat16"), 16, 16)


def test_a_corrupt_image_stops_the_run_naming_it(server, shapes, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(shapes["wds"], d)
    shard = d / "shapes-000001.tar"
    with tarfile.open(shard) as tar:
        m = tar.getmember("00000020.png")
    data = bytearray(shard.read_bytes())
    data[m.offset_data : m.offset_data + m.size] = b"\0" * m.size
    shard.write_bytes(bytes(data))
    spec = mm_spec(d, num_samples=48)
    with ServiceBatchSource([server], spec, 8, 8) as remote:
        with pytest.raises(DataError, match=r"shapes-000001.tar/00000020.png: cannot decode"):
            for step in range(6):
                remote.micro_batches(step)
    skip = replace(spec, bad_image_policy="skip")
    local = MultimodalBatchSource(open_multimodal(skip), 8, 8)
    with ServiceBatchSource([server], skip, 8, 8) as remote:
        for step in range(6):
            same(remote.micro_batches(step)[0], local.micro_batches(step)[0])


def test_paths_outside_the_workers_roots_are_refused(server, tmp_path):
    spec = mm_spec("/etc/passwd.jsonl")
    with ServiceBatchSource([server], spec, 2, 8) as remote:
        with pytest.raises(DataError, match="PERMISSION_DENIED"):
            remote.micro_batches(0)
    with pytest.raises(DataError, match="context parallelism"):
        ServiceBatchSource([server], spec, 2, 8, cp_size=2)


def test_batch_images_are_float32_in_order(server, shapes):
    spec = mm_spec(shapes["wds"])
    with ServiceBatchSource([server], spec, 4, 8) as remote:
        b = remote.micro_batches(0)[0]
    assert b.images.dtype == torch.float32 and b.images.shape == (4, 3, 64, 64)
