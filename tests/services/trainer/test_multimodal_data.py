"""`data.format = "multimodal"`: the [data] keys, and build_data's sources in-process and from
the data service giving the same batches."""

import pytest
import torch

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.dataloader.rpc.server import start_server
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.data import build_data
from tests.services.dataloader.conftest import served_limits
from tests.services.dataloader.test_vision import load_shapes


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes-trainer")
    return load_shapes().write_shapes(out, samples=40, seed=2, image_size=32, shard_size=20)


def job(path, *extra):
    return load_config(
        [
            f"--data.data_path={path}",
            "--data.format=multimodal",
            "--data.tokenizer=byte",
            "--data.image_size=32",
            "--data.tokens_per_image=4",
            "--data.split=90,10,0",
            "--data.bad_image_policy=skip",
            "--model.seq_length=64",
            "--train.micro_batch_size=2",
            "--train.global_batch_size=4",
            "--train.train_iters=5",
            "--train.eval_interval=0",
            *extra,
        ]
    )


def test_in_process_and_service_sources_agree(shapes):
    local = build_data(job(shapes["wds"]))
    assert local.vocab_size == 258  # bytes, EOD, and the placeholder the tokenizer lacks
    srv, port, _ = start_server(0, limits=served_limits())
    try:
        remote = build_data(
            job(
                shapes["wds"],
                f"--data.service_addresses=127.0.0.1:{port}",
                "--data.image_wire_dtype=bfloat16",
            )
        )
        for step in range(3):
            for a, b in zip(local.train.micro_batches(step), remote.train.micro_batches(step)):
                assert torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)
                assert int((a.tokens == 257).sum()) == 4 * a.images.shape[0]
                assert torch.allclose(a.images, b.images, atol=2e-2, rtol=1e-2)
        remote.train.close()
    finally:
        srv.stop(0)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--data.format=images"], "data.format='images' is not one of"),
        (["--data.bad_image_policy=ignore"], "data.bad_image_policy='ignore' is not one of"),
        (["--data.image_resize=stretch"], "data.image_resize='stretch'"),
        (["--data.eod_mask_loss=true"], "data.eod_mask_loss: not with data.format='multimodal'"),
        (["--model.vocab_size=257"], "model.vocab_size=257 is smaller"),
    ],
)
def test_bad_keys_are_named(shapes, args, match):
    with pytest.raises(ConfigError, match=match):
        build_data(job(shapes["wds"], *args))


def test_multimodal_needs_sources():
    with pytest.raises(ConfigError, match="needs data.data_path"):
        load_config(["--data.format=multimodal", "--data.tokenizer=byte"])
