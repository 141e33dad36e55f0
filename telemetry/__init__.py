"""Telemetry shared by the coordinator and the workers: OpenTelemetry traces."""
