"""Token usage of one request, as OpenAI reports it: each prompt once, every choice's tokens;
and, for vLLM's continuous_usage_stats, one choice's usage so far."""

from __future__ import annotations

from collections import Counter

from services.gateway.generation import Choice, SeqDelta
from services.gateway.responses import Usage, make_usage


class UsageCounter:
    """Counts deltas as they stream, or whole choices. Cached tokens are read from the finished
    first choice of each prompt: its n samples share one prefill. Choice i belongs to prompt
    i // n."""

    def __init__(self, prompts: list[list[int]], n: int) -> None:
        self.prompt_lens = [len(p) for p in prompts]
        self.prompt_tokens = sum(self.prompt_lens)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._n = n
        self._per_choice: Counter[int] = Counter()

    def add(self, output: SeqDelta | Choice) -> None:
        self.completion_tokens += len(output.token_ids)
        self._per_choice[output.index] += len(output.token_ids)
        if output.finish_reason is not None and output.index % self._n == 0:
            self.cached_tokens += output.num_cached_tokens

    def usage(self) -> Usage:
        return make_usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def of_choice(self, index: int) -> Usage:
        """Choice `index`'s prompt and its tokens so far, as vLLM puts on each streamed chunk
        (no prompt_tokens_details there)."""
        prompt, completion = self.prompt_lens[index // self._n], self._per_choice[index]
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)
