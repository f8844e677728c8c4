"""A mistake on the command line is answered before torch's heavy modules load.

Each case runs the `meshtrain` entry point in a fresh interpreter (sys.modules starts empty
there), lets it report the mistake, then lists which heavy modules it imported. Loading torch
and its compiler stack takes tens of seconds on a busy machine, and a typo must not cost that.
The message is checked word for word: answering early must not change what is said. No timing
is asserted (the machine's load decides it): benchmarks/cli_latency.py measures that.
"""

import json
import subprocess
import sys

import pytest

# torch itself, its compiler stack, Triton, zarr: what made a bad flag cost a full trainer import.
# grpc is the services' transport; a command line that only parses and validates needs none.
HEAVY = ("torch", "torch._dynamo", "triton", "zarr", "grpc")

_PROBE = """
import contextlib, io, json, sys
from meshtrain.services.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        rc = main(sys.argv[1:])
    except SystemExit as e:
        rc = e.code
heavy = [m for m in json.loads(%r) if m in sys.modules]
print(json.dumps({"rc": rc, "stderr": err.getvalue(), "heavy": heavy}))
"""


def _run(argv: list[str], cwd) -> dict:
    code = _PROBE % json.dumps(HEAVY)
    out = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


FLAG_HINT = "use --section.key=value (see --help-config for the keys and aliases)"

CASES = [
    (["train", "--bogus-flag"], f"unknown flag --bogus-flag; {FLAG_HINT}"),
    (["train", "--config", "missing.toml"], "config file not found: missing.toml"),
    (["train", "--model.bogus=1"], "unknown flag --model.bogus; did you mean --model.qkv_bias?"),
    (
        ["train", "--train-iters", "abc"],
        "train.train_iters: got 'abc' (str), expected an integer",
    ),
    (["train", "--nproc-per-node", "2", "--bogus-flag"], f"unknown flag --bogus-flag; {FLAG_HINT}"),
    (["up", "--config", "missing.toml"], "config file not found: missing.toml"),
    (["up", "--bogus-flag"], f"unknown flag --bogus-flag; {FLAG_HINT}"),
    (
        ["generate", "--load", "missing", "--prompt", "hi", "--top-p", "2"],
        "top_p must be in (0, 1], got 2.0",
    ),
    (["generate", "--load", "missing", "--prompt", "hi"], "no committed checkpoint under missing"),
    (["dpo", "reference", "--bogus-flag"], f"unknown flag --bogus-flag; {FLAG_HINT}"),
    (
        ["dpo", "reference", "--train.objective=dpo", "--dpo.data_path=x"],
        "the reference pass needs the model the run starts from: set checkpoint.load (--load) "
        "or dpo.reference_load",
    ),
    (["ckpt", "list", "missing"], "missing: no such path; check the checkpoint root"),
    (["ckpt", "inspect", "missing"], "missing: no such path; check the checkpoint root"),
    (["ckpt", "verify", "missing"], "missing: no such path; check the checkpoint root"),
    (
        ["data", "preprocess", "--input", "missing.jsonl", "--output-prefix", "out"],
        "name the tokenizer: --tokenizer SPEC, or Megatron's --tokenizer-type with its "
        "--vocab-file/--merge-file/--tokenizer-model/--vocab-size",
    ),
    (
        ["data", "preprocess", "--input", "missing.jsonl", "--output-prefix", "out"]
        + ["--tokenizer", "byte"],
        "--input 'missing.jsonl' matches no file",
    ),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a) for a, _ in CASES])
@pytest.mark.e2e
def test_a_mistake_is_reported_before_the_heavy_imports(argv, message, tmp_path):
    result = _run(argv, tmp_path)
    assert result["stderr"] == f"meshtrain: error: {message}\n"
    assert result["rc"] == 2
    assert result["heavy"] == [], f"imported before the error: {result['heavy']}"


def test_ckpt_list_allow_empty_of_a_missing_root_lists_nothing_without_torch(tmp_path):
    result = _run(["ckpt", "list", "missing", "--allow-empty"], tmp_path)
    assert (result["rc"], result["stderr"], result["heavy"]) == (0, "", [])


def test_config_package_imports_without_the_heavy_modules():
    code = (
        "import json, sys, meshtrain.services.trainer.config.load, meshtrain.services.cli; "
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
