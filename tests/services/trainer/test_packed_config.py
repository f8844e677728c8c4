"""The packed-document settings: Megatron's flags, what they need, what they refuse."""

import pytest

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.data import batch_options


def test_megatron_flags_set_the_data_keys():
    job = load_config(["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"])
    d = job.data
    assert (d.reset_attention_mask, d.reset_position_ids, d.eod_mask_loss) == (True, True, True)
    plain = load_config([])
    assert (plain.data.reset_attention_mask, plain.data.reset_position_ids) == (False, False)
    dotted = load_config(["--data.reset_position_ids=true"])
    assert dotted.data.reset_position_ids and not dotted.data.reset_attention_mask


def test_batch_options_follow_the_keys():
    job = load_config(["--reset-attention-mask", "--reset-position-ids"])
    opts = batch_options(job, 7, "byte")
    assert (opts.eod_id, opts.document_ids, opts.position_ids, opts.mask_eod_loss) == (
        7,
        True,
        True,
        False,
    )


@pytest.mark.parametrize("eod_id", [None, -1])
def test_a_tokenizer_without_eod_is_refused_naming_the_keys(eod_id):
    job = load_config(["--reset-attention-mask", "--reset-position-ids"])
    with pytest.raises(
        ConfigError,
        match=r"data.reset_attention_mask, data.reset_position_ids .* tokenizer tok.model has none",
    ):
        batch_options(job, eod_id, "tok.model")
    assert batch_options(load_config([]), None, "tok.model").document_ids is False


@pytest.mark.parametrize(
    "args,match",
    [
        (
            ["--parallel.cp=2", "--parallel.cp_comm_type=a2a", '--data.service_addresses=["h:1"]'],
            "sends a context-parallel rank only its chunks",
        ),
        (["--train.cuda_graph=true"], "train.cuda_graph replays one captured micro-batch"),
    ],
)
def test_what_document_masking_does_not_combine_with(args, match):
    with pytest.raises(ConfigError, match=match):
        load_config(["--reset-attention-mask", "--model.seq_length=64", *args])
    # positions alone need no mask: CUDA graphs take them
    if "service_addresses" not in " ".join(args):
        load_config(["--reset-position-ids", "--model.seq_length=64", *args])


@pytest.mark.parametrize(
    "args",
    [
        ["--parallel.cp=2"],
        ["--parallel.cp=2", "--parallel.cp_comm_type=a2a"],
        [
            "--parallel.cp=4",
            "--parallel.cp_comm_type=a2a+p2p",
            "--parallel.hierarchical_context_parallel_sizes=[2, 2]",
        ],
    ],
)
def test_every_context_parallel_comm_type_takes_document_masking(args):
    job = load_config(
        ["--reset-attention-mask", "--reset-position-ids", "--model.seq_length=64", *args]
    )
    assert job.data.reset_attention_mask and job.parallel.cp > 1
