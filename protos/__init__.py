"""Protocol buffers of the services and their generated stubs: `meshtrain.protos`.

    protos/dataloader/v1/dataloader.proto   package meshtrain.dataloader.v1  (DataService)
    protos/checkpoint/v1/checkpoint.proto   package meshtrain.checkpoint.v1  (CheckpointService)
    protos/trainer/v1/trainer.proto         package meshtrain.trainer.v1     (the trainer's control endpoint)

The stubs are committed, generated with grpcio-tools 1.84 (`make protos`) so they run with
grpcio >= 1.84 and protobuf >= 7.35. Only each service's `rpc/` imports them.
"""

if __name__ != "meshtrain.protos":  # one name per file: this folder installs as meshtrain.protos
    raise ImportError(
        f"import meshtrain.protos{__name__[len('protos') :]}, not {__name__}: the repository's "
        "protos/ folder is the package meshtrain.protos"
    )
