"""A worker's measured costs (what `pdserve profile` writes and `pdserve plan` reads): raw points and fits."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.workload import describe


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


class PrefillPoint(BaseModel):
    """One Prefill call alone on the worker: its forward, and what followed until the decode side acknowledged."""

    model_config = ConfigDict(extra="forbid")

    prompt_tokens: int = Field(ge=1)
    prefill_ms: float = Field(ge=0, description="the worker's own prefill_time_ms: queue (none, alone) + forward")
    handoff_ms: float = Field(ge=0, description="Prefill call time less prefill_ms: the KV tail, the ack, the RPC")
    kv_bytes: int = Field(ge=0, description="bytes of the KV stream the worker sent")


class DecodePoint(BaseModel):
    """The median step of a decode batch of `batch_size` sequences holding `context_tokens` positions in all."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(ge=1)
    context_tokens: int = Field(ge=1, description="prompt + generated tokens, summed over the batch")
    step_ms: float = Field(gt=0)


class PrefillCosts(BaseModel):
    """prefill_ms(padded tokens) = base_ms + ms_per_token x tokens; handoff_ms(bytes) likewise in bytes."""

    model_config = ConfigDict(extra="forbid")

    base_ms: float = Field(ge=0)
    ms_per_token: float = Field(ge=0)
    handoff_base_ms: float = Field(ge=0)
    handoff_ms_per_mib: float = Field(ge=0)
    kv_bytes_per_token: float = Field(ge=0, description="bytes of KV cache one prompt token makes")
    points: list[PrefillPoint] = Field(min_length=1)

    def prefill_ms(self, padded_tokens: int) -> float:
        return self.base_ms + self.ms_per_token * padded_tokens

    def handoff_ms(self, prompt_tokens: int) -> float:
        return self.handoff_base_ms + self.handoff_ms_per_mib * prompt_tokens * self.kv_bytes_per_token / 2**20

    @classmethod
    def fit(cls, points: list[PrefillPoint]) -> PrefillCosts:
        tokens = [p.prompt_tokens for p in points]
        base, per_token = fit_nonnegative([[1.0, t] for t in tokens], [p.prefill_ms for p in points])
        per_token_bytes = float(np.median([p.kv_bytes / p.prompt_tokens for p in points]))
        handoff_base, handoff_per_byte = fit_nonnegative([[1.0, p.kv_bytes] for p in points],
                                                         [p.handoff_ms for p in points])
        return cls(base_ms=base, ms_per_token=per_token, handoff_base_ms=handoff_base,
                   handoff_ms_per_mib=handoff_per_byte * 2**20, kv_bytes_per_token=per_token_bytes, points=points)


class DecodeCosts(BaseModel):
    """step_ms(batch, context) = base_ms + ms_per_seq x batch + ms_per_context_token x context tokens in the batch."""

    model_config = ConfigDict(extra="forbid")

    base_ms: float = Field(ge=0)
    ms_per_seq: float = Field(ge=0)
    ms_per_context_token: float = Field(ge=0)
    points: list[DecodePoint] = Field(min_length=1)

    def step_ms(self, batch_size: int, context_tokens: int) -> float:
        return self.base_ms + self.ms_per_seq * batch_size + self.ms_per_context_token * context_tokens

    @classmethod
    def fit(cls, points: list[DecodePoint], with_context: bool = True) -> DecodeCosts:
        """`with_context` False: step_ms = base + per-sequence cost only, for points whose context tokens move
        with their batch size (live timings), which cannot tell the two costs apart."""
        rows = [[1.0, p.batch_size, p.context_tokens if with_context else 0.0] for p in points]
        base, per_seq, per_context = fit_nonnegative(rows, [p.step_ms for p in points])
        return cls(base_ms=base, ms_per_seq=per_seq, ms_per_context_token=per_context, points=points)


class WorkerProfile(BaseModel):
    """What `pdserve profile` measured on one worker of one role."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode"]
    worker: str = Field(description="the address profiled")
    model: str = Field(description="the model the worker reported")
    kv_capacity_tokens: int = Field(ge=0, description="the worker's KV budget, from its Health")
    prefill: PrefillCosts | None = None
    decode: DecodeCosts | None = None

    @model_validator(mode="after")
    def _costs_of_its_role(self):
        if (self.prefill is not None, self.decode is not None) != (self.role == "prefill", self.role == "decode"):
            raise ValueError(f"a {self.role} profile holds exactly the `{self.role}` costs")
        return self

    def save(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: Path, role: str) -> WorkerProfile:
        """The profile in `path`, which must be of `role`."""
        try:
            profile = cls.model_validate_json(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ProfileError(f"{path}: cannot read: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ProfileError(f"{path}: not UTF-8 text (byte {exc.start})") from None
        except ValidationError as exc:
            raise ProfileError(f"{path}: not a worker profile: {describe(exc)}") from None
        if profile.role != role:
            raise ProfileError(f"{path}: a {profile.role} profile, where a {role} one is needed")
        return profile


def fit_nonnegative(rows: list[list[float]], values: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: a term fitted negative (noise, e.g. a cost that does not grow
    with context) is dropped and the rest refitted, so no extrapolation predicts a cost falling with load."""
    x = np.asarray(rows, dtype=float)
    y = np.asarray(values, dtype=float)
    kept = list(range(x.shape[1]))
    while True:
        coefficients = np.zeros(x.shape[1])
        if kept:
            solved, *_ = np.linalg.lstsq(x[:, kept], y, rcond=None)
            coefficients[kept] = solved
        negative = [i for i in kept if coefficients[i] < 0]
        if not negative:
            return [float(c) for c in coefficients]
        kept.remove(min(negative, key=lambda i: coefficients[i]))
