"""What the ext_proc server and the endpoint picker exchange: one gateway request in, one pick (or a refusal) out.

The protocol's names (Gateway API Inference Extension, proposal 004; llm-d's EPP):
  - the chosen endpoint, then its fallbacks, as `ip:port,ip:port` in the header DESTINATION_HEADER and in the
    dynamic metadata namespace LB_NAMESPACE under the same key;
  - a subset hint in LB_NAMESPACE/SUBSET_HINT_KEY (or the header SUBSET_HEADER): only endpoints in it may be picked;
  - the endpoint that served the request, read back from LB_NAMESPACE/SERVED_KEY (or the response header SERVED_KEY);
  - the prefill worker for the decode pod's sidecar in PREFILLER_HEADER (absent: the decode worker prefills), and
    pdserve's own KV_PULL_HEADER: where that worker pulls the prompt's leading blocks from (absent: nowhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # its SUBSET_HEADER key: the hint as Envoy's GIE configs pass it
PREFILLER_HEADER = "x-prefiller-host-port"
KV_PULL_HEADER = "x-pdserve-kv-pull"  # `host:port tokens`: the peer the named prefill worker pulls leading blocks from
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
MODEL_REWRITE_HEADER = "x-llm-d-model-name-rewrite"
# Sent by older gateways; read when the new one is absent.
OLD_OBJECTIVE_HEADER = "x-gateway-inference-objective"
OLD_FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
MAX_BODY_CHUNK = 62_000  # bytes per streamed body chunk sent back to Envoy


@dataclass
class GatewayRequest:
    """What the ext_proc stream saw of one HTTP request before the pick."""

    headers: dict[str, str]  # lower-case names; pseudo-headers (:path, :method, :authority) included
    body: bytes = b""
    subset: list[str] | None = None  # the subset hint's endpoints; None: no hint


@dataclass
class EndpointPick:
    """Where one request goes: the endpoints (chosen first, then fallbacks) and the header changes to make."""

    endpoints: list[str]
    set_headers: dict[str, str] = field(default_factory=dict)
    remove_headers: list[str] = field(default_factory=list)
    body: bytes | None = None  # the body to send on instead of the one received (a model rewrite); None: as received

    @property
    def destination(self) -> str:
        return ",".join(self.endpoints)

    def served(self, endpoint: str) -> None:
        """The gateway reports the endpoint that served the request (it may be a fallback)."""

    def close(self) -> None:
        """The request ended (its ext_proc stream closed): release what the pick holds."""


class PickRefused(Exception):
    """No endpoint for the request: answered by the gateway itself (503 nothing ready, 429 shed, 400 bad header)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None,
                 error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.error_type = error_type  # the OpenAI error body's `type`


class EndpointPicker(Protocol):
    """Picks the endpoint of each gateway request."""

    async def pick(self, request: GatewayRequest) -> EndpointPick:
        """The pick, or PickRefused."""
