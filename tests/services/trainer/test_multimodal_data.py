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


VISION_ARGS = [
    "--model.vision.image_size=32",
    "--model.vision.patch_size=16",
    "--model.vision.hidden_size=16",
    "--model.vision.num_layers=2",
    "--model.vision.num_attention_heads=2",
    "--model.vision.ffn_hidden_size=32",
    "--model.vision.image_token_id=257",
]
"""A tiny encoder for 32x32 images: 4 patches of 16x16, so 4 placeholders an image."""


def job(path, *extra):
    return load_config(
        [
            f"--data.data_path={path}",
            "--data.format=multimodal",
            "--data.tokenizer=byte",
            *VISION_ARGS,
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
        (["--model.vocab_size=257"], "image_token_id=257 is outside the vocabulary of 257"),
    ],
)
def test_bad_keys_are_named(shapes, args, match):
    with pytest.raises(ConfigError, match=match):
        build_data(job(shapes["wds"], *args))


def test_multimodal_needs_sources():
    with pytest.raises(ConfigError, match="needs data.data_path"):
        load_config(["--data.format=multimodal", "--data.tokenizer=byte"])


def test_the_data_follows_model_vision(shapes):
    d = job(shapes["wds"]).data
    assert (d.image_size, d.tokens_per_image, d.image_token_id) == (32, 4, 257)
    assert d.image_normalization == "clip"
    d = job(
        shapes["wds"],
        "--model.vision.variant=siglip",
        "--model.vision.norm_epsilon=1e-6",
    ).data
    assert d.image_normalization == "siglip"  # the variant's statistics
    d = job(shapes["wds"], "--model.vision.select_feature=cls_patch").data
    assert d.tokens_per_image == 5  # the class token kept
    # given explicitly: equal values are fine, the normalization is the user's to choose
    d = job(
        shapes["wds"],
        "--data.image_size=32",
        "--data.tokens_per_image=4",
        "--data.image_token_id=257",
        "--data.image_normalization=siglip",
    ).data
    assert d.image_normalization == "siglip"


@pytest.mark.parametrize(
    "args, match",
    [
        (["--data.image_size=64"], r"data.image_size=64 does not match model.vision.image_size=32"),
        (["--data.tokens_per_image=5"], r"data.tokens_per_image=5 does not match the encoder's"),
        (
            ["--data.image_token_id=300", "--model.vocab_size=512"],
            "data.image_token_id=300 does not match model.vision.image_token_id=257",
        ),
    ],
)
def test_data_and_model_disagreeing_is_named(shapes, args, match):
    with pytest.raises(ConfigError, match=match):
        job(shapes["wds"], *args)


def test_multimodal_data_needs_model_vision(shapes):
    with pytest.raises(ConfigError, match="model.vision is unset"):
        load_config(
            [
                f"--data.data_path={shapes['wds']}",
                "--data.format=multimodal",
                "--data.tokenizer=byte",
            ]
        )


def test_model_vision_reads_text_only_data():
    """A vision-language model on text data is allowed (its samples carry no images): the
    image keys stay unset."""
    d = load_config(VISION_ARGS).data
    assert d.format == "gpt" and d.image_size is None and d.tokens_per_image is None
