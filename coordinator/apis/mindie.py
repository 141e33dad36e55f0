"""MindIE native POST /infer: stream and non-stream, `prefill_time` / `decode_time` per event (the MindIE
API, docs/compatibility.md)."""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from coordinator.apis.fields import PromptInput, new_id, read_request
from coordinator.apis.prompts import tokenize_input
from coordinator.apis.response_models import MindieResponse, MindieStreamEvent, Reply, TextGenErrorBody
from coordinator.http.route_table import ErrorStyle, Route
from coordinator.apis.tgi_family import QueuedParameters, TextGenFormatter, finish_details, token_timing
from coordinator.requests.request import Finished, TokenDelta
from coordinator.requests.serving import Transcript, serve_generation
from coordinator.state import STATE


class MindieParameters(QueuedParameters):
    """`parameters` of a MindIE /infer request, with the ranges of the MindIE API (docs/compatibility.md)."""


class MindieRequest(BaseModel):
    """The body of a MindIE /infer request."""

    model_config = ConfigDict(extra="forbid")

    inputs: PromptInput
    stream: bool = False
    parameters: MindieParameters = MindieParameters()


class MindieFormatter(TextGenFormatter):
    """Per token `{prefill_time, decode_time, token: {id: [id], text}}`; the last adds the result."""

    def __init__(self, params: MindieParameters, seed: int, full_text: bool):
        self.params = params
        self.seed = seed
        self.full_text = full_text

    def _details(self, finished: Finished) -> dict:
        return {**finish_details(finished), "seed": self.seed}

    def stream_event(self, delta: TokenDelta, transcript: Transcript, finished: Finished | None) -> dict:
        # As in the MindIE API (docs/compatibility.md), the last event's token has no text: generated_text carries all
        # of it.
        text = self.streamed_text(delta, transcript) if finished is None else None
        event = {**token_timing(delta), "token": {"id": [delta.token_id], "text": text}}
        if finished is not None:
            event["generated_text"] = transcript.text
            event["details"] = self._details(finished)
        return event

    def response(self, transcript: Transcript) -> dict:
        body = {"generated_text": transcript.text}
        if self.params.details:
            body["details"] = self._details(transcript.finished)
        return body


async def infer(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await read_request(request, MindieRequest)
    prompt = await tokenize_input(state, req.inputs, "inputs")
    lora = state.loras.select(req.parameters.adapter_id, "parameters.adapter_id")
    gen = req.parameters.generation(new_id("infer"), prompt.token_ids, media=prompt.media, lora=lora)
    formatter = MindieFormatter(req.parameters, gen.sampling.seed, state.full_text)
    return await serve_generation(request, state.pipeline, gen, formatter, req.stream)


ROUTES = [Route("POST", "/infer", infer, ErrorStyle.TGI, "mindie", generation=True, body_model=MindieRequest,
                reply=Reply(json=MindieResponse, events=MindieStreamEvent | TextGenErrorBody))]
