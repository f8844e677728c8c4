"""DataService servicer: converts messages, asks the core for micro-batches, converts back.

A worker keeps no per-client state: each stream request carries the dataset spec, the rank
and batch sizes and the first (step, micro-batch) wanted, and the worker computes those
micro-batches with `LocalBatchSource`, exactly as the in-process path does. Under context
parallelism (`cp_size` > 1) it sends each sample's two chunks the cp rank holds, not the whole
sample. A vision-language request (`multimodal` instead of `spec`) is served the same way by
`MultimodalBatchSource`: the worker decodes and resizes the images and tokenizes the text, and
sends tokens, loss mask and pixels in one message (`rpc/multimodal.py`). Opened datasets
(and their sample indices) are kept in a small LRU, so many streams over the same spec share
one build: while a spec is being built, other requests for it wait for that build instead of
starting their own (all ranks connect at job start; N builds would cost N times the memory
and CPU), and a build that fails is not kept, so each waiter gets its error and the next
request tries again. Requests are validated before any file is touched; a bad one gets
INVALID_ARGUMENT through the `ErrorInterceptor`, and the worker keeps serving the others. A
prefix outside the worker's `--allow-root`s (`served_roots`) is PERMISSION_DENIED, and a
dataset that does not exist NOT_FOUND. A
request whose sample index would take more than `max_index_bytes` to build is refused once the
datasets' headers are read, before anything is allocated, and builds in progress together stay
within the same bound (a build that does not fit waits), so no request can take the worker's
memory.

Everything else a client chooses is bounded too (`DataLimits`): strings are checked before they
are used (length, no NUL or control character), `num_samples` is capped, indices go to one cache
folder of the worker's with a size quota (never beside the datasets, where each new seed left
one more entry), a client's concurrent streams are capped by its host, and a stream whose
client takes no message for `stream_idle_timeout` seconds is cancelled, so clients that connect
and never read cannot hold the stream slots.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtrain.protos.dataloader.v1 import dataloader_pb2 as pb
from meshtrain.protos.dataloader.v1 import dataloader_pb2_grpc as pb_grpc
from meshtrain.services.common.cache import user_cache_dir
from meshtrain.services.common.errors import ConfigError, DataError, DataUnavailableError
from meshtrain.services.common.sanitize import check_text, loggable, quiet_undecodable_requests
from meshtrain.services.common.stream_guards import IdleReaper, PeerLimit
from meshtrain.services.dataloader.blend import MAX_DATASETS
from meshtrain.services.dataloader.index_cache import IndexCache
from meshtrain.services.dataloader.loader import LocalBatchSource
from meshtrain.services.dataloader.rpc.multimodal import (
    check_batch_bytes,
    mm_spec_from_proto,
    payload_message,
)
from meshtrain.services.dataloader.served_roots import ServedRoots, default_roots
from meshtrain.services.dataloader.spec import (
    MAX_SAMPLES,
    SPLITS,
    DatasetSpec,
    MemoryBudget,
    open_dataset,
)
from meshtrain.services.dataloader.vision.dataset import (
    MultimodalBatchSource,
    MultimodalSpec,
    open_multimodal,
)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DataService"].full_name
# A micro-batch message stays far below the gRPC message limit; bigger requests are refused.
MAX_BATCH_BYTES = 16 << 20
MAX_DATASETS_CACHED = 8
# URL schemes a worker opens for a request, besides plain local paths. Any client can name any
# URL, so a worker serves only storage it reads by byte range from where its operator pointed
# it: object stores (endpoint and credentials come from the worker's environment, the request
# only names bucket and key) and its own disk or memory. Every other fsspec protocol is refused
# before anything is opened: http(s)/ftp/sftp/ssh/webhdfs/github connect to hosts the client
# chooses (from inside the cluster), some of them in their constructor with no deadline this
# worker sets; zip/tar and `a::b` chains open whole archives or caches; and their failures
# escaped as UNKNOWN, which clients retried as if the worker were down.
SERVED_SCHEMES = ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory")
MAX_PREFIX_CHARS = 4096  # PATH_MAX
MAX_SPLIT_CHARS = 256  # "969,30,1"-style weights


def default_index_cache_dir() -> str:
    """Where a data worker caches sample indices unless told (`data serve --index-cache-dir`):
    `index` in the user's meshtrain cache folder (`$MESHTRAIN_CACHE`, ...; see `user_cache_dir`)."""
    return os.path.join(user_cache_dir(), "index")


@dataclass(frozen=True)
class DataLimits:
    """What a data worker allows its clients (each a `data serve` flag).

    Attributes:
        max_samples: the largest `num_samples` a request may name (`--max-samples`).
        index_cache_dir: the one folder where sample indices are cached (`--index-cache-dir`;
            None: `default_index_cache_dir()`); never beside the datasets.
        index_cache_bytes: the most bytes the cached indices may take; the least recently used
            ones not read by a live stream are evicted to make room (`--index-cache-gib`).
        stream_idle_timeout: seconds a stream's client may take no message before the stream is
            cancelled (`--stream-idle-timeout`; 0: never). A trainer pausing (a checkpoint, an
            evaluation) longer than this reconnects when it reads again, where it left off.
        max_streams_per_client: streams one client host may hold at once
            (`--max-streams-per-client`; 0: no limit).
        allow_roots: the folders and URL prefixes whose datasets clients may name
            (`--allow-root`; None: `served_roots.default_roots()`, the worker's current
            directory and the user's meshtrain cache); any other prefix is PERMISSION_DENIED.
    """

    max_samples: int = 2**32
    index_cache_dir: str | None = None
    index_cache_bytes: int = 32 << 30
    stream_idle_timeout: float = 300.0
    max_streams_per_client: int = 16
    allow_roots: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_samples <= MAX_SAMPLES:
            raise ConfigError(f"--max-samples {self.max_samples} must be in [1, 2^36]")
        if not self.index_cache_bytes > 0:
            raise ConfigError(f"--index-cache-gib must be > 0, got {self.index_cache_bytes} bytes")
        if not 0 <= self.stream_idle_timeout < float("inf"):
            raise ConfigError(
                f"--stream-idle-timeout {self.stream_idle_timeout} must be a number of seconds >= 0"
            )
        if self.max_streams_per_client < 0:
            raise ConfigError(
                f"--max-streams-per-client {self.max_streams_per_client} must be >= 0"
            )


def check_served(prefix: str) -> None:
    """Raise DataError unless `prefix` is a local path or a URL of a `SERVED_SCHEMES` store."""
    served = "a local path or a " + ", ".join(f"{s}://" for s in SERVED_SCHEMES) + " URL"
    shown = loggable(prefix)
    if not prefix.strip():
        raise DataError(f"dataset prefix {shown} is empty; give {served}")
    if "::" in prefix:
        raise DataError(
            f"dataset prefix {shown} chains fsspec protocols ('::'); this worker serves {served}"
        )
    scheme, sep, rest = prefix.partition("://")
    if not sep:
        return
    if scheme.lower() not in SERVED_SCHEMES:
        raise DataError(f"dataset prefix {shown}: scheme {scheme}:// is not served; give {served}")
    if scheme.lower() != "file" and not rest.strip("/"):
        raise DataError(f"dataset prefix {shown} names no bucket or path after {scheme}://")


def default_max_index_bytes() -> int:
    """Half this machine's memory (or of the container's limit, if lower): what index builds may
    take when the worker is not told (`data serve --max-index-gib`). A worker's other memory is
    small (datasets are memory-mapped, cached indices too), and a real run's index is large: a
    Llama-scale 2T tokens at seq 4096 is 488M samples, a build of about 24 GB."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total // 2


def resident_index_bytes(ds) -> int:
    """Bytes of a dataset's sample indices held in memory (memory-mapped cached ones: none)."""
    arrays = [
        getattr(ds, n, None)
        for n in ("doc_idx", "sample_idx", "shuffle_idx", "dataset_index", "dataset_sample_index")
    ]
    own = sum(
        a.nbytes for a in arrays if isinstance(a, np.ndarray) and not isinstance(a, np.memmap)
    )
    return own + sum(resident_index_bytes(d) for d in getattr(ds, "datasets", ()) if d is not None)


def spec_from_proto(
    m: pb.DatasetSpec, max_samples: int = MAX_SAMPLES, roots: ServedRoots | None = None
) -> DatasetSpec:
    """A DatasetSpec from its message, validated: every field within its bounds (strings of
    bounded length without control characters, at most `max_samples` samples), its prefixes
    ones a worker serves (a served scheme and, with `roots`, under one of them). Raises
    DataError naming the field (DataAccessDeniedError for a prefix outside `roots`)."""
    if not 1 <= len(m.prefixes) <= MAX_DATASETS:
        raise DataError(f"spec.prefixes has {len(m.prefixes)} entries; give 1 to {MAX_DATASETS}")
    if len(m.weights) != len(m.prefixes):
        raise DataError(f"spec.weights has {len(m.weights)} entries for {len(m.prefixes)} prefixes")
    for i, prefix in enumerate(m.prefixes):
        check_text(prefix, f"spec.prefixes[{i}]", MAX_PREFIX_CHARS, DataError, allow_empty=True)
        check_served(prefix)
        if roots is not None:
            roots.check(prefix)
    check_text(m.split, "spec.split", MAX_SPLIT_CHARS, DataError, allow_empty=True)
    if m.split_name and m.split_name not in SPLITS:
        raise DataError(f"spec.split_name {loggable(m.split_name, 20)} is not one of {SPLITS}")
    if m.num_samples > max_samples:
        raise DataError(
            f"spec.num_samples={m.num_samples} is over this data worker's limit of {max_samples} "
            f"(`data serve --max-samples`)"
        )
    spec = DatasetSpec(
        prefixes=tuple(m.prefixes),
        weights=tuple(m.weights),
        seq_length=int(m.seq_length),
        num_samples=int(m.num_samples),
        seed=int(m.seed),
        split=m.split or "969,30,1",
        split_name=m.split_name or "train",
        sample_order=m.sample_order or "meshtrain",
        format=m.format or "gpt",
    )
    spec.validate()
    return spec


def _sources(spec: DatasetSpec | MultimodalSpec) -> list[str]:
    return list(spec.paths if isinstance(spec, MultimodalSpec) else spec.prefixes)


def index_keys(ds) -> list[str]:
    """The index-cache entries a dataset reads (a blend's and its parts')."""
    keys = [ds.index_key] if getattr(ds, "index_key", None) else []
    return keys + [k for d in getattr(ds, "datasets", ()) if d is not None for k in index_keys(d)]


def spec_to_proto(spec: DatasetSpec) -> pb.DatasetSpec:
    """The message form of a DatasetSpec."""
    return pb.DatasetSpec(
        prefixes=list(spec.prefixes),
        weights=list(spec.weights),
        seq_length=spec.seq_length,
        num_samples=spec.num_samples,
        seed=spec.seed,
        split=spec.split,
        split_name=spec.split_name,
        sample_order=spec.sample_order,
        format=spec.format,
    )


def array_to_proto(a: np.ndarray) -> pb.Array:
    """An array's message: little-endian bytes, dtype name and shape."""
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return pb.Array(dtype=a.dtype.name, shape=list(a.shape), data=a.tobytes())


class DataServicer(pb_grpc.DataServiceServicer):
    """Serves any rank's micro-batches from any step; stateless apart from a dataset cache."""

    def __init__(
        self,
        cache_indices: bool = True,
        max_index_bytes: int | None = None,
        limits: DataLimits | None = None,
    ):
        """Args:
        cache_indices: cache sample indices in `limits.index_cache_dir` (see `index_cache`).
        max_index_bytes: the most memory one request's sample index may take to build, and
            all builds in progress together (None: `default_max_index_bytes()`); a request
            over it is refused, a build that does not fit beside the others waits for them.
        limits: what clients are allowed (None: `DataLimits()`'s defaults).
        """
        quiet_undecodable_requests()
        self.limits = limits = DataLimits() if limits is None else limits
        self.index_cache = IndexCache(
            limits.index_cache_dir or default_index_cache_dir(), limits.index_cache_bytes
        )
        self.roots = ServedRoots(
            default_roots() if limits.allow_roots is None else limits.allow_roots
        )
        self._peer_streams = PeerLimit(limits.max_streams_per_client, "--max-streams-per-client")
        self._reaper = IdleReaper(limits.stream_idle_timeout, "--stream-idle-timeout")
        self.cache_indices = cache_indices
        self.max_index_bytes = (
            default_max_index_bytes() if max_index_bytes is None else int(max_index_bytes)
        )
        self._budget = MemoryBudget(self.max_index_bytes)
        self._datasets: OrderedDict[DatasetSpec | MultimodalSpec, object] = OrderedDict()
        self._building: dict[
            DatasetSpec | MultimodalSpec, Future
        ] = {}  # builds in progress, by spec
        self._lock = threading.Lock()
        self.builds = 0  # datasets opened (for tests and logs)

    def _open(self, spec: DatasetSpec | MultimodalSpec):
        if isinstance(spec, MultimodalSpec):
            return open_multimodal(spec, cache=self.index_cache if self.cache_indices else False)
        return open_dataset(
            spec,
            cache=self.cache_indices,
            max_index_bytes=self.max_index_bytes,
            budget=self._budget,
            index_cache=self.index_cache,
        )

    def _dataset(self, spec: DatasetSpec | MultimodalSpec):
        with self._lock:
            if spec in self._datasets:
                self._datasets.move_to_end(spec)
                return self._datasets[spec]
            building = self._building.get(spec)
            if building is None:
                building = self._building[spec] = Future()
                self.builds += 1
                owner = True
            else:
                owner = False
        if not owner:
            return building.result()  # waits outside the lock; raises the build's error
        # built outside the lock: a slow build must not stall streams over other specs
        try:
            try:
                ds = self._open(spec)
            except MemoryError as e:  # this worker's memory, not the request: another may have it
                raise DataUnavailableError(
                    f"building the sample index of {_sources(spec)} "
                    f"(num_samples={spec.num_samples}) ran out of memory on this worker: {e}"
                ) from e
        except BaseException as e:
            with self._lock:  # not cached: the next request for this spec builds again
                del self._building[spec]
            building.set_exception(e)
            raise
        with self._lock:
            self._datasets[spec] = ds
            # by count, and by the index memory they hold (indices not cached on disk stay in
            # the heap: 8 datasets of max_index_bytes each held 8 times the bound)
            while len(self._datasets) > MAX_DATASETS_CACHED or (
                len(self._datasets) > 1
                and sum(map(resident_index_bytes, self._datasets.values())) > self.max_index_bytes
            ):
                self._datasets.popitem(last=False)
            del self._building[spec]
        building.set_result(ds)
        return ds

    def _multimodal_source(self, req: pb.StreamRequest) -> MultimodalBatchSource:
        """A vision-language stream's source; sizes checked before any file is opened."""
        spec = mm_spec_from_proto(req.multimodal, self.limits.max_samples, self.roots)
        if int(req.cp_size) > 1:
            raise DataError(f"cp_size={req.cp_size}: multimodal streams are not cut for cp")
        check_batch_bytes(spec, int(req.micro_batch_size))
        self._check_batching(req)
        return MultimodalBatchSource(
            self._dataset(spec),
            int(req.micro_batch_size),
            int(req.global_batch_size),
            int(req.dp_rank),
            int(req.dp_size),
        )

    @staticmethod
    def _check_batching(req: pb.StreamRequest) -> None:
        if req.dp_size < 1 or req.dp_rank >= req.dp_size:
            raise DataError(f"dp_rank={req.dp_rank} is outside [0, dp_size={req.dp_size})")
        # checked before opening files, so a malformed request costs nothing
        if req.micro_batch_size < 1 or req.global_batch_size < 1:
            raise DataError(
                f"micro_batch_size={req.micro_batch_size} and "
                f"global_batch_size={req.global_batch_size} must be >= 1"
            )
        if req.global_batch_size % (req.micro_batch_size * req.dp_size):
            raise DataError(
                f"global_batch_size={req.global_batch_size} is not divisible by "
                f"micro_batch_size={req.micro_batch_size} x dp_size={req.dp_size}"
            )

    def _source(self, req: pb.StreamRequest) -> LocalBatchSource:
        if req.HasField("multimodal"):
            if req.HasField("spec"):
                raise DataError("StreamRequest has both a dataset spec and a multimodal spec")
            return self._multimodal_source(req)
        if not req.HasField("spec"):
            raise DataError("StreamRequest has no dataset spec")
        spec = spec_from_proto(req.spec, self.limits.max_samples, self.roots)
        cp_rank, cp_size = int(req.cp_rank), int(req.cp_size) or 1  # 0: a client that predates cp
        if cp_rank >= cp_size:
            raise DataError(f"cp_rank={cp_rank} is outside [0, cp_size={cp_size})")
        if cp_size > 1 and spec.seq_length % (2 * cp_size):
            raise DataError(
                f"seq_length={spec.seq_length} is not divisible by 2 x cp_size={cp_size} "
                f"(context parallelism cuts each sequence into 2 x cp_size equal chunks)"
            )
        # a message's tokens: the whole sample, or two chunks of seq/(2 cp) each with its next token
        row = spec.seq_length + 1 if cp_size == 1 else spec.seq_length // cp_size + 2
        # int32 tokens at worst, and for SFT a uint8 mask and int32 document ids beside them
        mbs_bytes = req.micro_batch_size * row * (9 if spec.format == "sft" else 4)
        if mbs_bytes > MAX_BATCH_BYTES:
            raise DataError(
                f"micro_batch_size={req.micro_batch_size} x {row} tokens (seq_length "
                f"{spec.seq_length}, cp_size {cp_size}) makes {mbs_bytes} byte messages, over the "
                f"{MAX_BATCH_BYTES} limit"
            )
        self._check_batching(req)
        return LocalBatchSource(
            self._dataset(spec),
            int(req.micro_batch_size),
            int(req.global_batch_size),
            int(req.dp_rank),
            int(req.dp_size),
            cp_rank=cp_rank,
            cp_size=cp_size,
        )

    def Describe(self, request: pb.StreamRequest, context) -> pb.DescribeResponse:
        src = self._source(request)
        return pb.DescribeResponse(
            num_samples=len(src.dataset),
            num_steps=src.num_steps,
            num_micro_batches=src.num_micro_batches,
            sample_order=request.spec.sample_order or "meshtrain",
            format=src.dataset_format,
        )  # as built

    def StreamBatches(self, request: pb.StreamRequest, context):
        with self._peer_streams.hold(context):  # before anything is opened or built for it
            yield from self._stream(request, context)

    def _stream(self, request: pb.StreamRequest, context):
        step, mb = int(request.start_step), int(request.start_microbatch)
        # end_step 0 means "until the dataset runs out"; any other end at or before the start
        # would be an empty stream, which a client cannot tell from running out of data
        if request.end_step != 0 and request.end_step <= step:
            raise DataError(
                f"end_step={request.end_step} is not after start_step={step} "
                f"(0: until the dataset runs out)"
            )
        src = self._source(request)
        end = src.num_steps if request.end_step == 0 else min(int(request.end_step), src.num_steps)
        if mb >= src.num_micro_batches:
            raise DataError(f"start_microbatch={mb} is outside [0, {src.num_micro_batches})")
        if step >= src.num_steps:
            raise DataError(f"start_step={step} is past the dataset's {src.num_steps} steps")
        with self.index_cache.pinned(index_keys(src.dataset)):  # not evicted while streamed
            what = f"stream of dp rank {request.dp_rank} from step {step}"
            yield from self._reaper.watch(self._batches(src, step, mb, end, context), context, what)

    @staticmethod
    def _batches(
        src: LocalBatchSource | MultimodalBatchSource, step: int, mb: int, end: int, context
    ):
        """The stream's messages from (step, micro-batch) up to step `end`."""
        while step < end and context.is_active():
            if isinstance(src, MultimodalBatchSource):
                yield payload_message(src.payload(step, mb), step, mb)
                mb += 1
                if mb == src.num_micro_batches:
                    step, mb = step + 1, 0
                continue
            # (mbs, seq + 1), or (mbs, 2, seq/(2 cp) + 1) under cp; SFT's mask and ids alike
            samples, mask, docs = src.payload_arrays(step, mb)
            samples = samples.astype(samples.dtype.newbyteorder("<"), copy=False)
            msg = pb.MicroBatch(
                step=step,
                microbatch=mb,
                dtype=samples.dtype.name,
                shape=list(samples.shape),
                samples=samples.tobytes(),
            )
            if mask is not None and docs is not None:
                msg.token_mask.CopyFrom(array_to_proto(mask))
                msg.document_ids.CopyFrom(array_to_proto(docs))
            yield msg
            mb += 1
            if mb == src.num_micro_batches:
                step, mb = step + 1, 0
