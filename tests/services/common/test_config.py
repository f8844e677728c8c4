"""Config machinery: TOML + overrides into typed dataclasses, errors that name the key."""

import dataclasses

import pytest
import tomli_w

from meshtrain.services.common import config as cfg
from meshtrain.services.common.errors import ConfigError, NotBuiltError
from meshtrain.services.trainer.config.flags import parse_overrides
from meshtrain.services.trainer.config.load import REMOVED_KEYS, config_help, load_config, replace
from meshtrain.services.trainer.config.sections import JobConfig


def test_defaults_build_and_round_trip_through_toml(tmp_path):
    job = load_config([])
    path = tmp_path / "c.toml"
    path.write_text(cfg.dumps_toml(job))
    assert load_config(["--config", str(path)]) == job


def test_file_then_overrides_in_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nhidden_size = 256\nnum_layers = 6\n[train]\nbf16 = false\n")
    job = load_config(
        [
            "--config",
            str(path),
            "--model.num_layers=3",
            "--bf16",
            "--lr",
            "1e-3",
            "--model.seq_length",
            "64",
        ]
    )
    assert job.model.hidden_size == 256
    assert job.model.num_layers == 3
    assert job.model.seq_length == 64
    assert job.train.bf16 is True
    assert job.optim.lr == 1e-3


@pytest.mark.parametrize(
    "flag,key,value,expected",
    [
        ("--num-layers", "model.num_layers", "7", 7),
        ("--hidden-size", "model.hidden_size", "96", 96),
        ("--num-attention-heads", "model.num_attention_heads", "8", 8),
        ("--num-query-groups", "model.num_query_groups", "2", 2),
        ("--ffn-hidden-size", "model.ffn_hidden_size", "300", 300),
        ("--seq-length", "model.seq_length", "512", 512),
        ("--micro-batch-size", "train.micro_batch_size", "4", 4),
        ("--global-batch-size", "train.global_batch_size", "64", 64),
        ("--lr", "optim.lr", "0.01", 0.01),
        ("--min-lr", "optim.min_lr", "0.0", 0.0),
        ("--lr-warmup-iters", "optim.lr_warmup_iters", "5", 5),
        ("--train-iters", "train.train_iters", "9", 9),
        ("--weight-decay", "optim.weight_decay", "0", 0.0),
        ("--clip-grad", "optim.clip_grad", "0.5", 0.5),
        ("--seed", "train.seed", "42", 42),
        ("--save", "checkpoint.save", "ckpts", "ckpts"),
        ("--load", "checkpoint.load", "123", "123"),
        ("--save-interval", "checkpoint.save_interval", "10", 10),
        ("--eval-interval", "train.eval_interval", "0", 0),
        ("--run-dir", "log.run_dir", "runs/x", "runs/x"),
        ("--recompute-granularity", "parallel.recompute_granularity", "full", "full"),
    ],
)
def test_megatron_aliases_map_to_keys(flag, key, value, expected):
    job = load_config([flag, value])
    section, name = key.split(".")
    got = getattr(getattr(job, section), name)
    assert got == expected and type(got) is type(expected)


def test_fp32_residual_connection_is_megatrons_switch():
    """Off by default (a bf16 stream under autocast, as in Megatron-LM);
    the Megatron flag turns it on."""
    assert load_config([]).model.fp32_residual_connection is False
    assert load_config(["--fp32-residual-connection"]).model.fp32_residual_connection is True


def test_data_path_takes_several_words_and_strings_stay_strings():
    _, table = parse_overrides(["--data-path", "a/b", "--tokenizer", "byte"])
    assert table["data"]["data_path"] == ["a/b"]
    _, table = parse_overrides(["--data-path", "0.5", "a", "0.5", "b", "--seed", "3"])
    assert table["data"]["data_path"] == ["0.5", "a", "0.5", "b"] and table["train"]["seed"] == 3


@pytest.mark.parametrize("flag", ["--data-path", "--data-service-addresses"])
def test_a_word_list_flag_without_words_is_named(flag):
    # both take their words the same way; the message named --data-path for either
    with pytest.raises(ConfigError, match=f"^{flag} needs a value$"):
        parse_overrides([flag, "--bf16"])


def test_megatron_value_spellings():
    job = load_config(
        ["--normalization", "RMSNorm", "--position-embedding-type", "learned_absolute"]
    )
    assert job.model.normalization == "rmsnorm" and job.model.position_embedding_type == "learned"


def test_unknown_key_names_key_and_allowed():
    with pytest.raises(
        ConfigError, match=r"unknown flag --model\.hiden_size; did you mean --model\.hidden_size"
    ):
        load_config(["--model.hiden_size=3"])
    with pytest.raises(
        ConfigError, match=r"unknown flag --modle\.hidden_size; did you mean --model\.hidden_size"
    ):
        load_config(["--modle.hidden_size=3"])


def test_unknown_key_suggests_the_closest_keys_not_the_whole_list():
    # a key from a TOML file: named as a key, with its near names only
    with pytest.raises(ConfigError) as e:
        load_config([], base={"model": {"num_layer": 2}})
    msg = str(e.value)
    assert "did you mean 'model.num_layers'" in msg and "hidden_size" not in msg and "\n" not in msg
    with pytest.raises(ConfigError, match=r"unknown flag --num_layers; did you mean --num-layers"):
        load_config(["--num_layers", "2"])
    with pytest.raises(ConfigError) as e:
        load_config(["--model.xyzzy=1"])
    assert "help-config" in str(e.value) and "hidden_size" not in str(e.value)


def test_unknown_key_in_file_names_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nmicro_batch = 3\n")
    with pytest.raises(ConfigError, match=r"train\.micro_batch"):
        load_config(["--config", str(path)])


def test_wrong_types_name_key_and_expected():
    with pytest.raises(ConfigError, match=r"model\.hidden_size: got 'abc'.*integer"):
        load_config(["--hidden-size", "abc"])
    with pytest.raises(ConfigError, match=r"train\.bf16.*true or false"):
        load_config(["--train.bf16=1"])
    with pytest.raises(ConfigError, match=r"model\.normalization.*'layernorm', 'rmsnorm'"):
        load_config(["--model.normalization=batchnorm"])
    with pytest.raises(ConfigError, match=r"model\.num_layers: got 2\.5"):
        load_config(["--model.num_layers=2.5"])


def test_unknown_flag_and_missing_value():
    with pytest.raises(ConfigError, match="unknown flag --foo"):
        load_config(["--foo", "1"])
    with pytest.raises(ConfigError, match="--hidden-size needs a value"):
        load_config(["--hidden-size"])
    with pytest.raises(ConfigError, match="switch"):
        load_config(["--bf16=true"])


def test_missing_config_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(["--config", str(tmp_path / "nope.toml")])
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(["--config", str(bad)])


@pytest.mark.parametrize(
    "args",
    [
        [
            "--model.transformer_impl=transformer_engine"
        ],  # Megatron's --transformer-impl is a no-op (test_flags.py)
    ],
)
def test_unbuilt_features_are_rejected_not_ignored(args):
    with pytest.raises(NotBuiltError, match="not built yet"):
        load_config(args)


def test_parallel_flags_map_and_validate():
    job = load_config(
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
        ]
    )
    p = job.parallel
    assert (
        p.tp,
        p.sequence_parallel,
        p.use_distributed_optimizer,
        p.overlap_grad_reduce,
        p.overlap_param_gather,
    ) == (2, True, True, True, True)
    with pytest.raises(ConfigError, match="sequence_parallel needs parallel.tp > 1"):
        load_config(["--sequence-parallel"])
    with pytest.raises(ConfigError, match="overlap_param_gather needs"):
        load_config(["--overlap-param-gather"])
    assert load_config([]).parallel.grad_reduce_dtype == "fp32"
    assert load_config(["--grad-reduce-in-bf16"]).parallel.grad_reduce_dtype == "bf16"
    with pytest.raises(ConfigError, match="grad_reduce_dtype"):
        load_config(["--parallel.grad_reduce_dtype=fp16"])


def test_context_parallel_flags_map_to_the_config():
    p = load_config(
        [
            "--context-parallel-size",
            "4",
            "--cp-comm-type",
            "a2a+p2p",
            "--hierarchical-context-parallel-sizes",
            "2",
            "2",
        ]
    ).parallel
    assert (p.cp, p.cp_comm_type, p.hierarchical_context_parallel_sizes, p.cp_a2a_size) == (
        4,
        "a2a+p2p",
        [2, 2],
        2,
    )
    p = load_config(["--context-parallel-size", "2", "--cp-comm-type", "a2a"]).parallel
    assert (p.cp, p.cp_comm_type, p.hierarchical_context_parallel_sizes, p.cp_a2a_size) == (
        2,
        "a2a",
        None,
        2,
    )
    assert load_config(["--context-parallel-size", "2"]).parallel.cp_comm_type == "p2p"


CP = ["--model.seq_length=64", "--model.num_attention_heads=4"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--context-parallel-size", "4", "--model.seq_length=36"],
            r"model\.seq_length=36 must be a multiple of 2 x cp = 8",
        ),
        (
            [
                "--context-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--model.seq_length=36",
            ],
            r"model\.seq_length=36 must be a multiple of 2 x cp x tp = 8",
        ),
        (
            ["--context-parallel-size", "8", "--cp-comm-type", "a2a"],
            r"4 heads per tensor-parallel rank .* multiple of 8",
        ),
        (
            [
                "--context-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "4",
                "--cp-comm-type",
                "a2a",
            ],
            r"1 heads per tensor-parallel rank .* multiple of 2",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--cp-comm-type",
                "a2a",
                "--model.num_attention_heads=12",
                "--model.hidden_size=96",
                "--model.num_query_groups=3",
            ],
            r"3 key/value heads per tensor-parallel rank neither split",
        ),
        (
            ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"],
            r"hierarchical_context_parallel_sizes.*got None",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--cp-comm-type",
                "a2a+p2p",
                "--hierarchical-context-parallel-sizes",
                "2",
                "4",
            ],
            r"multiplying to parallel\.cp=4, got \[2, 4\]",
        ),
        (
            ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "1", "1"],
            r"a2a\+p2p' needs parallel\.cp > 1",
        ),
        (
            ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"],
            r"hierarchical_context_parallel_sizes is for cp_comm_type='a2a\+p2p'; "
            r"cp_comm_type is 'p2p'",
        ),
        (
            ["--context-parallel-size", "2", "--model.attention_dropout=0.1"],
            r"model\.attention_dropout=0",
        ),
        (
            ["--context-parallel-size", "2", "--model.hidden_dropout=0.1"],
            r"model\.hidden_dropout=0",
        ),
        (
            ["--context-parallel-size", "2", "--model.attention_backend=cudnn"],
            r"model\.attention_backend='cudnn'",
        ),
        (["--context-parallel-size", "0"], r"parallel\.cp must be >= 1, got 0"),
    ],
)
def test_context_parallel_settings_it_cannot_run_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CP + args)


def test_context_parallel_without_its_processes_is_refused(monkeypatch):
    import torch

    from meshtrain.services.trainer.build import build_mesh

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"parallel\.cp=2 needs 2 processes"):
        build_mesh(load_config(CP + ["--context-parallel-size", "2"]), torch.device("cpu"))


@pytest.mark.parametrize(
    "args, message",
    [
        # all were accepted and ignored: only 'full' reads them
        # (Megatron-LM refuses them with 'selective')
        (
            ["--recompute-method", "block", "--recompute-num-layers", "3"],
            (
                r"^parallel\.recompute_method='block' and parallel\.recompute_num_layers=3 "
                r"apply to parallel\.recompute_granularity='full' only, got 'none'"
            ),
        ),
        (
            ["--recompute-method", "uniform"],
            r"^parallel\.recompute_method='uniform' applies to .*'full' only, got 'none'",
        ),
        (
            ["--recompute-num-layers", "2"],
            r"^parallel\.recompute_num_layers=2 applies to .*'full' only, got 'none'",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-method", "block"],
            r"^parallel\.recompute_method='block' applies to .*'full' only, got 'selective'",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
            r"^parallel\.recompute_num_layers=1 applies to .*'full' only, got 'selective'",
        ),
        (
            ["--recompute-granularity", "full", "--recompute-num-layers", "0"],
            r"recompute_num_layers must be positive",
        ),
    ],
)
def test_recompute_method_and_layers_without_full_granularity_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(args)


def test_full_recompute_defaults_to_uniform_chunks_of_one():
    p = load_config(["--recompute-granularity", "full"]).parallel
    assert (p.recompute_method, p.recompute_num_layers) == ("uniform", 1)
    p = load_config(
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "3",
        ]
    ).parallel
    assert (p.recompute_method, p.recompute_num_layers) == ("block", 3)
    p = load_config([]).parallel
    assert (p.recompute_granularity, p.recompute_method, p.recompute_num_layers) == (
        "none",
        None,
        None,
    )


@pytest.mark.parametrize(
    "granularity, plan",
    [("none", (None, None)), ("selective", (None, None)), ("full", ("uniform", 1))],
)
def test_a_config_written_before_recompute_keys_were_unset_still_loads(granularity, plan, tmp_path):
    # A run's config.toml (rerun with --config RUN/config.toml) held both old defaults whatever
    # the granularity; they never had an effect outside 'full', and still have none.
    path = tmp_path / "config.toml"
    path.write_text(
        f'[parallel]\nrecompute_granularity = "{granularity}"\nrecompute_method = "uniform"\n'
        "recompute_num_layers = 1\n"
    )
    p = load_config(["--config", str(path)]).parallel
    assert (p.recompute_granularity, p.recompute_method, p.recompute_num_layers) == (
        granularity,
        *plan,
    )
    # and what this run writes back reads the same
    again = tmp_path / "again.toml"
    again.write_text(cfg.dumps_toml(load_config(["--config", str(path)])))
    assert load_config(["--config", str(again)]).parallel == p


# A value of each removed option other than the default it had: it asked for the removed behaviour.
REMOVED_NOT_DEFAULT = {
    "parallel.tp_batch_split": True,
    "train.compile_overlap_scheduling": True,
    "train.matmul_sm_carveout": 16,
    "parallel.tp_reduce_impl": "symm_mem",
}


@pytest.mark.parametrize("key", sorted(REMOVED_KEYS))
def test_a_config_written_before_an_option_was_removed_still_loads(key, tmp_path, caplog):
    # A run's config.toml holds every key, the removed option's too, at its old default.
    section, _, name = key.partition(".")
    old_default = REMOVED_KEYS[key][0]
    table = cfg.to_dict(load_config([]))
    table[section][name] = old_default
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(table))
    with caplog.at_level("WARNING", logger="meshtrain.config"):
        assert load_config(["--config", str(path)]) == load_config([])
    assert f"{key}={old_default!r}: the option was removed" in caplog.text
    table[section][name] = REMOVED_NOT_DEFAULT[key]
    path.write_text(tomli_w.dumps(table))
    with pytest.raises(ConfigError, match=f"^{key}=.*: the option was removed"):
        load_config(["--config", str(path)])


def test_validation_messages_name_keys():
    with pytest.raises(ConfigError, match="num_attention_heads"):
        load_config(["--hidden-size", "100", "--num-attention-heads", "3"])
    with pytest.raises(ConfigError, match="global_batch_size"):
        load_config(["--micro-batch-size", "3", "--global-batch-size", "10"])
    with pytest.raises(ConfigError, match="num_query_groups"):
        load_config(["--num-attention-heads", "4", "--num-query-groups", "3"])


@pytest.mark.parametrize(
    "args, message",
    [
        # each was accepted and then misbehaved: 0 groups read as unset (MHA); a negative multiple
        # padded the vocabulary to fewer rows than it has, 0 divided by zero; a decay that the
        # warmup reaches kept lr at its peak for good, a negative warmup started inside the decay
        (["--num-query-groups", "0"], r"model\.num_query_groups must be positive"),
        (
            ["--make-vocab-size-divisible-by", "-128"],
            r"model\.make_vocab_size_divisible_by must be positive",
        ),
        (
            ["--make-vocab-size-divisible-by", "0"],
            r"model\.make_vocab_size_divisible_by must be positive",
        ),
        (["--ffn-hidden-size", "0"], r"model\.ffn_hidden_size must be positive, got 0$"),
        (
            ["--model.activation=swiglu", "--hidden-size", "16", "--num-attention-heads", "2"],
            r"ffn_hidden_size must be positive, got 0 \(8/3 of hidden_size=16",
        ),
        (
            ["--lr-warmup-iters", "100", "--lr-decay-iters", "50"],
            r"optim\.lr_decay_iters=50 must be greater",
        ),
        (["--lr-decay-iters", "0"], r"optim\.lr_decay_iters=0 must be greater"),
        (["--lr-warmup-iters", "-10"], r"optim\.lr_warmup_iters must be >= 0"),
        # each was accepted and then failed with a traceback once the data and model were built
        # (nn.Dropout, normal_, torch's AdamW), or trained on NaN or inf without a word
        (
            ["--hidden-dropout", "1.5"],
            r"model\.hidden_dropout is a probability: it must be in \[0, 1\], got 1\.5",
        ),
        (["--attention-dropout", "-0.1"], r"model\.attention_dropout is a probability"),
        (["--init-method-std", "-0.02"], r"model\.init_method_std must be >= 0"),
        (["--rotary-base", "0"], r"model\.rotary_base must be positive"),
        (["--model.norm_epsilon=-1e-5"], r"model\.norm_epsilon must be >= 0"),
        (["--adam-beta1", "1.5"], r"optim\.adam_beta1 must be in \[0, 1\), got 1\.5"),
        (["--adam-beta2", "1"], r"optim\.adam_beta2 must be in \[0, 1\)"),
        (["--adam-eps", "-1e-8"], r"optim\.adam_eps must be >= 0"),
        (["--weight-decay", "-0.1"], r"optim\.weight_decay must be >= 0"),
        (["--lr", "inf"], r"min_lr <= lr, got lr=inf"),
        (["--lr", "nan"], r"optim\.lr: got nan, expected a number"),
        (["--clip-grad", "nan"], r"optim\.clip_grad: got nan"),
    ],
)
def test_values_that_would_misbehave_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(args)


def test_a_message_that_names_its_section_is_not_prefixed_again():
    # was "optim.optim: need 0 <= min_lr <= lr ..." and "model.model: RoPE needs ..."
    with pytest.raises(
        ConfigError, match=r"^optim: need 0 <= min_lr <= lr, got lr=0\.0001 min_lr=0\.001$"
    ):
        load_config(["--lr", "1e-4", "--min-lr", "1e-3"])
    with pytest.raises(ConfigError, match=r"^model: RoPE needs an even head dim, got 15$"):
        load_config(
            [
                "--position-embedding-type",
                "rope",
                "--hidden-size",
                "120",
                "--num-attention-heads",
                "8",
            ]
        )


def test_replace_revalidates():
    job = load_config([])
    assert replace(job, model={"vocab_size": 500}).model.vocab_size == 500
    with pytest.raises(ConfigError):
        replace(job, model={"hidden_size": 7})


def test_every_field_is_documented():
    for key, _, _, doc in cfg.describe_keys(JobConfig):
        assert doc, f"{key} has no docstring"
    assert "--model.hidden_size" in config_help()


def test_the_flag_keys_are_the_documented_keys():
    """The keys a flag is checked against (read without parsing source) are the keys
    `--help-config` documents, optional sections included."""
    assert cfg.leaf_keys(JobConfig) == {key for key, *_ in cfg.describe_keys(JobConfig)}
    assert "model.num_layers" in cfg.leaf_keys(JobConfig)


def test_shipped_configs_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "deploy" / "configs"
    names = {p.name for p in root.glob("*.toml")}
    assert {"tiny.toml", "gpt2-125m.toml", "gpt2-350m.toml", "llama-1b.toml"} <= names
    assert {"vlm-tiny.toml", "llava-1.5-7b.toml"} <= names
    for path in root.glob("*.toml"):
        assert dataclasses.is_dataclass(load_config(["--config", str(path)]))
    # LLaVA-1.5's shapes: 576 features of CLIP ViT-L/14-336, the projector alone trained
    llava = load_config(["--config", str(root / "llava-1.5-7b.toml")])
    assert (llava.data.image_size, llava.data.tokens_per_image) == (336, 576)
    assert (llava.data.image_token_id, llava.data.image_normalization) == (32000, "clip")
    t = llava.train
    assert t.freeze_vision and t.freeze_language_model and not t.freeze_projector


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--tensor-model-parallel-size", "3"],
            r"parallel\.tp=3 must divide model\.num_attention_heads=4",
        ),
        (
            [
                "--tensor-model-parallel-size",
                "4",
                "--num-attention-heads",
                "8",
                "--num-query-groups",
                "2",
            ],
            r"parallel\.tp=4 must divide .* query groups \(2\)",
        ),
        (
            ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "301"],
            r"parallel\.tp=2 must divide the MLP width 301",
        ),
        (
            ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "255"],
            r"parallel\.tp=2 must divide model\.seq_length=255",
        ),
        (
            ["--tensor-model-parallel-size", "2", "--attention-dropout", "0.1"],
            r"model\.attention_dropout=0",
        ),
    ],
)
def test_tensor_parallel_misfits_are_refused_at_parse_time(args, message):
    # Megatron refuses these in its argument checks; they used to surface only in parallelize(),
    # after `train --nproc-per-node N` had started N ranks and each had built its data (exit 1).
    with pytest.raises(ConfigError, match=message):
        load_config(args)
    assert (
        load_config(["--tensor-model-parallel-size", "2", "--sequence-parallel"]).parallel.tp == 2
    )
