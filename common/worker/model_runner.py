"""Runs one step's forward over the paged cache and samples: the worker's compute core."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.kv_cache import PagedKVCache
from common.models.attention import AttentionMetadata
from common.models.llama import LlamaForCausalLM
from common.plans import Fork, PromptLogprobs, RequestError
from common.sampling_params import SamplingParams, TokenLogprobs
from common.worker.cuda_graphs import DecodeGraphs
from common.worker.grammars import GrammarError, Grammars, Guide, mask_logits
from common.worker.prompt_logprobs import PromptChunk, prompt_logprobs, score_chunk
from common.worker.sampler import Sampler, SamplingRequest


@dataclass
class RequestState:
    """A request as one worker holds it.

    token_ids:  [0, num_computed_tokens)  KV in block_ids
                [num_computed_tokens, len(token_ids))  still to compute
    """
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: list[int]
    forks: list[Fork] = field(default_factory=list)  # sampled with the first token
    guide: Guide | None = None  # its grammar's matcher, once it samples under one

    @property
    def is_decode(self) -> bool:
        return self.num_computed_tokens == len(self.token_ids) - 1

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill reports prompt logprobs: asked for, and not a recompute (a
        request with output tokens reported them the first time its prompt ran)."""
        return self.sampling.prompt_logprobs >= 0 and len(self.token_ids) == self.num_prompt_tokens


@dataclass
class Sampled:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass
class StepStats:
    prompt_tokens: int = 0
    decode_tokens: int = 0
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)  # requests that failed the step


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, sampler: Sampler,
                 decode_graphs: DecodeGraphs | None = None, grammars: Grammars | None = None):
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.grammars = grammars  # None: a request with a grammar fails
        self.block_size = cache.layout.block_size
        self.decode_graphs = decode_graphs  # decode-only steps replay these where they fit

    def execute(self, scheduled: list[tuple[RequestState, int]],
                on_layer=None) -> tuple[list[Sampled], StepStats]:
        """Computes num_tokens of each request; samples for those that reach their last token,
        and for the forks of those that sample their first (same logits, their own params).
        Prefill chunks of requests asking for prompt logprobs score their prompt tokens
        (stats.prompt_logprobs). Requests with a grammar sample what it allows; one that cannot
        (its grammar does not compile, or its output left it) fails (stats.errors)."""
        for req, n in scheduled:
            assert 0 < n <= len(req.token_ids) - req.num_computed_tokens, (
                f"{req.request_id}: {n} tokens scheduled, "
                f"{len(req.token_ids) - req.num_computed_tokens} left to compute")
            need = -(-(req.num_computed_tokens + n) // self.block_size)
            assert len(req.block_ids) >= need, (
                f"{req.request_id}: {len(req.block_ids)} blocks for {need} needed")
        decodes = [(r, n) for r, n in scheduled if n == 1 and r.is_decode]
        prefills = [(r, n) for r, n in scheduled if not (n == 1 and r.is_decode)]
        ordered = decodes + prefills
        ids: list[int] = []
        positions: list[int] = []
        for r, n in ordered:
            start = r.num_computed_tokens
            ids.extend(r.token_ids[start:start + n])
            positions.extend(range(start, start + n))
        device = self.cache.tensor.device
        graphs = self.decode_graphs
        decoding = [(r.num_computed_tokens, r.block_ids) for r, _ in decodes]
        if (graphs is not None and not prefills and on_layer is None
                and graphs.fits(len(decodes), max(len(b) for _, b in decoding))):
            hidden = graphs.run(ids, decoding)
        else:
            meta = AttentionMetadata.build(
                decoding, [(r.num_computed_tokens, n, r.block_ids) for r, n in prefills],
                self.block_size)
            if device.type != "cpu":
                meta = meta.to(device)
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=device),
                                torch.tensor(positions, dtype=torch.long, device=device),
                                self.cache.layers, meta, on_layer)

        stats = StepStats(decode_tokens=sum(r.num_computed_tokens >= r.num_prompt_tokens
                                            for r, _ in decodes))
        rows, last_token_idx = [], []
        scoring: list[PromptChunk] = []
        offset = 0
        for r, n in ordered:
            stats.prompt_tokens += max(0, min(r.num_computed_tokens + n, r.num_prompt_tokens)
                                       - r.num_computed_tokens)
            if r.scores_prompt and (chunk := score_chunk(
                    r.request_id, offset, r.num_computed_tokens, n, r.token_ids,
                    r.num_prompt_tokens, r.sampling.prompt_logprobs)) is not None:
                scoring.append(chunk)
            r.num_computed_tokens += n
            offset += n
            if r.num_computed_tokens == len(r.token_ids):
                rows.append(r)
                last_token_idx.append(offset - 1)
        if scoring:
            stats.prompt_logprobs = prompt_logprobs(
                hidden, self.model.compute_logits, self.sampler.vocab_size, scoring)
        if not rows:
            return [], stats
        logits = self.model.compute_logits(hidden[torch.tensor(last_token_idx, device=device)])
        batch = [self._sampling_row(r, r.sampling) for r in rows]
        failed: dict[str, str] = {}
        guides = [self._guide(r, failed) for r in rows]
        row_of = list(range(len(rows)))  # logits row of each sampled row
        forks = []
        for i, r in enumerate(rows):
            if r.forks and len(r.token_ids) == r.num_prompt_tokens:  # its first token
                forks.extend(r.forks)
                batch.extend(self._sampling_row(r, f.sampling) for f in r.forks)
                row_of.extend([i] * len(r.forks))
            r.forks = []
        if forks:
            logits = logits[torch.tensor(row_of, device=device)]
        if any(guides):  # a fork's first token: its leader's grammar, at the same (first) state
            mask_logits(logits, [guides[i] for i in row_of], self.sampler.vocab_size)
        out = self.sampler(logits, batch)
        sampled = []
        for r, guide, token, logprobs in zip(rows, guides, out.token_ids, out.logprobs):
            if r.request_id in failed:
                continue
            r.token_ids.append(token)
            try:
                if guide is not None:
                    guide.follow(r.token_ids[r.num_prompt_tokens:])
            except GrammarError as e:
                failed[r.request_id] = str(e)
                continue
            sampled.append(Sampled(r.request_id, token, logprobs))
        for f, i, token, logprobs in zip(forks, row_of[len(rows):], out.token_ids[len(rows):],
                                         out.logprobs[len(rows):]):
            if rows[i].request_id not in failed:
                sampled.append(Sampled(f.request_id, token, logprobs))
        stats.errors = [RequestError(rid, error) for rid, error in failed.items()]
        return sampled, stats

    def _guide(self, r: RequestState, failed: dict[str, str]) -> Guide | None:
        """r's matcher, caught up with its output tokens; None without a grammar, or when it
        fails (then in `failed`)."""
        if not r.sampling.grammar:
            return None
        try:
            if self.grammars is None:
                raise GrammarError("this worker does not sample under grammars")
            if r.guide is None:
                r.guide = Guide(self.grammars.matcher(r.sampling.grammar, r.eos_token_ids))
            r.guide.follow(r.token_ids[r.num_prompt_tokens:])
        except GrammarError as e:
            failed[r.request_id] = str(e)
            return None
        return r.guide

    @staticmethod
    def _sampling_row(r: RequestState, params: SamplingParams) -> SamplingRequest:
        return SamplingRequest(params=params, prompt_token_ids=r.token_ids[:r.num_prompt_tokens],
                               output_token_ids=r.token_ids[r.num_prompt_tokens:],
                               eos_token_ids=r.eos_token_ids, position=len(r.token_ids))
