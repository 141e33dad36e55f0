"""GET /health and GET /v1/models."""

from __future__ import annotations


def models_body(model_name: str, created: int, max_model_len: int) -> dict:
    return {
        "object": "list",
        "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "pdserve",
                  "root": model_name, "max_model_len": max_model_len}],
    }


def health_body(statuses: dict[str, dict[str, str]]) -> tuple[int, dict]:
    """200 when every configured instance answers its health check, else 503 with the culprits."""
    healthy = all(state == "healthy" for group in statuses.values() for state in group.values())
    return (200 if healthy else 503), {"status": "healthy" if healthy else "unhealthy", "instances": statuses}
