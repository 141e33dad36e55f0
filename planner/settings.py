"""`planner_config` in ms_coordinator.json: the online planner's SLOs, window and damping."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PlannerConfig(BaseModel):
    """The online planner (planner/online.py): off unless `enabled`; on etcd only the leader runs it."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    enabled: bool = Field(False, description="Decide the prefill and decode counts from live load (`GET /v1/plan`, "
                          "`pdserve_planner_desired_instances`); `pdserve up --autoscale` turns it on.")
    ttft_ms: float = Field(2000, gt=0, le=3_600_000, allow_inf_nan=False, description="TTFT target at the "
                           "percentile, ms.")
    tpot_ms: float = Field(100, gt=0, le=3_600_000, allow_inf_nan=False, description="TPOT target at the "
                           "percentile, ms (a request's mean time per output token after the first).")
    percentile: float = Field(90, gt=0, le=100, allow_inf_nan=False, description="The percentile both targets "
                              "are held at, (0, 100].")
    interval_s: float = Field(5, ge=0.5, le=600, description="Seconds between decisions.")
    window_s: float = Field(30, ge=5, le=3600, description="Requests that arrived in the last window_s seconds "
                            "make the workload each decision simulates.")
    min_requests: int = Field(20, ge=1, le=100_000, description="Fewer finished requests in the window: no "
                              "decision (too little to go on).")
    confirmations: int = Field(2, ge=1, le=100, description="Decisions in a row that must agree before the desired "
                               "counts change (damping: no flapping on noise).")
    cooldown_s: float = Field(20, ge=0, le=3600, description="Least seconds between two changes of the desired "
                              "counts.")
    scale_down_after_s: float = Field(60, ge=0, le=86400, description="Fewer instances in all only after the "
                                      "decisions asked for them this long (scale up fast, down slowly).")
    max_instances: int = Field(8, ge=2, le=1024, description="Most instances of both roles together the planner "
                               "asks for (`pdserve up --autoscale --max-workers` sets it).")
    scale_down_headroom: float = Field(0.8, gt=0, le=1, description="A smaller cluster than the one running is "
                                       "chosen only when its predicted TTFT and TPOT are within this share of their "
                                       "targets (hysteresis against shrinking on noise).")
    min_per_role: int = Field(1, ge=1, le=512, description="Fewest instances of each role it asks for.")
    profile_points: int = Field(256, ge=8, le=100_000, description="Live timings kept per role for the cost fits "
                                "(the newest replace the oldest).")
    prefill_profile: str = Field("", description="A `pdserve profile --role prefill` file whose points seed the "
                                 "prefill fit until live timings replace them; empty = live timings only.")
    decode_profile: str = Field("", description="Likewise for decode (`pdserve profile --role decode`).")

    def resolved(self, base) -> PlannerConfig:
        """Profile paths read relative to the config file's folder (`base`, a Path), as an operator writes them."""
        return self.model_copy(update={name: str(base / path) for name in ("prefill_profile", "decode_profile")
                                       if (path := getattr(self, name)) and not path.startswith("/")})

    @model_validator(mode="after")
    def _room_for_both_roles(self) -> PlannerConfig:
        if 2 * self.min_per_role > self.max_instances:
            raise ValueError(f"max_instances ({self.max_instances}) must hold min_per_role ({self.min_per_role}) "
                             "instances of each role")
        return self
