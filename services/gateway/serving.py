"""The gateway's shared state (config, scheduler client, tokenizer, request builder, metrics)
and the submission of built requests as per-choice delta streams.

    RequestBuilder.build() -> GenerateRequest -> codec -> SampleStreams -> run_sequence() per choice
"""

from __future__ import annotations

import logging
import uuid

from fastapi import Request

from common import tracing
from common.sampling_params import GenerateRequest
from protos.scheduler_codec import request_to_pb
from services.gateway.config import GatewayConfig
from services.gateway.errors import model_not_found
from services.gateway.generation import DeltaStream, OutputOptions, run_sequence
from services.gateway.limits import InFlight
from services.gateway.protocol import template_tools
from services.gateway.request_builder import RequestBuilder
from services.gateway.scheduler_client import SampleStreams, SchedulerClient
from services.gateway.telemetry import GatewayMetrics
from services.gateway.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class ServingContext:
    """Shared by every request; holds no per-request state."""

    def __init__(
        self, config: GatewayConfig, client: SchedulerClient, tokenizer: Tokenizer
    ) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        assert config.max_model_len is not None, "GatewayConfig resolves it when made"
        self.max_model_len: int = config.max_model_len
        self.metrics = GatewayMetrics(config.served_model_name[0])
        self.in_flight = InFlight(config.max_concurrent_requests_per_key)
        self.builder = RequestBuilder(
            self.max_model_len, tokenizer.eos_token_ids, config.sampling_defaults,
            config.structured_outputs,
        )

    async def encode_chat(self, body) -> list[int]:
        """Token ids of a chat request's messages through the model's chat template (the
        chat completions and /tokenize bodies carry the same template fields)."""
        return await self.tokenizer.aencode_chat(
            [message.for_template() for message in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            template_kwargs=body.chat_template_kwargs,
            add_special_tokens=body.add_special_tokens,
            tools=template_tools(body.tools),
        )

    def check_prompt(self, prompt_ids: list[int], param: str) -> None:
        """A prompt the model can take, as a 400 naming `param` otherwise: every id a row of
        its embedding (a client's ids, or a text's: its tokenizer may hold tokens the model has
        no row for), and room left in the context."""
        self.tokenizer.check_token_ids(prompt_ids, param)
        self.builder.check_prompt(prompt_ids, param)

    def check_model(self, name: str | None) -> str:
        """The served name to report; an unknown name is a 404, like OpenAI."""
        if name is None:
            return self.config.served_model_name[0]
        if name not in self.config.served_model_name:
            raise model_not_found(name)
        return name

    @staticmethod
    def request_ids(raw: Request, prefix: str) -> tuple[str, str]:
        """(the id the client sees, the scheduler's id). The client's x-request-id is echoed
        and logged but never reaches the scheduler: clients may send the same one at once, to
        one gateway or to several, and the scheduler's ids are unique. The scheduler's id is a
        fresh "<prefix>-<uuid hex>", also the client's when it sent none."""
        scheduler_id = f"{prefix}-{uuid.uuid4().hex}"
        given = raw.headers.get("x-request-id")
        if given:
            logger.info("request %s: x-request-id %s", scheduler_id, given)
        if tracing.enabled():  # on the HTTP server span, where a client's id is looked for
            ids = {"pdserve.request_id": scheduler_id}
            if given:
                ids["pdserve.client_request_id"] = given
            tracing.current_span().set_attributes(ids)
        raw.state.request_id = given or scheduler_id
        return given or scheduler_id, scheduler_id

    async def wait_for_workers(self) -> None:
        """Returns once the scheduler can serve a request; raises 503 with Retry-After when it
        still cannot after --no-worker-wait."""
        readiness = self.client.readiness
        if not await readiness.wait_serving(self.config.no_worker_wait_s):
            raise readiness.unavailable()

    def sequences(
        self, requests: list[GenerateRequest], options: OutputOptions
    ) -> list[DeltaStream]:
        """One delta stream per sample of each request, choice indices counting on across
        requests. Nothing reaches the scheduler before a stream is iterated."""
        streams: list[DeltaStream] = []
        for request in requests:
            source = SampleStreams(self.client, request_to_pb(request))
            first = len(streams)
            streams.extend(
                run_sequence(request, source, j, self.tokenizer, first + j, options, self.metrics)
                for j in range(len(request.request_ids))
            )
        return streams
