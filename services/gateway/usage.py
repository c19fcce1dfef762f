"""Token usage of one request, as OpenAI reports it: each prompt once, every choice's tokens."""

from __future__ import annotations

from services.gateway.generation import Choice, SeqDelta
from services.gateway.responses import Usage, make_usage


class UsageCounter:
    """Counts deltas as they stream, or whole choices. Cached tokens are read from the finished
    first choice of each prompt: its n samples share one prefill."""

    def __init__(self, prompts: list[list[int]], n: int) -> None:
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._n = n

    def add(self, output: SeqDelta | Choice) -> None:
        self.completion_tokens += len(output.token_ids)
        if output.finish_reason is not None and output.index % self._n == 0:
            self.cached_tokens += output.num_cached_tokens

    def usage(self) -> Usage:
        return make_usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
