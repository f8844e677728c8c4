"""gRPC shell of the checkpoint service: servicer, server and client."""
