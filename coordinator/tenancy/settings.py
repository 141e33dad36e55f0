"""`tenancy_config` in ms_coordinator.json: tenants' limits beyond the keys file, priority headers, deadlines."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from security.api_keys import MAX_LIMIT, MAX_WEIGHT


class TenancyConfig(BaseModel):
    """Tenants and deadlines (docs/tenants.md). Keys-file tenants carry their own terms; these are the rest."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    trust_fairness_header: bool = Field(False, description="Name the tenant by the fairness header (set by a "
                                        "trusted gateway) rather than by the API key; only behind a gateway that "
                                        "sets it, since any client could.")
    fairness_header: str = Field("x-gateway-inference-fairness-id", min_length=1, max_length=128,
                                 description="The header naming the tenant when trust_fairness_header; with this "
                                 "default, llm-d's x-llm-d-inference-fairness-id is read first.")
    default_weight: float = Field(1.0, gt=0, le=MAX_WEIGHT, description="Weight of a tenant the keys file does "
                                  "not give one (header-named tenants, clients without keys).")
    default_rpm: int = Field(0, ge=0, le=MAX_LIMIT, description="Requests per minute of such a tenant; 0 = none.")
    default_tpm: int = Field(0, ge=0, le=MAX_LIMIT, description="Prompt + output tokens per minute of such a "
                             "tenant; 0 = none.")
    default_concurrency: int = Field(0, ge=0, le=MAX_LIMIT, description="Requests in flight of such a tenant; "
                                     "0 = none.")
    burst_s: float = Field(6, gt=0, le=600, description="A tenant's buckets hold this many seconds of its rate "
                           "(rpm and tpm): what it may send at once after a quiet spell.")
    max_tenants: int = Field(1000, ge=1, le=100_000, description="Distinct header-named tenants kept; past it, "
                             "new names share the tenant `overflow`.")
    objectives: dict[str, int] = Field({}, description="GIE objective names (header "
                                       "x-llm-d-inference-objective, or the older x-gateway-inference-objective) "
                                       "and the priority level 1-5 each maps to; "
                                       "another name is refused with 400.")
    refuse_early: bool = Field(True, description="Refuse at once (503, or 429 on TGI-style APIs, with "
                               "Retry-After) a request the waiting line predicts cannot start before its deadline "
                               "less its expected service time, and let one still waiting then leave; false: "
                               "every request waits until its deadline (504).")

    @field_validator("objectives")
    @classmethod
    def _levels(cls, objectives: dict[str, int]) -> dict[str, int]:
        for name, level in objectives.items():
            if not 1 <= level <= 5 or isinstance(level, bool):
                raise ValueError(f"objective {name!r} maps to {level}; levels are 1 (first) to 5 (last)")
        return objectives
