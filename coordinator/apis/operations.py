"""GET /health and GET /v1/models."""

from __future__ import annotations


def models_body(model_name: str, created: int, max_model_len: int) -> dict:
    return {
        "object": "list",
        "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "pdserve",
                  "root": model_name, "max_model_len": max_model_len}],
    }


def health_body(instances: dict[str, list[dict]]) -> tuple[int, dict]:
    """200 when a prefill and a decode instance are routable ("degraded" if some others are not),
    else 503; every instance is listed with its state."""
    states = {role: {i["address"]: i["state"] for i in group} for role, group in instances.items()}
    serving = all("healthy" in group.values() for group in states.values())
    everyone = all(state == "healthy" for group in states.values() for state in group.values())
    status = "healthy" if serving and everyone else "degraded" if serving else "unhealthy"
    return (200 if serving else 503), {"status": status, "instances": states}
