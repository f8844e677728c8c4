"""gRPC shell of the rollout service: servicer, server and client."""
