"""`gateway_config` and `sidecar_config` in ms_coordinator.json: the endpoint picker's port and a sidecar's worker."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from coordinator.addresses import HTTP_URL, check_host_port, split_url


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class GatewayConfig(_Section):
    """The endpoint picker (EPP) a Gateway API inference gateway asks over Envoy's ext_proc (operating/gateway.md)."""

    epp_port: int = Field(-1, ge=-1, le=65535, description="Port of the endpoint picker's ext_proc gRPC server (with "
                          "grpc.health.v1) on http_config.predict_ip; 0 picks a free one; -1: no endpoint picker "
                          "(`--epp-port` overrides). TLS: tls_config.epp.")

    @property
    def enabled(self) -> bool:
        return self.epp_port >= 0
    pool_name: str = Field("pdserve", min_length=1, max_length=253, description="The InferencePool's name in the "
                           "inference_pool_* metrics.")
    fallbacks: int = Field(1, ge=0, le=16, description="Further endpoints after the chosen one in "
                           "x-gateway-destination-endpoint, least loaded first: the gateway tries them when the "
                           "first cannot be reached.")
    sidecar_port: int = Field(0, ge=0, le=65535, description="A decode worker's sidecar port on the worker's host, "
                              "for sidecars that do not announce themselves (every decode pod's, the InferencePool's "
                              "targetPort); 0: only announced sidecars are picked.")
    sidecar_ttl_s: float = Field(15, gt=0, le=3600, description="An announced sidecar not heard from this long is no "
                                 "longer picked (sidecars announce every third of it).")


class SidecarConfig(_Section):
    """A decode pod's sidecar: the client APIs for one decode worker, prefill on the worker the gateway names."""

    decode: str = Field("", description="host:port of this pod's decode worker (pdserve: gRPC; vllm: the address "
                        "of its instances entry); empty: not a sidecar.")
    advertise: str = Field("", description="host:port the gateway reaches this sidecar at (its pod IP and port), "
                           "announced to the endpoint picker.")
    announce_to: str = Field("", description="The endpoint picker's management URL (http(s)://host:port) to "
                             "announce this sidecar to; empty: not announced (gateway_config.sidecar_port finds it).")

    @field_validator("decode", "advertise")
    @classmethod
    def _is_host_port(cls, value: str) -> str:
        return check_host_port(value) if value else value

    @field_validator("announce_to")
    @classmethod
    def _is_url(cls, value: str) -> str:
        if value:
            check_host_port(split_url(value, *HTTP_URL)[1].rstrip("/"))
        return value.rstrip("/")

    @property
    def enabled(self) -> bool:
        return bool(self.decode)
