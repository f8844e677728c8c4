"""TrainerControl servicer: reads the trainer's progress, forwards checkpoint and stop requests.

The trainer acts on requests between steps (`Trainer.request_checkpoint`/`request_stop` set
flags that the training loop reads), so every method returns at once; `Status` shows the
request as pending until the loop has acted on it.
"""

from __future__ import annotations

import hmac

import grpc

from meshtrain.protos.trainer.v1 import trainer_pb2 as pb
from meshtrain.protos.trainer.v1 import trainer_pb2_grpc as pb_grpc
from meshtrain.services.trainer.rpc.client import RUN_TOKEN_KEY

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TrainerControl"].full_name


def status_message(
    progress: dict, stop_requested: bool, checkpoint_requested: bool
) -> pb.StatusResponse:
    """The Status reply for a trainer's `progress` dict (unset optional fields stay unset)."""
    m = pb.StatusResponse(
        step=int(progress["step"]),
        train_iters=int(progress["train_iters"]),
        last_checkpoint=progress.get("last_checkpoint") or "",
        stop_requested=stop_requested,
        checkpoint_requested=checkpoint_requested,
    )
    for key in ("loss", "tokens_per_s", "eta_s"):
        if progress.get(key) is not None:
            setattr(m, key, float(progress[key]))
    return m


class TrainerControlServicer(pb_grpc.TrainerControlServicer):
    """Serves one `meshtrain.services.trainer.train.Trainer`: its `progress` dict,
    `request_checkpoint()` and `request_stop()`. Every call must carry the run token
    (`meshtrain-run` metadata, from RUN_DIR/control.addr): one without it is refused with
    UNAUTHENTICATED, one naming another run's token (read from a stale control.addr whose port now
    serves this run) with FAILED_PRECONDITION. Bearer tokens and TLS, when configured, are checked
    before this (`meshtrain.services.common.security`)."""

    def __init__(self, trainer, token: str | None = None):
        self.trainer = trainer
        self.token = token

    def Status(self, request, context):
        self._check_run(context)
        return status_message(dict(self.trainer.progress), *self.trainer.pending_requests())

    def Checkpoint(self, request, context):
        self._check_run(context)
        self.trainer.request_checkpoint()
        return pb.CheckpointResponse(step=int(self.trainer.progress["step"]))

    def Stop(self, request, context):
        self._check_run(context)
        self.trainer.request_stop()
        return pb.StopResponse(step=int(self.trainer.progress["step"]))

    def _check_run(self, context) -> None:
        if self.token is None:
            return
        sent = dict(context.invocation_metadata() or ()).get(RUN_TOKEN_KEY)
        if sent is None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"calls to this control endpoint must carry its run token ({RUN_TOKEN_KEY} "
                "metadata, from the run directory's control.addr): give the run directory, not "
                "HOST:PORT",
            )
        assert sent is not None  # context.abort raised
        if not hmac.compare_digest(sent.encode(), self.token.encode()):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                # the caller proved nothing: it learns no more of this run than that it is not
                # the one asked for (never its folder)
                "this endpoint serves another run: the control.addr that named it is stale, "
                "left by a trainer that ended without removing it",
            )
