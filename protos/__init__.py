"""Protocol buffers of the services and their generated stubs, importable as `protos`.

    protos/dataloader/v1/dataloader.proto   package meshtrain.dataloader.v1  (DataService)
    protos/checkpoint/v1/checkpoint.proto   package meshtrain.checkpoint.v1  (CheckpointService)

The stubs are committed, generated with grpcio-tools 1.84 (`make protos`) so they run with
grpcio >= 1.84 and protobuf >= 7.35. Only each service's `rpc/` imports them.
"""
