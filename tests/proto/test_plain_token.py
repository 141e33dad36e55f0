"""The slotted tokens read as pb.TokenEvents: every field a TokenEvent has, with a mid-stream token's values."""

from __future__ import annotations

import pytest

from coordinator.workers.vllm.completions import PlainToken
from proto import worker_pb2 as pb
from proto.token_channel import read_records, token_record


@pytest.mark.parametrize("token", [PlainToken(5, 2, 1.5, "hi"),
                                   read_records(token_record(b"r", 5, 2, 1, 1.5, 0.0, b"hi"))[0]],
                         ids=["vllm-chunk", "channel-record"])
def test_a_plain_token_has_every_token_event_field_with_a_mid_stream_tokens_value(token):
    event = pb.TokenEvent(token_id=5, index=2, time_ms=1.5, text="hi", batch_size=1)
    for field in pb.TokenEvent.DESCRIPTOR.fields:
        value, mine = getattr(event, field.name), getattr(token, field.name)
        if not isinstance(value, (int, float, str)):  # a repeated field
            value, mine = list(value), list(mine)
        assert mine == value, field.name
