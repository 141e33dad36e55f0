"""The coordinator's side of a token channel, fed the worker's frames by hand."""

from __future__ import annotations

import pytest

from coordinator.workers.token_channels import TokenChannel
from proto import worker_pb2 as pb
from proto.token_channel import ChannelState, encode_frame


class SilentTransport:
    """Stands in for the connection: what the channel wrote."""

    def __init__(self):
        self.written: list[bytes] = []

    def get_extra_info(self, name):
        return None

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("answers_health", [True, False])
async def test_health_probes_go_on_a_channel_only_when_its_worker_said_it_answers_them(answers_health):
    # Workers before the `health` request kind took a probe for a decode request and never answered it.
    channel = TokenChannel("127.0.0.1:1", "127.0.0.1:2")
    channel.connection_made(SilentTransport())
    greeting = pb.TokenChannelFrame(channel_id="c1", answers_health=answers_health)
    channel.data_received(encode_frame(greeting.SerializeToString()))
    assert channel.state is ChannelState.OPEN and channel.opened.done()
    assert channel.answers_health is answers_health
