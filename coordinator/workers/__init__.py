"""The coordinator's side of its workers: the instance registry, gRPC clients and token channels, health, silence and KV event watches, vLLM instances."""
