"""The trainer's client of rollout workers: a `RolloutBackend` over the network.

`generate` splits a request's prompts into contiguous shards, one per live worker, and sends
each as its own Generate (request id `ID/k`, and the index of its first prompt, so a shard is
seeded as it would be in one request: the answer does not depend on how many workers there
are). A worker that fails in a way worth retrying (killed, unreachable, overloaded) is set
aside for `retry_after_s` and its shard goes to another; each shard's answer is taken once, so
no prompt is lost or answered twice. A worker whose weights are older than the request's
`min_version` refuses (FAILED_PRECONDITION) and the shard tries the others. Completions older
than the allowed staleness are refused here too, whatever a worker answers.

    client = RolloutClient(["10.0.0.5:50061", "10.0.0.6:50061"], max_staleness=1)
    client.update_weights(step, tensors=model.state_dict())     # or: from checkpoint `step`
    completions = client.generate(RolloutRequest(prompts, group_size=8))
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from meshtrain.protos.rollout.v1 import rollout_pb2 as pb
from meshtrain.protos.rollout.v1 import rollout_pb2_grpc as pb_grpc
from meshtrain.services.common.client_security import ClientSecurity
from meshtrain.services.common.errors import InvalidRequestError, MeshtrainError
from meshtrain.services.common.grpc_utils import channel_options, is_permanent
from meshtrain.services.rollout.types import Completion, RolloutRequest


class RolloutUnavailableError(MeshtrainError):
    """No rollout worker could answer (all down, or all holding weights that are too old)."""


class RolloutRefusedError(MeshtrainError):
    """A worker refused the call for good: no or a wrong token, too small a scope, a bug."""


class StaleCompletionError(MeshtrainError):
    """A worker answered with completions older than the allowed staleness."""


class _Worker:
    def __init__(self, address: str, security: ClientSecurity, max_message_bytes: int):
        self.address = address
        self.channel = security.channel(address, channel_options(max_message_bytes))
        self.stub = pb_grpc.RolloutServiceStub(self.channel)
        self.down_until = 0.0


class RolloutClient:
    """Spreads rollout requests over workers; implements `RolloutBackend`."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        security: ClientSecurity | None = None,
        *,
        max_staleness: int | None = None,
        wait_s: float = 0.0,
        timeout_s: float = 600.0,
        retry_after_s: float = 5.0,
        max_chunk_bytes: int = 4 << 20,
        max_message_bytes: int = 64 << 20,
    ):
        """Args:
        addresses: `host:port` of each worker (a list, or one comma-separated string).
        security: token and TLS (None: $MESHTRAIN_TOKEN if set, plaintext).
        max_staleness: accept completions of versions >= (the version last published through
            `update_weights`) - max_staleness; None: only the request's own `min_version`.
        wait_s: how long a worker waits for weights of the required version before refusing.
        timeout_s: deadline of one Generate.
        retry_after_s: how long a worker that failed is left out before it is tried again.
        max_chunk_bytes: bytes of tensor data per UpdateWeights message.
        max_message_bytes: gRPC message limit of the channels.
        """
        if isinstance(addresses, str):
            addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        if not addresses:
            raise InvalidRequestError("RolloutClient needs at least one worker address")
        if max_staleness is not None and max_staleness < 0:
            raise InvalidRequestError(f"max_staleness must be >= 0, got {max_staleness}")
        self.security = security or ClientSecurity.from_files()
        self.max_staleness = max_staleness
        self.wait_s = wait_s
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.max_chunk_bytes = max_chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.version: int | None = None
        """The newest version published through this client."""
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        for a in addresses:
            self.add_worker(a)

    # ---- workers ---------------------------------------------------------------------------

    def add_worker(self, address: str) -> None:
        """Use `address` too, from the next shard on (a worker that joins during a run)."""
        with self._lock:
            if all(w.address != address for w in self._workers):
                self._workers.append(_Worker(address, self.security, self.max_message_bytes))

    @property
    def addresses(self) -> list[str]:
        with self._lock:
            return [w.address for w in self._workers]

    def _live(self) -> list[_Worker]:
        now = time.monotonic()
        with self._lock:
            live = [w for w in self._workers if w.down_until <= now]
            return live or list(self._workers)  # all down: try them all again rather than none

    def describe(self) -> dict[str, dict]:
        """address -> the worker's Describe (model, version), for the workers that answer."""
        out = {}
        for w in list(self._workers):
            try:
                d = w.stub.Describe(pb.DescribeRequest(), timeout=10.0)
            except grpc.RpcError:
                continue
            out[w.address] = {f.name: getattr(d, f.name) for f in d.DESCRIPTOR.fields}
        return out

    def close(self) -> None:
        for w in self._workers:
            w.channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- generation ------------------------------------------------------------------------

    def min_version(self, request: RolloutRequest) -> int:
        """The oldest version accepted for `request`: its own bound, raised by max_staleness."""
        floor = request.min_version
        if self.max_staleness is not None and self.version is not None:
            floor = max(floor, self.version - self.max_staleness)
        return floor

    def generate(self, request: RolloutRequest) -> list[Completion]:
        """`group_size` completions per prompt, grouped by prompt, from any live workers.

        Raises:
            InvalidRequestError: a worker refused the request's fields (INVALID_ARGUMENT).
            RolloutRefusedError: a worker refused the caller (token, scope).
            RolloutUnavailableError: no worker could serve a shard.
            StaleCompletionError: a worker answered with too old a policy.
        """
        floor = self.min_version(request)
        rid = request.request_id or uuid.uuid4().hex
        n = len(request.prompts)
        k = max(1, min(n, len(self._live())))
        bounds = [(i * n // k, (i + 1) * n // k) for i in range(k)]
        with ThreadPoolExecutor(max_workers=k) as pool:
            futures = [
                pool.submit(self._shard, request, f"{rid}/{i}", lo, hi, floor, i)
                for i, (lo, hi) in enumerate(bounds)
            ]
            results = [f.result() for f in futures]
        return [c for shard in results for c in shard]

    def _shard(
        self, request: RolloutRequest, rid: str, lo: int, hi: int, floor: int, turn: int
    ) -> list[Completion]:
        """Prompts lo..hi-1 answered once, by the first worker that can."""
        s = request.sampling
        msg = pb.GenerateRequest(
            prompts=[
                pb.Prompt(tokens=np.asarray(p, dtype="<i4").tobytes())
                for p in request.prompts[lo:hi]
            ],
            group_size=request.group_size,
            sampling=pb.Sampling(
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                top_k=s.top_k or 0,
                top_p=s.top_p or 0.0,
                seed=s.seed,
            ),
            min_version=floor,
            request_id=rid,
            prompt_offset=lo,
            wait_s=self.wait_s,
        )
        tried: set[str] = set()
        errors: list[str] = []
        while True:
            live = [w for w in self._live() if w.address not in tried]
            if not live:
                raise RolloutUnavailableError(
                    f"no rollout worker answered prompts {lo}..{hi - 1}: " + "; ".join(errors)
                )
            worker = live[turn % len(live)]
            tried.add(worker.address)
            try:
                response = worker.stub.Generate(msg, timeout=self.timeout_s)
            except grpc.RpcError as e:
                code = e.code()
                errors.append(f"{worker.address}: {code.name} {e.details()}")
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequestError(e.details()) from None
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    continue  # weights too old there: another worker may hold newer ones
                if is_permanent(e):
                    raise RolloutRefusedError(errors[-1]) from None
                worker.down_until = time.monotonic() + self.retry_after_s
                continue
            return self._completions(response, request, lo, hi, floor, worker.address)

    @staticmethod
    def _completions(
        response, request: RolloutRequest, lo: int, hi: int, floor: int, address: str
    ) -> list[Completion]:
        version = response.policy_version
        if version < floor:
            raise StaleCompletionError(
                f"{address} answered with policy version {version}, older than {floor}"
            )
        if len(response.completions) != (hi - lo) * request.group_size:
            raise RolloutUnavailableError(
                f"{address} answered {len(response.completions)} completions for "
                f"{hi - lo} prompts x {request.group_size}"
            )
        out = []
        for c in response.completions:
            tokens = np.frombuffer(c.tokens, dtype="<i4").tolist()
            logprobs = np.frombuffer(c.logprobs, dtype="<f4").tolist()
            out.append(Completion(lo + c.prompt_index, tokens, logprobs, version, c.finished))
        return out

    # ---- weights ---------------------------------------------------------------------------

    def update_weights(self, version: int, tensors: dict | None = None) -> None:
        """Make `version` the policy every worker generates from.

        Args:
            version: the new version (the trainer's step).
            tensors: every parameter of the single-device model, by name (e.g. a state dict of
                the full weights): streamed to each worker. None: each worker loads committed
                checkpoint `version` from its checkpoint root.

        Raises:
            InvalidRequestError: a worker refused the weights (names, shapes, an older version).
            RolloutRefusedError: a worker refused the caller (token, scope: updates need write).
            RolloutUnavailableError: no worker could be reached (those that could not are
                left out until they answer again).
        """
        from meshtrain.services.rollout.weights import tensor_chunks

        failures = []
        for w in list(self._workers):
            try:
                if tensors is None:
                    w.stub.LoadCheckpoint(pb.LoadCheckpointRequest(step=version), timeout=600.0)
                else:
                    chunks = (
                        pb.WeightChunk(
                            version=version,
                            name=name,
                            dtype=dtype,
                            shape=shape,
                            offset=offset,
                            data=data,
                        )
                        for name, dtype, shape, offset, data in tensor_chunks(
                            tensors, self.max_chunk_bytes
                        )
                    )
                    w.stub.UpdateWeights(chunks, timeout=600.0)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequestError(f"{w.address}: {e.details()}") from None
                if is_permanent(e):
                    raise RolloutRefusedError(
                        f"{w.address}: {e.code().name} {e.details()}"
                    ) from None
                # A worker that missed the update refuses requests it is too old for (min_version).
                w.down_until = time.monotonic() + self.retry_after_s
                failures.append(f"{w.address}: {e.code().name} {e.details()}")
        if len(failures) == len(self._workers):
            raise RolloutUnavailableError("weights not published to " + "; ".join(failures))
        self.version = version if self.version is None else max(self.version, version)
