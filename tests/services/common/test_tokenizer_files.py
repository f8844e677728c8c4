"""The files behind each kind of tokenizer spec, and the spec pointed at copies of them."""

import pytest

from meshtrain.services.common.errors import DataError
from meshtrain.services.common.tokenizer_files import rebase_spec, spec_files


def _touch(path, text="x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "kind",
    [
        "hf",
        "hf-folder",
        "tiktoken",
        "tiktoken-prefix",
        "sentencepiece",
        "gpt2bpe",
        "megatron-tiktoken",
    ],
)
def test_each_spec_kind_lists_its_files_and_rebases_onto_copies(tmp_path, kind):
    src = tmp_path / "src"
    spec, names = {
        "hf": (str(_touch(src / "tok.json")), ["tok.json"]),
        "hf-folder": (str(_touch(src / "tokenizer.json").parent), ["tokenizer.json"]),
        "tiktoken": (str(_touch(src / "cl100k.tiktoken")), ["cl100k.tiktoken"]),
        "tiktoken-prefix": (f"tiktoken:{_touch(src / 'ranks.bpe')}", ["ranks.bpe"]),
        "sentencepiece": (f"sentencepiece:{_touch(src / 'sp.model')}", ["sp.model"]),
        "gpt2bpe": (
            f"gpt2bpe:{_touch(src / 'vocab.json')},{_touch(src / 'merges.txt')}",
            ["vocab.json", "merges.txt"],
        ),
        "megatron-tiktoken": (
            f"megatron-tiktoken:{_touch(src / 't.json')},pattern=v2,num_special_tokens=1000",
            ["t.json"],
        ),
    }[kind]
    files = spec_files(spec)
    assert list(files) == names and all(p.is_file() for p in files.values())
    moved = rebase_spec(spec, list(files), tmp_path / "copy")
    assert str(src) not in moved
    for name in names:
        assert str(tmp_path / "copy" / name) in moved
    if kind == "megatron-tiktoken":
        assert moved.endswith(",pattern=v2,num_special_tokens=1000")


@pytest.mark.parametrize("spec", ["byte", "null:32000"])
def test_specs_without_files_carry_nothing_and_stay_as_they_are(spec, tmp_path):
    assert spec_files(spec) == {}
    assert rebase_spec(spec, [], tmp_path) == spec


def test_a_missing_file_and_a_name_clash_are_named(tmp_path):
    with pytest.raises(DataError, match="names .*gone.json.*which is not a file"):
        spec_files(str(tmp_path / "gone.json"))
    a, b = _touch(tmp_path / "a" / "vocab.json"), _touch(tmp_path / "b" / "vocab.json")
    with pytest.raises(DataError, match="two files called 'vocab.json'"):
        spec_files(f"gpt2bpe:{a},{b}")
    with pytest.raises(DataError, match="names 2 files, but 1 were carried"):
        rebase_spec(f"gpt2bpe:{a},{b}", ["vocab.json"], tmp_path)


def test_spec_eod_id_is_the_dataloaders(tmp_path):
    """The EOD id an export reads from the files is the one the run's tokenizer ended documents
    with."""
    import base64

    from meshtrain.services.common.tokenizer_files import spec_eod_id
    from meshtrain.services.dataloader.tokenizers.base import build_tokenizer

    ranks = _touch(
        tmp_path / "enc.tiktoken",
        "\n".join(f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256)) + "\n",
    )
    for spec in ("null:100", f"tiktoken:{ranks}", str(ranks)):
        assert spec_eod_id(spec) == build_tokenizer(spec).eod_id
    with pytest.raises(DataError, match="missing"):
        spec_eod_id(f"tiktoken:{tmp_path / 'absent.tiktoken'}")
