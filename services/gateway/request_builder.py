"""API request -> the scheduler's GenerateRequests: context-length checks, max_tokens' default,
the model's sampling defaults, and the fan-out of prompts x samples into request ids.

Plain synchronous code: nothing here talks to the scheduler.
"""

from __future__ import annotations

from common.sampling_params import UINT64, GenerateRequest, SamplingParams
from services.gateway.errors import bad_request
from services.gateway.generation import OutputOptions
from services.gateway.protocol import SamplingRequest
from services.gateway.sampling_defaults import SamplingDefaults
from services.gateway.structured_outputs import StructuredOutputsConfig, request_grammar


class RequestBuilder:
    """Invariant: every request it builds fits max_model_len (prompt + max_tokens)."""

    def __init__(
        self, max_model_len: int, eos_token_ids: list[int], sampling_defaults: SamplingDefaults,
        structured_outputs: StructuredOutputsConfig | None = None,
    ) -> None:
        """sampling_defaults: generation_config.json's values, for fields the client left out."""
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampling_defaults = sampling_defaults
        self.structured_outputs = structured_outputs or StructuredOutputsConfig()

    def check_prompt(self, prompt_ids: list[int], param: str = "prompt") -> None:
        if not prompt_ids:
            raise bad_request("The prompt is empty.", param)
        if len(prompt_ids) >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt has {len(prompt_ids)} tokens, which leaves no room "
                "for a completion. Please reduce the length of the prompt.",
                param,
            )

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """Default: generation_config's max_new_tokens, else all the room left in the context
        (and never more), like vLLM."""
        room = self.max_model_len - prompt_len
        if requested is None:
            return min(room, self.sampling_defaults.max_new_tokens or room)
        if requested > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + requested} tokens ({prompt_len} in the "
                f"prompt, {requested} for the completion). Please reduce the length of the "
                "prompt or max_tokens.",
                "max_tokens",
            )
        return requested

    def sampling_params(
        self, req: SamplingRequest, max_tokens: int, num_logprobs: int,
        num_prompt_logprobs: int = -1, grammar: str = "",
    ) -> SamplingParams:
        defaults = self.sampling_defaults

        def pick(value: float | None, default: float | None, fallback: float) -> float:
            """The request's value, else the model's default, else the API's."""
            if value is not None:
                return value
            return default if default is not None else fallback

        return SamplingParams(
            temperature=pick(req.temperature, defaults.temperature, 1.0),
            top_p=pick(req.top_p, defaults.top_p, 1.0),
            top_k=int(pick(req.top_k, defaults.top_k, 0)),
            min_p=pick(req.min_p, defaults.min_p, 0.0),
            seed=None if req.seed is None else req.seed % UINT64,  # the API's seeds are signed
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=pick(req.repetition_penalty, defaults.repetition_penalty, 1.0),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=num_logprobs,
            prompt_logprobs=num_prompt_logprobs,
            logit_bias=req.logit_bias_pairs(),
            grammar=grammar,
        )

    def build(
        self,
        base_id: str,
        prompts: list[list[int]],
        req: SamplingRequest,
        num_logprobs: int,
        samples: int,
        num_prompt_logprobs: int = -1,
    ) -> list[GenerateRequest]:
        """One request per prompt i carrying its samples j < samples: choice index
        i*samples + j, request id "<base_id>-<index>" (just base_id for a single choice),
        seed + j (the scheduler derives it). Raises before returning any request if one
        prompt does not fit."""
        total = len(prompts) * samples
        grammar = request_grammar(req, self.structured_outputs)
        requests = []
        for i, prompt_ids in enumerate(prompts):
            max_tokens = self.max_tokens(req.requested_max_tokens(), len(prompt_ids))
            if req.min_tokens > max_tokens:  # the default max_tokens: the room left
                raise bad_request(f"min_tokens ({req.min_tokens}) must be <= max_tokens "
                                  f"({max_tokens}, the room left in the context)", "min_tokens")
            ids = [base_id if total == 1 else f"{base_id}-{i * samples + j}"
                   for j in range(samples)]
            requests.append(GenerateRequest(
                request_id=ids[0],
                sample_ids=tuple(ids[1:]),
                prompt_token_ids=tuple(prompt_ids),
                sampling=self.sampling_params(req, max_tokens, num_logprobs,
                                              num_prompt_logprobs, grammar),
                eos_token_ids=self.eos_token_ids,
                priority=req.priority,
                cache_salt=req.cache_salt or "",
            ))
        return requests


def output_options(req: SamplingRequest) -> OutputOptions:
    """What the gateway itself does with the tokens (the scheduler never sees these)."""
    return OutputOptions(
        stop=tuple(req.stop_strings()),
        include_stop_str_in_output=req.include_stop_str_in_output,
        min_tokens=req.min_tokens,
        skip_special_tokens=req.skip_special_tokens,
    )
