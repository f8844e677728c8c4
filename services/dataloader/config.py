"""The dataloader's configs: its section of the trainer's job config (`[data]`), where training
tokens come from, and a DataService worker's settings (`ServeConfig`) with the flags that set them.

The trainer's job config embeds `DataConfig`. With `service_addresses` set the trainer streams the
same batches from DataService workers (`meshtrain data serve`) instead of reading the files itself.
`meshtrain data serve` (`cli.py`) and `python -m meshtrain.services.dataloader.rpc.server` both
parse `add_serve_arguments`' flags into a `ServeConfig` and hand it to `rpc/server.run`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

from meshtrain.services.common.cache import user_cache_dir
from meshtrain.services.common.errors import ConfigError, DataError


@dataclass
class DataConfig:
    """Where training tokens come from."""

    data_path: list[str] = field(default_factory=list)
    """Indexed dataset prefixes (PREFIX.bin/.idx), Megatron style: `[PREFIX, ...]` (equal
    weights) or `[W1, PREFIX1, W2, PREFIX2, ...]` to blend by weight; empty: the embedded
    default corpus."""
    tokenizer: str = "bpe"
    """'bpe' (trained on the default corpus), 'byte', or the path of the tokenizer the dataset was
    built with: a Hugging Face tokenizer.json, a *.tiktoken file or a SentencePiece *.model; or
    a spec such as gpt2bpe:VOCAB,MERGES or null:VOCAB_SIZE (set from `tokenizer_type`)."""
    tokenizer_type: str | None = None
    """Megatron's `--tokenizer-type`, the other way to name the tokenizer (not together with
    `tokenizer`, which it sets): GPT2BPETokenizer (`vocab_file` + `merge_file`),
    HuggingFaceTokenizer (`tokenizer_model`: a tokenizer.json or its folder),
    SentencePieceTokenizer, GPTSentencePieceTokenizer or Llama2Tokenizer (`tokenizer_model`: a
    *.model), TikTokenizer (`tokenizer_model`: a *.tiktoken file or megatron-core's JSON vocabulary;
    `vocab_size`, `tiktoken_pattern`, `tiktoken_num_special_tokens`), NullTokenizer
    (`vocab_size`: text is whitespace-separated ids below it, EOD is `vocab_size`)."""
    vocab_file: str | None = None
    """GPT2BPETokenizer's `vocab.json` (Megatron `--vocab-file`)."""
    merge_file: str | None = None
    """GPT2BPETokenizer's `merges.txt` (Megatron `--merge-file`)."""
    tokenizer_model: str | None = None
    """The tokenizer file (or folder) of HuggingFaceTokenizer, SentencePieceTokenizer and
    TikTokenizer (Megatron `--tokenizer-model`)."""
    vocab_size: int | None = None
    """NullTokenizer's ids (the vocabulary is one more, for EOD) or TikTokenizer's vocabulary,
    specials included (default: the file's, at most 2^17)."""
    tiktoken_pattern: str | None = None
    """TikTokenizer's split pattern, 'v1' or 'v2' (default 'v2'; Megatron `--tiktoken-pattern`)."""
    tiktoken_num_special_tokens: int | None = None
    """TikTokenizer's block of special ids before the merge ranks (default 1000; Megatron
    `--tiktoken-num-special-tokens`)."""
    default_vocab_size: int = 4096
    """Vocabulary of the BPE trained for the embedded default corpus."""
    default_corpus_bytes: int = 8_000_000
    """How much of the Python standard library's source the default corpus takes."""
    split: str = "969,30,1"
    """Train/valid/test weights over documents, Megatron style."""
    sample_order: str = "meshtrain"
    """How the document order, sample index and sample shuffle are built: 'meshtrain' (each
    epoch's documents shuffled on their own) or 'megatron' (megatron-core GPTDataset's indices
    bit for bit, for the same seed, seq_length, number of samples and split). Changing it
    changes which samples every step trains on, so keep it across a resume."""
    cache_dir: str = field(default_factory=user_cache_dir)
    """Where the default corpus, its tokenizer and its dataset are built and cached (default:
    `$MESHTRAIN_CACHE`, else `$XDG_CACHE_HOME/meshtrain`, else `~/.cache/meshtrain`)."""
    service_addresses: list[str] = field(default_factory=list)
    """Data service workers: `host:port`, `dns:///name:port` (every address the name resolves
    to), or `dir:PATH` (every worker announced in that shared folder by `meshtrain data serve
    --announce PATH`); empty: read in-process. Workers must see the dataset files at the same
    paths. Ranks spread over the live workers; tensor-parallel peers pull once per group."""
    prefetch: int = 8
    """Micro-batches the service client fetches ahead on its background thread."""
    service_stall_s: float = 30.0
    """Fail over from a worker whose stream sends nothing for this long while the trainer waits."""
    service_give_up_s: float = 120.0
    """Stop the run with an error once workers have failed for this long with no micro-batch
    in between, every worker having been tried since the first failure (time the trainer spends
    computing on prefetched batches, and opens that succeed, are not counted)."""
    service_open_timeout_s: float = 900.0
    """How long a worker may take to open the dataset (build its sample indices) before the
    next one is tried; an open that succeeds is not counted toward `service_give_up_s`."""
    service_rebalance_s: float = 10.0
    """How often (seconds) a rank resolves the addresses again and moves its stream to the
    worker its place now falls on (workers joined or left); 0: move only when a worker fails."""
    eod_mask_loss: bool = False
    """Zero the loss where the input token is end-of-document (Megatron `--eod-mask-loss`)."""
    reset_attention_mask: bool = False
    """Attention stays within each document of a packed sequence: a token attends only to the
    earlier tokens of its own document, the EOD that ends it included (Megatron
    `--reset-attention-mask`). Needs the tokenizer's end-of-document id."""
    reset_position_ids: bool = False
    """Positions (RoPE, learned position embeddings) restart at 0 on the token after each EOD
    (Megatron `--reset-position-ids`). Needs the tokenizer's end-of-document id."""
    format: str = "gpt"
    """'gpt': pretraining samples that run across documents; 'sft': supervised fine-tuning on
    chat datasets made by `meshtrain data preprocess --chat` (Megatron `--sft`): whole
    conversations packed into each sequence, the loss only on assistant tokens, and
    attention masked by conversation (it sets `reset_attention_mask`; every `data_path` prefix
    must then be an SFT dataset made with `tokenizer`); 'multimodal': `data_path` lists
    image-text sources (Energon dataset folders, folders of WebDataset .tar shards, .tar files,
    .jsonl files with images beside them; docs/multimodal.md), read end to end, and batches
    carry images."""
    image_size: int | None = None
    """Multimodal: the side of the square images the worker makes (pixels). Unset: the
    model's, model.vision.image_size; set, it must equal it."""
    tokens_per_image: int | None = None
    """Multimodal: placeholder tokens standing for one image (the vision encoder's output
    length after the projector; 576 for CLIP ViT-L/14 at 336). Unset: the encoder's
    ((image_size / patch_size)^2, plus 1 with select_feature 'cls_patch'); set, it must equal
    it."""
    image_token_id: int | None = None
    """Multimodal: the placeholder id. Unset: model.vision.image_token_id; set, it must equal
    it."""
    image_resize: str = "crop"
    """Multimodal: 'crop' (shortest side to image_size, centre crop) or 'pad' (pad to a square
    with the mean colour, then resize: LLaVA-1.5)."""
    image_normalization: str | None = None
    """Multimodal: 'clip' (OpenAI CLIP's mean and std) or 'siglip' (0.5, 0.5). Unset: the one
    of model.vision.variant; set, it is used as given (an encoder trained on other statistics)."""
    image_wire_dtype: str = "uint8"
    """Multimodal, data service: pixels travel as 'uint8' (normalized by the trainer's client)
    or 'bfloat16' (normalized by the worker, twice the bytes)."""
    bad_image_policy: str = "stop"
    """Multimodal: a record whose image does not decode (or whose text is malformed) 'stop's
    the run, naming it, or is 'skip'ped: logged by name, counted, and replaced by the next good
    record of the epoch's order (deterministically, so resume stays exact)."""

    def __post_init__(self) -> None:
        if self.data_path:
            from meshtrain.services.dataloader.spec import parse_data_path

            try:
                parse_data_path(self.data_path)
            except DataError as e:
                raise ConfigError(f"data.data_path: {e}") from None
        from meshtrain.services.dataloader.samples import check_sample_order

        try:
            check_sample_order(self.sample_order, "data.sample_order")
        except DataError as e:
            raise ConfigError(str(e)) from None
        from meshtrain.services.dataloader.spec import FORMATS

        if self.format not in (*FORMATS, "multimodal"):
            raise ConfigError(
                f"data.format={self.format!r} is not one of {(*FORMATS, 'multimodal')}"
            )
        if self.format == "sft" and not self.data_path:
            raise ConfigError(
                "data.format='sft' trains on chat datasets: set data.data_path to the prefixes "
                "`meshtrain data preprocess --chat` wrote"
            )
        if self.format == "sft":
            # packed conversations never attend into each other (Megatron's SFT packs the same)
            self.reset_attention_mask = True
        if self.format == "sft" and self.sample_order != "meshtrain":
            raise ConfigError(
                f"data.sample_order={self.sample_order!r} orders pretraining samples; SFT packing "
                "has its own order (leave data.sample_order at 'meshtrain')"
            )
        if self.prefetch < 1:
            raise ConfigError(f"data.prefetch={self.prefetch} must be >= 1")
        for name in ("service_stall_s", "service_give_up_s", "service_open_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"data.{name}={getattr(self, name)} must be > 0")
        if not 0 <= self.service_rebalance_s < float("inf"):
            raise ConfigError(
                f"data.service_rebalance_s={self.service_rebalance_s} must be >= 0 (0: never)"
            )
        if self.service_addresses:
            from meshtrain.services.dataloader.rpc.discovery import check_address

            for address in self.service_addresses:
                try:
                    check_address(address)
                except DataError as e:
                    raise ConfigError(f"data.service_addresses: {e}") from None
        self._check_multimodal()
        self._resolve_tokenizer_type()
        if self.data_path and self.tokenizer == "bpe":
            raise ConfigError(
                "data.tokenizer='bpe' means the BPE trained for the embedded corpus; with "
                "data.data_path give 'byte' or the tokenizer the dataset was built with "
                "(tokenizer.json, *.tiktoken, *.model)"
            )

    def _check_multimodal(self) -> None:
        from meshtrain.services.dataloader.vision.dataset import BAD_IMAGE_POLICIES
        from meshtrain.services.dataloader.vision.images import (
            NORMALIZATIONS,
            RESIZE_MODES,
            WIRE_DTYPES,
        )

        for key, allowed in (
            ("image_resize", RESIZE_MODES),
            ("image_normalization", tuple(NORMALIZATIONS)),
            ("image_wire_dtype", WIRE_DTYPES),
            ("bad_image_policy", BAD_IMAGE_POLICIES),
        ):
            value = getattr(self, key)
            if value not in allowed and not (key == "image_normalization" and value is None):
                raise ConfigError(f"data.{key}={value!r} is not one of {allowed}")
        if self.image_size is not None and not 1 <= self.image_size <= 4096:
            raise ConfigError(f"data.image_size={self.image_size} must be in [1, 4096]")
        if self.tokens_per_image is not None and self.tokens_per_image < 1:
            raise ConfigError(f"data.tokens_per_image={self.tokens_per_image} must be >= 1")
        if self.image_token_id is not None and not 0 <= self.image_token_id < 2**31:
            raise ConfigError(f"data.image_token_id={self.image_token_id} must be in [0, 2^31)")
        if self.format != "multimodal":
            return
        if not self.data_path:
            raise ConfigError(
                "data.format='multimodal' needs data.data_path: the image-text sources to read"
            )
        if self.data_path and self.data_path[0].replace(".", "", 1).isdigit():
            raise ConfigError(
                "data.format='multimodal' reads its data_path sources end to end; weights "
                "(WEIGHT PATH pairs) are not supported: list the sources"
            )
        on = [k for k in ("eod_mask_loss", "reset_attention_mask", "reset_position_ids")]
        on = [k for k in on if getattr(self, k)]
        if on:
            raise ConfigError(
                f"data.{', data.'.join(on)}: not with data.format='multimodal' (its samples are "
                "one record each, padded; the loss mask is the record's)"
            )

    def _resolve_tokenizer_type(self) -> None:
        """With `tokenizer_type` set, put the spec its keys name into `tokenizer`."""
        from meshtrain.services.dataloader.tokenizers.megatron import FLAG_OF, megatron_spec

        if self.tokenizer_type is None:
            for key in FLAG_OF:
                if getattr(self, key) is not None:
                    raise ConfigError(
                        f"data.{key} is given without data.tokenizer_type, which reads it"
                    )
            return
        try:
            spec = megatron_spec(
                self.tokenizer_type, **{k: getattr(self, k) for k in FLAG_OF}, prefix="data."
            )
        except DataError as e:
            raise ConfigError(str(e)) from None
        # a resolved config (config.toml of a run) holds both, naming the same tokenizer
        if self.tokenizer not in ("bpe", spec):
            raise ConfigError(
                f"data.tokenizer={self.tokenizer!r} and "
                f"data.tokenizer_type={self.tokenizer_type!r} both name the tokenizer; give one of "
                "them"
            )
        self.tokenizer = spec
        # absolute, so a run's config.toml read from another folder names the same files
        for key in ("vocab_file", "merge_file", "tokenizer_model"):
            if getattr(self, key):
                setattr(self, key, os.path.abspath(getattr(self, key)))


@dataclass
class ServeConfig:
    """A DataService worker's settings, one per `meshtrain data serve` flag (`add_serve_arguments`
    says what each means)."""

    port: int = 0
    """`--port`: TCP port (0: pick a free one and print it)."""
    host: str = "127.0.0.1"
    """`--host`: interface to bind."""
    max_streams: int = 32
    """`--max-streams`: concurrent streams served."""
    grace: float = 5.0
    """`--grace`: seconds streams get on SIGTERM."""
    max_index_gib: float | None = None
    """`--max-index-gib`: memory sample-index builds may take (None: half the RAM)."""
    max_samples: int = 2**32
    """`--max-samples`: largest num_samples a request may name."""
    index_cache_dir: str | None = None
    """`--index-cache-dir`: where sample indices are cached (None: index/ in the user's cache)."""
    index_cache_gib: float = 32.0
    """`--index-cache-gib`: disk the cached indices may take."""
    stream_idle_timeout: float = 300.0
    """`--stream-idle-timeout`: seconds a client may read nothing before its stream is cancelled."""
    max_streams_per_client: int = 16
    """`--max-streams-per-client`: streams one client host may hold at once (0: no limit)."""
    allow_root: list[str] | None = None
    """`--allow-root`: folders and URL prefixes whose datasets clients may name (None: the current
    directory and the user's meshtrain cache; see `served_roots`)."""
    metrics_port: int | None = None
    """`--metrics-port`: serve Prometheus metrics on this port (None: off)."""
    announce: str | None = None
    """`--announce`: the shared folder to announce this worker in (None: not announced)."""
    advertise: str | None = None
    """`--advertise`: the host trainers reach this worker by, for `announce`."""
    token_file: str | None = None
    """`--token-file`: the bearer tokens callers must send (`common/security.py`)."""
    tls_cert: str | None = None
    """`--tls-cert`: PEM certificate the server presents (turns TLS on)."""
    tls_key: str | None = None
    """`--tls-key`: PEM private key of `tls_cert`."""
    tls_client_ca: str | None = None
    """`--tls-client-ca`: PEM CA that must have signed the clients' certificates."""
    insecure: bool = False
    """`--insecure`: serve beyond loopback without authentication."""

    def __post_init__(self) -> None:
        if self.allow_root is not None:
            from meshtrain.services.dataloader.served_roots import ServedRoots

            ServedRoots(self.allow_root)  # a malformed root fails here, before the server starts
        if self.max_index_gib is not None and not 0 < self.max_index_gib < float("inf"):
            raise ConfigError(
                f"--max-index-gib {self.max_index_gib} must be a positive number of GiB"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        """From the flags `add_serve_arguments` defines (absent ones: the defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The `serve` flags, whose values `ServeConfig.from_args` reads."""
    # Imported here, so that a module reading DataConfig never loads the security module (and
    # grpc with it) for flags only a worker has.
    from meshtrain.services.common.security import add_server_arguments

    p.add_argument("--port", type=int, default=0, help="TCP port (0: pick a free one and print it)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for all)")
    p.add_argument("--max-streams", type=int, default=32, help="concurrent streams served")
    p.add_argument("--grace", type=float, default=5.0, help="seconds streams get on SIGTERM")
    p.add_argument(
        "--max-index-gib",
        type=float,
        default=None,
        help="memory (GiB) building one request's sample index may take, and all builds "
        "at once; a request needing more is refused (default: half the RAM; indices already cached "
        "count for nothing)",
    )
    p.add_argument(
        "--max-samples",
        type=int,
        default=2**32,
        help="largest num_samples a request may name (default 2^32)",
    )
    p.add_argument(
        "--index-cache-dir",
        default=None,
        help="the one folder where sample indices are cached, never beside the datasets "
        "(default: index/ in $MESHTRAIN_CACHE, else ~/.cache/meshtrain)",
    )
    p.add_argument(
        "--index-cache-gib",
        type=float,
        default=32.0,
        help="disk the cached indices may take; the least recently used ones no stream reads "
        "are evicted (default 32)",
    )
    p.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=300.0,
        help="seconds a stream's client may take no message before the stream is cancelled "
        "(it reconnects where it left off when it reads again; 0: never; default 300)",
    )
    p.add_argument(
        "--max-streams-per-client",
        type=int,
        default=16,
        help="streams one client host may hold at once (0: no limit; default 16)",
    )
    p.add_argument(
        "--allow-root",
        action="append",
        default=None,
        metavar="PATH_OR_URL",
        help="a folder (or dataset prefix) or URL prefix (s3://bucket/prefix) whose datasets "
        "clients may name; repeatable; any other prefix is refused with PERMISSION_DENIED "
        "(default: the current directory and the user's meshtrain cache, no object storage)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics (requests, bytes, latency, queue depth) on this "
        "port at /metrics (0: any free port, printed); off unless given",
    )
    p.add_argument(
        "--announce",
        default=None,
        metavar="DIR",
        help="once serving, announce this worker in the folder DIR (on a shared file system); "
        "trainers given dir:DIR find every worker announced there, joined later ones too",
    )
    p.add_argument(
        "--advertise",
        default=None,
        metavar="HOST",
        help="the host name or address trainers reach this worker by, for --announce "
        "(default: --host, or this machine's name when bound to all interfaces)",
    )
    add_server_arguments(p)  # --token-file, --tls-cert, --tls-key, --tls-client-ca, --insecure
