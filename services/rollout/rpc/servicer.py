"""The RolloutService servicer: protobuf in, `RolloutEngine` call, protobuf out.

Every size a client chooses is checked before anything is allocated for it: the prompt count
and each prompt's byte length before its tokens are decoded (the engine then checks group size,
max_new_tokens and the context), and each weight chunk against the model's own parameter (name,
shape, byte range) before its buffer exists. Domain errors are raised and mapped to status codes
by the shared `ErrorInterceptor` (InvalidRequestError: INVALID_ARGUMENT; StaleWeightsError:
FAILED_PRECONDITION; CheckpointError: FAILED_PRECONDITION).
"""

from __future__ import annotations

import numpy as np

from meshtrain.protos.rollout.v1 import rollout_pb2 as pb
from meshtrain.protos.rollout.v1 import rollout_pb2_grpc as pb_grpc
from meshtrain.services.common.errors import InvalidRequestError
from meshtrain.services.rollout.engine import RolloutEngine
from meshtrain.services.rollout.types import RolloutRequest, SamplingParams
from meshtrain.services.rollout.weights import WeightAssembler, checkpoint_config

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
MAX_REQUEST_ID = 256


def request_from_pb(req: pb.GenerateRequest, engine: RolloutEngine) -> RolloutRequest:
    """The domain request of a GenerateRequest, its sizes checked before decoding."""
    limits = engine.limits
    if not 1 <= len(req.prompts) <= limits.max_prompts:
        raise InvalidRequestError(
            f"prompts: {len(req.prompts)} prompts, must be 1..{limits.max_prompts}"
        )
    if len(req.request_id) > MAX_REQUEST_ID:
        raise InvalidRequestError(f"request_id is longer than {MAX_REQUEST_ID} characters")
    prompts = []
    vocab = engine.model.vocab_size
    for i, p in enumerate(req.prompts):
        n = len(p.tokens)
        if n % 4 or not 1 <= n // 4 <= limits.max_prompt_tokens:
            raise InvalidRequestError(
                f"prompts[{i}].tokens: {n} bytes; must be 1..{limits.max_prompt_tokens} int32 ids"
            )
        ids = np.frombuffer(p.tokens, dtype="<i4")
        if ids.min() < 0 or ids.max() >= vocab:
            raise InvalidRequestError(f"prompts[{i}]: a token id outside 0..{vocab - 1}")
        prompts.append(ids.tolist())
    s = req.sampling
    sampling = SamplingParams(
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_k=s.top_k or None,
        top_p=s.top_p or None,
        seed=s.seed,
    )
    return RolloutRequest(prompts, req.group_size, sampling, req.min_version, req.request_id)


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    """Serves one engine; `checkpoint_root` is where LoadCheckpoint reads."""

    def __init__(self, engine: RolloutEngine, checkpoint_root: str | None, max_chunk_bytes: int):
        self.engine = engine
        self.checkpoint_root = checkpoint_root
        self.max_chunk_bytes = max_chunk_bytes

    def Generate(self, request, context):
        if request.prompt_offset < 0 or not 0 <= request.wait_s <= 3600:
            raise InvalidRequestError("prompt_offset must be >= 0 and wait_s in [0, 3600]")
        domain = request_from_pb(request, self.engine)
        completions = self.engine.generate(domain, request.prompt_offset, request.wait_s)
        version = completions[0].policy_version
        return pb.GenerateResponse(
            policy_version=version,
            completions=[
                pb.Completion(
                    prompt_index=c.prompt_index,
                    tokens=np.asarray(c.tokens, dtype="<i4").tobytes(),
                    logprobs=np.asarray(c.logprobs, dtype="<f4").tobytes(),
                    finished=c.finished,
                )
                for c in completions
            ],
        )

    def UpdateWeights(self, request_iterator, context):
        params = dict(self.engine.model.named_parameters())
        assembler = WeightAssembler(params, self.engine.model.vocab_size)
        for chunk in request_iterator:
            if len(chunk.data) > self.max_chunk_bytes:
                raise InvalidRequestError(
                    f"weight chunk of {len(chunk.data)} bytes exceeds {self.max_chunk_bytes}"
                )
            if len(chunk.shape) > 8:
                raise InvalidRequestError(f"weight {chunk.name[:100]!r}: more than 8 dimensions")
            assembler.add(
                chunk.version, chunk.name, chunk.dtype, tuple(chunk.shape), chunk.offset, chunk.data
            )
        tensors, version = assembler.finish()
        self.engine.set_weights(tensors, version)
        return pb.UpdateWeightsResponse(version=version)

    def LoadCheckpoint(self, request, context):
        if self.checkpoint_root is None:
            raise InvalidRequestError("this worker has no checkpoint root to load from")
        step = request.step
        if step < 0:
            _, step = checkpoint_config(self.checkpoint_root, None)
        self.engine.load_checkpoint(self.checkpoint_root, step)
        return pb.UpdateWeightsResponse(version=self.engine.version)

    def Describe(self, request, context):
        d = self.engine.describe()
        return pb.DescribeResponse(checkpoint_root=self.checkpoint_root or "", **d)
