"""Prefill and decode workers: a gRPC server in front of an engine that runs a real model."""
