"""Megatron-LM's flags on `meshtrain train`: the argument lists of Megatron-LM's example scripts
(examples/gpt3/train_gpt3_175b_distributed.sh and examples/llama/train_llama3_8b_h100_fp8.sh, sizes
scaled down, torchrun's own arguments dropped) parse to the config they mean; flags without effect
here are accepted with a warning, flags of features meshtrain lacks are all refused in one error."""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.services.checkpoint.reader import list_checkpoints
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.flags import (
    _DEFERRED_SWITCHES,
    _DEFERRED_VALUES,
    _ONLY_VALUE,
    ALIASES,
    parse_overrides,
)
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.config.megatron import (
    NO_EFFECT,
    NOT_BUILT,
    NOT_BUILT_PREFIXES,
    classify,
)
from meshtrain.services.trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parents[3]


def gpt3_args(data_path, vocab, merges, ckpt, tensorboard, tp=2, pp=2):
    """The GPT-3 175B example's arrays, in its order; 96 layers of 12288 -> 4 of 64,
    1536 samples -> 8, tensor x pipeline parallel 8 x 16 -> tp x pp."""
    model = [
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--max-position-embeddings",
        "32",
        "--attention-backend",
        "auto",
    ]
    training = [
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--step-batch-size-schedule",
        "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536",
        "--train-iters",
        "3",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--init-method-std",
        "0.006",
        "--clip-grad",
        "1.0",
        "--fp16",
        "--lr",
        "6.0e-5",
        "--lr-decay-style",
        "cosine",
        "--min-lr",
        "6.0e-6",
        "--lr-warmup-fraction",
        ".001",
        "--lr-decay-iters",
        "1000",
    ]
    parallel = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    data = [
        "--data-path",
        str(data_path),
        "--vocab-file",
        str(vocab),
        "--merge-file",
        str(merges),
        "--split",
        "949,50,1",
    ]
    logging_ = [
        "--log-interval",
        "1",
        "--save-interval",
        "10000",
        "--eval-interval",
        "1000",
        "--save",
        str(ckpt),
        "--load",
        str(ckpt),
        "--eval-iters",
        "2",
        "--tensorboard-dir",
        str(tensorboard),
    ]
    return model + training + parallel + data + logging_


def llama3_args(ckpt, tensorboard, cache, data_path=None, tokenizer_model=None):
    """The Llama 3 8B FP8 example's arrays, in its order, with its mock-data branch (or with
    `data_path` its real-data one); 32 layers of 4096 -> 2 of 64 (head width 16), 8192 tokens
    -> 32, its sample counts -> a few batches of 8, a 128256-token vocabulary -> 512."""
    model = [
        "--use-mcore-models",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--ffn-hidden-size",
        "160",
        "--num-attention-heads",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--kv-channels",
        "16",
        "--seq-length",
        "32",
        "--max-position-embeddings",
        "32",
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        "1000000",
        "--rotary-percent",
        "1.0",
        "--attention-dropout",
        "0.0",
        "--hidden-dropout",
        "0.0",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--init-method-std",
        "0.0134",
        "--attention-backend",
        "fused",
        "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
    ]
    training = [
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "8",
        "--train-samples",
        "26",
        "--lr-decay-samples",
        "20",
        "--lr-warmup-samples",
        "8",
        "--lr",
        "0.00015",
        "--min-lr",
        "0.00001",
        "--decoupled-lr",
        "5.0e-4",
        "--decoupled-min-lr",
        "4.5e-5",
        "--lr-decay-style",
        "cosine",
        "--clip-grad",
        "1.0",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--bf16",
        "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion",
        "--calculate-per-token-loss",
        "--manual-gc",
        "--empty-unused-memory-level",
        "1",
        "--exit-duration-in-mins",
        "235",
    ]
    fp8 = [
        "--fp8-format",
        "hybrid",
        "--fp8-amax-history-len",
        "1024",
        "--fp8-amax-compute-algo",
        "max",
        "--fp8-param-gather",
    ]
    parallel = [
        "--tensor-model-parallel-size",
        "1",
        "--context-parallel-size",
        "1",
        "--sequence-parallel",
    ]
    ddp = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    if data_path is None:
        data = [
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "128256",
            "--data-cache-path",
            str(cache),
            "--tiktoken-pattern",
            "v2",
            "--split",
            "99,1,0",
            "--no-create-attention-mask-in-dataloader",
            "--no-mmap-bin-files",
            "--num-workers",
            "1",
        ]
    else:
        data = [
            "--data-path",
            str(data_path),
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            str(tokenizer_model),
            "--data-cache-path",
            str(cache),
            "--split",
            "99,1,0",
            "--no-create-attention-mask-in-dataloader",
            "--no-mmap-bin-files",
            "--num-workers",
            "1",
            "--vocab-size",
            "512",
        ]
    logging_ = [
        "--log-interval",
        "1",
        "--eval-iters",
        "32",
        "--eval-interval",
        "100",
        "--save-interval",
        "1000",
        "--log-throughput",
        "--profile",
        "--profile-step-start",
        "4",
        "--profile-step-end",
        "6",
        "--ckpt-format",
        "torch_dist",
        "--distributed-timeout-minutes",
        "60",
        "--save",
        str(ckpt),
        "--load",
        str(ckpt),
        "--tensorboard-dir",
        str(tensorboard),
    ]
    return (
        model + training + ddp + fp8 + parallel + data + logging_
    )  # DDP_ARGS join TRAINING_ARGS there


def without(args, flags):
    """`args` less `flags` and the words after each (their values)."""
    out, skipping = [], False
    for word in args:
        if word.startswith("--"):
            skipping = word in flags
        if not skipping:
            out.append(word)
    return out


def refused_flags(args) -> set[str]:
    with pytest.raises(ConfigError) as e:
        load_config(args)
    message = str(e.value)
    count = len(message.splitlines()) - 1
    assert message.startswith(f"{count} Megatron-LM flag(s) of features meshtrain does not have")
    return {line.split(":")[0].strip() for line in message.splitlines()[1:]}


GPT3_REFUSED = {"--fp16", "--step-batch-size-schedule"}
LLAMA_REFUSED = {
    "--apply-layernorm-1p",
    "--decoupled-lr",
    "--decoupled-min-lr",
    "--calculate-per-token-loss",
    "--exit-duration-in-mins",
    "--fp8-param-gather",
    "--mock-data",
    "--profile",
    "--profile-step-start",
    "--profile-step-end",
}


@pytest.fixture
def gpt2_files(tmp_path):
    """A GPT-2 style vocab.json / merges.txt pair:
    the 256 byte symbols, a few merges, <|endoftext|>."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("s", "e"), ("Ġ", "s"), ("i", "n"), ("r", "e"), ("Ġ", "t")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "gpt2-vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "gpt2-merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    )
    return tmp_path / "gpt2-vocab.json", tmp_path / "gpt2-merges.txt"


def test_the_gpt3_example_parses_to_what_it_means(tmp_path, gpt2_files, caplog):
    vocab, merges = gpt2_files
    args = gpt3_args(
        tmp_path / "corpus_text_document", vocab, merges, tmp_path / "ckpt", tmp_path / "tb"
    )
    assert refused_flags(args) == GPT3_REFUSED
    # Megatron-LM's default attention dropout (0.1) needs dropout inside tensor-parallel regions
    with pytest.raises(ConfigError) as e:
        load_config(without(args, GPT3_REFUSED))
    assert (
        "model.attention_dropout=0.1 is Megatron-LM's default --attention-dropout, taken because "
        "this is a Megatron-LM command line: give --attention-dropout to choose another"
    ) in str(e.value)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="meshtrain.config"):
        job = load_config([*without(args, GPT3_REFUSED), "--attention-dropout", "0.0"])
    m, t, o, p, d, c, lg = (
        job.model,
        job.train,
        job.optim,
        job.parallel,
        job.data,
        job.checkpoint,
        job.log,
    )
    assert (
        m.num_layers,
        m.hidden_size,
        m.num_attention_heads,
        m.seq_length,
        m.max_position_embeddings,
        m.attention_backend,
        m.init_method_std,
    ) == (4, 64, 4, 32, 32, "auto", 0.006)
    # what the script leaves out is Megatron-LM's: dropout, decayed embeddings, the FP8 recipe
    assert (m.hidden_dropout, m.attention_dropout, o.decay_embeddings, job.train.fp8_recipe) == (
        0.1,
        0.0,
        True,
        "delayed",
    )
    assert re.search(r"model\.hidden_dropout +0\.1 +\(--hidden-dropout;", caplog.text)
    assert (
        t.micro_batch_size,
        t.global_batch_size,
        t.train_iters,
        t.eval_interval,
        t.eval_iters,
        t.bf16,
    ) == (2, 8, 3, 1000, 2, False)
    assert (
        o.weight_decay,
        o.adam_beta1,
        o.adam_beta2,
        o.clip_grad,
        o.lr,
        o.min_lr,
        o.lr_decay_style,
        o.lr_warmup_fraction,
        o.lr_decay_iters,
    ) == (0.1, 0.9, 0.95, 1.0, 6e-5, 6e-6, "cosine", 0.001, 1000)
    assert (p.tp, p.pp) == (2, 2)
    assert d.data_path == [str(tmp_path / "corpus_text_document")] and d.split == "949,50,1"
    # no --tokenizer-type in the script: vocab + merges are GPT-2's BPE, the one type reading both
    assert d.tokenizer_type == "GPT2BPETokenizer" and d.tokenizer == f"gpt2bpe:{vocab},{merges}"
    assert "GPT2BPETokenizer, the tokenizer that reads both" in caplog.text
    assert (c.save, c.load, c.save_interval) == (
        str(tmp_path / "ckpt"),
        str(tmp_path / "ckpt"),
        10000,
    )
    assert (lg.log_interval, lg.tensorboard_dir) == (1, str(tmp_path / "tb"))


def test_the_llama3_example_parses_to_what_it_means(tmp_path, caplog):
    args = llama3_args(tmp_path / "ckpt", tmp_path / "tb", tmp_path / "cache")
    assert refused_flags(args) == LLAMA_REFUSED
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="meshtrain.config"):
        job = load_config(without(args, LLAMA_REFUSED))
    m, t, o, p, d, lg = job.model, job.train, job.optim, job.parallel, job.data, job.log
    assert (
        m.num_layers,
        m.hidden_size,
        m.ffn_hidden_size,
        m.num_attention_heads,
        m.num_query_groups,
        m.kv_channels,
        m.seq_length,
        m.max_position_embeddings,
    ) == (2, 64, 160, 4, 2, 16, 32, 32)
    assert (
        m.position_embedding_type,
        m.rotary_base,
        m.activation,
        m.normalization,
        m.init_method_std,
    ) == ("rope", 1e6, "swiglu", "rmsnorm", 0.0134)
    assert m.attention_backend == "cudnn"  # Transformer Engine's fused attention is cuDNN's
    assert (
        m.untie_embeddings_and_output_weights,
        m.add_bias_linear,
        m.attention_dropout,
        m.hidden_dropout,
    ) == (True, False, 0.0, 0.0)
    # samples in steps of the global batch of 8: the run as Megatron counts it (26 // 8), the
    # schedule rounded to whole steps (20 / 8 = 2.5 -> 2, with a warning; 8 / 8 = 1 exactly)
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters) == (1, 8, 3)
    assert (o.lr_decay_iters, o.lr_warmup_iters, o.lr, o.min_lr) == (2, 1, 1.5e-4, 1e-5)
    assert "--lr-decay-samples=20 is 2.50 steps of 8 samples: --lr-decay-iters=2" in caplog.text
    assert "--lr-warmup-samples" not in caplog.text
    assert (
        t.bf16,
        p.grad_reduce_dtype,
        p.use_distributed_optimizer,
        p.overlap_grad_reduce,
        p.overlap_param_gather,
    ) == (True, "bf16", True, True, True)
    # no --fp8-recipe in the script: Megatron-LM's default, delayed scaling
    assert (t.fp8, t.fp8_recipe, t.fp8_amax_history_len, t.fp8_amax_compute_algo) == (
        "hybrid",
        "delayed",
        1024,
        "max",
    )
    assert (p.tp, p.cp, p.sequence_parallel, p.distributed_timeout_minutes) == (1, 1, False, 60.0)
    assert "--sequence-parallel with --tensor-model-parallel-size 1: off" in caplog.text
    assert (d.tokenizer, d.vocab_size, d.tiktoken_pattern, d.split, d.cache_dir) == (
        "null:128256",
        128256,
        None,
        "99,1,0",
        str(tmp_path / "cache"),
    )
    assert (lg.log_interval, t.eval_iters, t.eval_interval, job.checkpoint.save_interval) == (
        1,
        32,
        100,
        1000,
    )
    assert lg.tensorboard_dir == str(tmp_path / "tb")
    no_effect = {
        "--use-mcore-models",
        "--cross-entropy-loss-fusion",
        "--manual-gc",
        "--empty-unused-memory-level",
        "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files",
        "--num-workers",
        "--log-throughput",
        "--ckpt-format",
    }
    warned = set(re.findall(r"(--[a-z0-9-]+): accepted without effect", caplog.text))
    assert warned == no_effect
    assert all(caplog.text.count(f"{flag}: accepted") == 1 for flag in no_effect)


def test_the_refusal_names_each_flag_with_its_reason():
    with pytest.raises(ConfigError) as e:
        load_config(
            [
                "--fp16",
                "--loss-scale",
                "1024",
                "--hidden-size",
                "64",
                "--inference-max-requests",
                "8",
                "--rampup-batch-size",
                "16",
                "16",
                "1000",
            ]
        )
    lines = str(e.value).splitlines()
    assert lines[0].startswith("4 Megatron-LM flag(s)")
    assert lines[1:] == [
        "  --fp16: meshtrain has no fp16 mixed precision (loss scaling): use --bf16",
        "  --loss-scale: meshtrain has no fp16 mixed precision (loss scaling): use --bf16",
        "  --inference-max-requests: meshtrain has no inference server (see `meshtrain generate`)",
        "  --rampup-batch-size: meshtrain has no batch-size ramp-up: "
        "the global batch size is fixed (train.global_batch_size)",
    ]


def test_no_effect_flags_take_their_value_or_none():
    job = load_config(
        [
            "--use-flash-attn",
            "--num-workers",
            "4",
            "--hidden-size",
            "96",
            "--transformer-impl",
            "transformer_engine",
            "--no-masked-softmax-fusion",
        ]
    )
    assert job.model.hidden_size == 96 and job.model.transformer_impl == "local"
    with pytest.raises(ConfigError, match="--use-flash-attn is a switch"):
        load_config(["--use-flash-attn=1"])
    with pytest.raises(ConfigError, match="--num-workers needs a value"):
        load_config(["--num-workers", "--bf16"])


def test_the_tables_do_not_overlap_and_every_reason_is_one_line():
    special = {*_DEFERRED_SWITCHES, *_DEFERRED_VALUES, *_ONLY_VALUE}
    not_built = {flag for flags in NOT_BUILT.values() for flag in flags}
    for flag in [*ALIASES, *special]:
        assert classify(flag) is None, flag
    assert not set(NO_EFFECT) & not_built
    for why in [
        *NOT_BUILT,
        *NOT_BUILT_PREFIXES.values(),
        *(why for _, why in NO_EFFECT.values()),
    ]:
        assert why and "\n" not in why


def test_group_query_attention_reads_num_query_groups_as_megatron(caplog):
    assert (
        load_config(["--group-query-attention"]).model.num_query_groups == 1
    )  # Megatron's default
    assert (
        load_config(["--group-query-attention", "--num-query-groups", "2"]).model.num_query_groups
        == 2
    )
    with caplog.at_level(logging.WARNING, logger="meshtrain.config"):
        assert load_config(["--num-query-groups", "2"]).model.num_query_groups == 2
    assert (
        "without --group-query-attention: applied here, where Megatron-LM would ignore it"
        in caplog.text
    )
    assert load_config([]).model.num_query_groups is None


def test_flags_with_one_accepted_value_or_spelling():
    assert load_config(["--rotary-percent", "1"]).model.position_embedding_type == "learned"
    with pytest.raises(
        ConfigError,
        match="--rotary-percent: only 1.0 is accepted: rotary embeddings cover the whole",
    ):
        load_config(["--rotary-percent", "0.5"])
    spellings = {
        "auto": "auto",
        "flash": "flash",
        "fused": "cudnn",
        "unfused": "math",
        "local": "math",
    }
    for megatron, ours in spellings.items():
        assert load_config(["--attention-backend", megatron]).model.attention_backend == ours


def test_recompute_and_optimizer_flags():
    assert load_config(["--recompute-activations"]).parallel.recompute_granularity == "selective"
    p = load_config(["--checkpoint-activations"]).parallel
    assert (p.recompute_granularity, p.recompute_method, p.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )
    o = load_config(
        ["--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear", "--lr-wsd-decay-iters", "20"]
    ).optim
    assert (o.lr_decay_style, o.lr_wsd_decay_style, o.lr_wsd_decay_iters) == ("wsd", "linear", 20)
    with pytest.raises(ConfigError, match="lr_decay_style='wsd' needs optim.lr_wsd_decay_iters"):
        load_config(["--lr-decay-style", "WSD"])
    with pytest.raises(
        ConfigError, match="set one of optim.lr_warmup_iters and optim.lr_warmup_fraction"
    ):
        load_config(["--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"])
    assert load_config(["--norm-epsilon", "1e-6"]).model.norm_epsilon == 1e-6
    assert (
        load_config(["--batch-size", "4", "--global-batch-size", "8"]).train.micro_batch_size == 4
    )


def test_sample_counts_need_the_global_batch_and_exclude_iterations():
    t = load_config(
        ["--global-batch-size", "16", "--micro-batch-size", "4", "--train-samples", "100"]
    ).train
    assert t.train_iters == 6  # Megatron: train_samples // global_batch_size
    with pytest.raises(
        ConfigError, match="--train-samples counts samples: give --global-batch-size"
    ):
        load_config(["--train-samples", "100"])
    with pytest.raises(
        ConfigError, match="--lr-decay-samples and --lr-decay-iters both set optim.lr_decay_iters"
    ):
        load_config(
            ["--global-batch-size", "8", "--lr-decay-samples", "80", "--lr-decay-iters", "10"]
        )
    with pytest.raises(ConfigError, match="must be a number of samples"):
        load_config(["--global-batch-size", "8", "--train-samples", "1e3"])
    o = load_config(
        ["--global-batch-size", "8", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "16"]
    ).optim
    assert o.lr_wsd_decay_iters == 2


def test_rope_scaling_and_layer_flags():
    assert (
        load_config(
            ["--position-embedding-type", "rope", "--use-rope-scaling"]
        ).model.rope_scaling_factor
        == 8.0
    )
    m = load_config(
        ["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "32"]
    ).model
    assert m.rope_scaling_factor == 32.0
    with pytest.raises(ConfigError, match="--rope-scaling-factor applies with --use-rope-scaling"):
        load_config(["--rope-scaling-factor", "32"])
    m = load_config(["--add-qkv-bias", "--disable-bias-linear", "--qk-layernorm"]).model
    assert (m.qkv_bias, m.qk_norm, m.add_bias_linear) == (True, True, False)


def test_tracking_and_data_flags(tmp_path):
    args = [
        "--tensorboard-dir",
        str(tmp_path / "tb"),
        "--wandb-project",
        "p",
        "--wandb-exp-name",
        "run-1",
        "--wandb-save-dir",
        str(tmp_path / "wb"),
        "--wandb-entity",
        "team",
        "--eod-mask-loss",
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--async-save",
    ]
    _, table = parse_overrides(args)
    assert table["log"] == {
        "tensorboard_dir": str(tmp_path / "tb"),
        "wandb_project": "p",
        "wandb_exp_name": "run-1",
        "wandb_save_dir": str(tmp_path / "wb"),
        "wandb_entity": "team",
    }
    job = load_config(args)
    assert (job.data.eod_mask_loss, job.data.cache_dir, job.checkpoint.async_save) == (
        True,
        str(tmp_path / "cache"),
        True,
    )
    with pytest.raises(
        ConfigError, match="log.wandb_exp_name is a W&B setting: it needs log.wandb_project"
    ):
        load_config(["--wandb-exp-name", "x"])


def test_tiktoken_flags_apply_to_tiktoken_only(caplog):
    with caplog.at_level(logging.WARNING, logger="meshtrain.config"):
        job = load_config(
            ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--tiktoken-pattern", "v2"]
        )
    assert job.data.tiktoken_pattern is None
    assert (
        "--tiktoken-pattern applies to --tokenizer-type TikTokenizer: not used with NullTokenizer"
        in caplog.text
    )


@pytest.mark.e2e
def test_the_gpt3_example_trains_from_the_command_line(tmp_path, gpt2_files):
    """The GPT-3 example's list (less its two refused flags, at tp = pp = 1 on one CPU process)
    given to `meshtrain train` as pasted: 3 steps on an indexed dataset built with its GPT-2 BPE
    files, metrics.jsonl and TensorBoard hold every step, the final checkpoint is saved."""
    from meshtrain.services.dataloader.preprocess import default_corpus_files, preprocess_files
    from meshtrain.services.dataloader.tokenizers.megatron import GPT2BPETokenizer

    vocab, merges = gpt2_files
    prefix = preprocess_files(
        default_corpus_files(80_000),
        tmp_path / "corpus_text_document",
        GPT2BPETokenizer(str(vocab), str(merges)),
    )
    args = without(
        gpt3_args(prefix, vocab, merges, tmp_path / "ckpt", tmp_path / "tb", tp=1, pp=1),
        GPT3_REFUSED,
    )
    proc = run_cli([*args, "--run-dir", str(tmp_path / "run")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GPT2BPETokenizer, the tokenizer that reads both" in proc.stderr
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval_loss" in r] == [3]
    # warmup: .001 of 1000 decay steps -> 1 step, then cosine from 6e-5 towards 6e-6 over 1000
    assert rows[0]["lr"] == pytest.approx(6e-5)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert list_checkpoints(str(tmp_path / "ckpt")) == [3]  # --save, at the last step


def run_cli(args, cwd):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "meshtrain.services.cli", "train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.e2e
def test_the_llama3_example_trains_from_the_command_line(tmp_path):
    """The Llama 3 8B example's list with its real-data branch (a Hugging Face tokenizer.json and an
    indexed dataset built with it), less its refused flags, with the CPU's attention backend:
    grouped-query attention with explicit head width, RoPE, SwiGLU, RMSNorm, untied embeddings,
    bf16, ZeRO-1 and the sample-counted schedule train 3 steps on CPU; the run's config.toml holds
    what the flags meant."""
    from meshtrain.services.dataloader.preprocess import default_corpus_files, preprocess_files
    from meshtrain.services.dataloader.tokenizers.base import train_bpe

    text = "".join(path.read_text() for path in default_corpus_files(80_000))
    docs = (
        tmp_path / "docs.jsonl"
    )  # 300-character documents: --split 99,1,0 leaves some for validation
    docs.write_text(
        "".join(json.dumps({"text": text[i : i + 300]}) + "\n" for i in range(0, len(text), 300))
    )
    tokenizer = train_bpe([docs], 300, tmp_path / "tokenizer.json")
    prefix = preprocess_files([docs], tmp_path / "corpus_text_document", tokenizer)
    args = llama3_args(
        tmp_path / "ckpt", tmp_path / "tb", tmp_path / "cache", prefix, tmp_path / "tokenizer.json"
    )
    args[args.index("fused")] = (
        "auto"  # --attention-backend fused is cuDNN's, which runs on CUDA only
    )
    proc = run_cli(
        [*without(args, LLAMA_REFUSED - {"--mock-data"}), "--run-dir", str(tmp_path / "run")],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    # --lr-warmup-samples 8 = 1 step, then cosine over --lr-decay-samples 20 -> 2 steps, then min_lr
    assert [r["lr"] for r in rows if "lr" in r] == pytest.approx([1.5e-4, 1.5e-4, 1e-5])
    job = load_config(["--config", str(tmp_path / "run" / "config.toml")])
    assert (
        job.model.num_query_groups,
        job.model.kv_channels,
        job.model.rotary_base,
        job.train.bf16,
        job.parallel.use_distributed_optimizer,
        job.train.fp8,
    ) == (2, 16, 1e6, True, True, "hybrid")
    assert list_checkpoints(str(tmp_path / "ckpt")) == [3]
