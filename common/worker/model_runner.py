"""Runs one step's forward over the paged cache and samples: the worker's compute core."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.kv_cache import PagedKVCache
from common.models.attention import AttentionMetadata
from common.models.llama import LlamaForCausalLM
from common.plans import Fork, PromptLogprobs, RequestError
from common.sampling_params import SamplingParams, TokenLogprobs
from common.worker import micro_batches
from common.worker.cuda_graphs import DecodeGraphs
from common.worker.draft import DraftModel, rejection_sample
from common.worker.grammars import GrammarError, Grammars, Guide, mask_logits
from common.worker.prompt_logprobs import PromptChunk, prompt_logprobs, score_chunk
from common.worker.sampler import Sampler, SamplingRequest, token_logprobs
from common.worker.speculative import DraftLength, NgramProposer, SpeculativeConfig
from common.worker.step_threads import StepThreads


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
    draft_length: DraftLength = field(default_factory=DraftLength)  # speculation's record
    draft_computed: int = 0  # tokens whose KV a draft model holds (draft.py)
    noise_seed: int | None = None  # an unseeded request's, once a coupled draft samples for it

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
    spec_drafts: int = 0          # rows that verified drafts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)  # requests that failed the step


COST_SMOOTHING = 0.1  # weight of the newest step in the draft's measured cost


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, sampler: Sampler,
                 decode_graphs: DecodeGraphs | None = None, grammars: Grammars | None = None,
                 speculative: SpeculativeConfig | None = None, draft: DraftModel | None = None,
                 threads: StepThreads | None = None):
        self.model = model
        self.cache = cache
        self.sampler = sampler
        # the sampler's ops over the vocabulary on the step's threads (step_threads.py)
        self.threads = threads or StepThreads()
        self.grammars = grammars  # None: a request with a grammar fails
        self.block_size = cache.layout.block_size
        self.decode_graphs = decode_graphs  # decode-only steps replay these where they fit
        self.num_speculative_tokens = speculative.num_speculative_tokens if speculative else 0
        self.proposer = NgramProposer(speculative) \
            if speculative is not None and speculative.method == "ngram" else None
        self.draft = draft  # the draft_model method
        # one draft forward's time over the target's step time, smoothed (0 until measured)
        self.draft_cost = 0.0
        # whether this model computes logits: all but an earlier stage of a pipeline group
        self.samples = model.lm_head is not None
        # a pipeline stage's step in this many micro-batches at most (micro_batches.py)
        self.micro_batches = model.pp.size if model.pp is not None else 1

    def execute(self, scheduled: list[tuple[RequestState, int]], on_layer=None,
                lookahead: dict[str, int] | None = None) -> tuple[list[Sampled], StepStats]:
        """Computes num_tokens of each request; samples for those that reach their last token,
        and for the forks of those that sample their first (same logits, their own params).
        A decoding request given lookahead slots (request id -> slots) verifies drafts there
        and may sample several tokens (speculative.py).
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
        failed: dict[str, str] = {}
        self._draft_time = 0.0
        drafts, verified = self._propose(scheduled, lookahead or {}, failed)
        target_start = time.perf_counter()
        decodes = [(r, n) for r, n in scheduled
                   if n == 1 and r.is_decode and r.request_id not in drafts]
        verifies = [(r, 1 + len(drafts[r.request_id])) for r, _ in scheduled
                    if r.request_id in drafts]
        prefills = [(r, n) for r, n in scheduled
                    if not (n == 1 and r.is_decode) and r.request_id not in drafts]
        ordered = decodes + verifies + prefills
        chunks = verifies + prefills  # attend as prefill chunks do: causal over their tokens
        ids: list[int] = []
        positions: list[int] = []
        for r, n in ordered:
            start = r.num_computed_tokens
            ids.extend(r.token_ids[start:start + n])
            ids.extend(drafts.get(r.request_id, ()))
            positions.extend(range(start, start + n))
        device = self.cache.tensor.device
        graphs = self.decode_graphs
        decoding = [(r.num_computed_tokens, r.block_ids) for r, _ in decodes]
        if (graphs is not None and not chunks and on_layer is None
                and graphs.fits(len(decodes), max(len(b) for _, b in decoding))):
            hidden = graphs.run(ids, decoding)
        else:
            hidden = self._forward(
                torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device), decoding,
                [(r.num_computed_tokens, n, r.block_ids) for r, n in chunks], on_layer)

        stats = StepStats(decode_tokens=sum(r.num_computed_tokens >= r.num_prompt_tokens
                                            for r, _ in decodes))
        rows: list[_Row] = []
        scoring: list[PromptChunk] = []
        offset = 0
        for r, n in ordered:
            row_drafts = drafts.get(r.request_id)
            if row_drafts is not None:  # the request's last token and its drafts
                rows.append(_Row(r, list(range(offset, offset + n)), row_drafts))
                offset += n
                continue
            stats.prompt_tokens += max(0, min(r.num_computed_tokens + n, r.num_prompt_tokens)
                                       - r.num_computed_tokens)
            if r.scores_prompt and (chunk := score_chunk(
                    r.request_id, offset, r.num_computed_tokens, n, r.token_ids,
                    r.num_prompt_tokens, r.sampling.prompt_logprobs)) is not None:
                scoring.append(chunk)
            r.num_computed_tokens += n
            offset += n
            if r.num_computed_tokens == len(r.token_ids):
                rows.append(_Row(r, [offset - 1], []))
        if not self.samples:  # an earlier pipeline stage: the last one samples (pipeline.py)
            stats.errors = [RequestError(rid, error) for rid, error in failed.items()]
            return [], stats
        if scoring:
            with self.threads.for_torch():
                stats.prompt_logprobs = prompt_logprobs(
                    hidden, self.model.compute_logits, self.sampler.vocab_size, scoring)
        if not rows:
            stats.errors = [RequestError(rid, error) for rid, error in failed.items()]
            return [], stats
        logits_idx = [i for row in rows for i in row.hidden_rows]
        logits = self.model.compute_logits(hidden[torch.tensor(logits_idx, device=device)])
        # sampler rows: one per position a request samples at, then its forks' first tokens
        batch: list[SamplingRequest] = []
        guides: list[Guide | None] = []
        ahead: list[list[int]] = []
        owners: list[str] = []
        forks: list[tuple[Fork, int]] = []  # (fork, its leader's logits row)
        first_row = 0
        for row in rows:
            r = row.request
            guide = self._guide(r, failed)
            for j in range(len(row.hidden_rows)):
                batch.append(self._sampling_row(r, r.sampling, row.drafts[:j]))
                guides.append(guide)
                ahead.append(row.drafts[:j])
                owners.append(r.request_id)
            if r.forks and len(r.token_ids) == r.num_prompt_tokens:  # its first token
                forks.extend((f, first_row) for f in r.forks)
            r.forks = []
            first_row += len(row.hidden_rows)
        row_of = list(range(len(batch))) + [i for _, i in forks]
        for f, i in forks:  # a fork's first token: its leader's grammar, at the same state
            batch.append(self._sampling_row(rows_at(rows, i).request, f.sampling, []))
            guides.append(guides[i])
            ahead.append([])
            owners.append(owners[i])
        if forks:
            logits = logits[torch.tensor(row_of, device=device)]
        if any(guides):
            mask_logits(logits, guides, self.sampler.vocab_size, ahead)
        # rows whose drafts a draft model proposed keep tokens by rejection sampling; the rest
        # sample here
        plain = [i for i, rid in enumerate(owners) if rid not in verified]
        tokens_of: list[int] = [-1] * len(batch)
        logprobs_of: list[TokenLogprobs | None] = [None] * len(batch)
        if plain:
            sub = logits if len(plain) == len(batch) else \
                logits[torch.tensor(plain, device=device)]
            with self.threads.for_torch():
                out = self.sampler(sub, [batch[i] for i in plain])
            for i, token, lp in zip(plain, out.token_ids, out.logprobs):
                tokens_of[i], logprobs_of[i] = token, lp
        sampled: list[Sampled] = []
        first_row = 0
        for row in rows:
            r = row.request
            width = len(row.hidden_rows)
            start, first_row = first_row, first_row + width
            if r.request_id in failed:
                continue
            if r.request_id in verified:
                all_drafts, q = verified[r.request_id]
                with self.threads.for_torch():
                    tokens, row_logprobs = self._rejection_sample(
                        logits[start:start + width], batch[start:start + width], all_drafts, q)
                kept = self._accept(r, all_drafts, tokens, stats)
            else:
                tokens = tokens_of[start:start + width]
                row_logprobs = logprobs_of[start:start + width]
                kept = self._accept(r, row.drafts, tokens, stats)
            r.token_ids.extend(tokens[:kept])
            if row.drafts:
                r.num_computed_tokens = len(r.token_ids) - 1
                stats.decode_tokens += kept
            # a draft model's KV holds what it computed of the tokens kept, not what it drafted
            # past them (nor drafts a grammar cut)
            r.draft_computed = min(r.draft_computed, r.num_computed_tokens)
            guide = guides[start]
            try:
                if guide is not None:
                    guide.follow(r.token_ids[r.num_prompt_tokens:])
            except GrammarError as e:
                failed[r.request_id] = str(e)
                continue
            sampled.extend(Sampled(r.request_id, t, lp)
                           for t, lp in zip(tokens[:kept], row_logprobs[:kept]))
        out_tokens, out_logprobs = tokens_of[first_row:], logprobs_of[first_row:]
        for (f, i), token, logprobs in zip(forks, out_tokens, out_logprobs):
            if rows_at(rows, i).request.request_id not in failed:
                sampled.append(Sampled(f.request_id, token, logprobs))
        stats.errors = [RequestError(rid, error) for rid, error in failed.items()]
        if self._draft_time:
            ratio = self._draft_time / (time.perf_counter() - target_start)
            self.draft_cost = ratio if not self.draft_cost else \
                COST_SMOOTHING * ratio + (1 - COST_SMOOTHING) * self.draft_cost
        return sampled, stats

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor,
                 decodes: list[tuple[int, list[int]]], chunks: list[tuple[int, int, list[int]]],
                 on_layer) -> torch.Tensor:
        """The step's hidden states; a pipeline stage's in micro-batches (micro_batches.py),
        layer-wise KV sends starting with the last one (a layer's KV is whole only then)."""
        pp = self.model.pp
        parts = micro_batches.split(decodes, chunks, self.micro_batches) \
            if pp is not None else []
        if len(parts) < 2:
            parts = [micro_batches.MicroBatch(0, len(ids), decodes, chunks)]
        out = []
        for j, part in enumerate(parts):
            meta = AttentionMetadata.build(part.decodes, part.chunks, self.block_size)
            if ids.device.type != "cpu":
                meta = meta.to(ids.device)
            out.append(self.model(ids[part.start:part.end], positions[part.start:part.end],
                                  self.cache.layers, meta,
                                  on_layer if j == len(parts) - 1 else None))
        if pp is not None:
            pp.flush()  # the hidden states this stage sent have left
        return out[0] if len(out) == 1 else torch.cat(out)

    def _cost_for(self, r: RequestState) -> float:
        """The draft cost r's draft length weighs: none for a seeded request under rejection
        sampling, whose tokens depend on which positions had drafts (draft.py): a length that
        followed this host's measured timing would change its output from run to run."""
        if r.sampling.seed is not None and self.draft is not None and not self.draft.coupled:
            return 0.0
        return self.draft_cost

    def _propose(self, scheduled: list[tuple[RequestState, int]], lookahead: dict[str, int],
                 failed: dict[str, str]
                 ) -> tuple[dict[str, list[int]], dict[str, tuple[list[int], torch.Tensor]]]:
        """Draft tokens of the decoding requests given lookahead slots, within the slots their
        blocks hold, their max_tokens and what their grammar allows; only those with any. With a
        draft model also, per request, its k + 1 drafts and their distributions (the first k go
        through the target)."""
        if (self.proposer is None and self.draft is None) or not lookahead:
            return {}, {}
        out = {}
        wanted = []
        for r, n in scheduled:
            slots = lookahead.get(r.request_id, 0)
            if not slots or n != 1 or not r.is_decode or len(r.token_ids) <= r.num_prompt_tokens:
                continue
            room = len(r.block_ids) * self.block_size - len(r.token_ids)
            left = r.sampling.max_tokens - (len(r.token_ids) - r.num_prompt_tokens) - 1
            k = min(self.num_speculative_tokens, slots, room, left)
            k = r.draft_length.drafts(k, self._cost_for(r)) if k > 0 else 0
            if k < 1:
                continue
            if self.draft is not None:
                if self.draft.coupled:
                    if r.sampling.seed is None and r.noise_seed is None:
                        r.noise_seed = self.sampler.new_seed()  # the draft shares its noise
                    wanted.append((r, k))
                elif not r.sampling.grammar:  # rejection: guided requests decode plainly
                    wanted.append((r, k))
                continue
            assert self.proposer is not None
            out[r.request_id] = self.proposer.propose(r.token_ids, k)
        if wanted:
            assert self.draft is not None
            start = time.perf_counter()
            verified = self.draft.propose(
                wanted, lambda r, prefix: self._sampling_row(r, r.sampling, prefix))
            self._draft_time = (time.perf_counter() - start) / (1 + max(k for _, k in wanted))
            if not self.draft.coupled:
                return {rid: d[:-1] for rid, (d, _) in verified.items()}, verified
            out.update((rid, d) for rid, (d, _) in verified.items())
        by_id = {r.request_id: r for r, _ in scheduled}
        for rid, drafts in list(out.items()):  # only what a request's grammar allows
            r = by_id[rid]
            if drafts and r.sampling.grammar:
                guide = self._guide(r, failed)
                drafts = drafts[:guide.valid_prefix(drafts)] if guide is not None else []
            if drafts:
                out[rid] = drafts
            else:
                del out[rid]
        return out, {}

    def _rejection_sample(self, logits: torch.Tensor, rows: list[SamplingRequest],
                          drafts: list[int], q: torch.Tensor
                          ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """A draft model's drafts through the target's logits at their positions: the tokens
        kept (draft.py) and their logprobs (from the raw logits, as the sampler's)."""
        p = self.sampler.distribution(logits, rows)
        tokens = rejection_sample(self.sampler, p, q, drafts, rows)
        k = rows[0].params.logprobs
        if k < 0:
            return tokens, [None] * len(tokens)
        raw = logits[:len(tokens), :self.sampler.vocab_size].float()
        return tokens, list(token_logprobs(raw, torch.tensor(tokens, device=raw.device),
                                           [k] * len(tokens)))

    @staticmethod
    def _accept(r: RequestState, drafts: list[int], tokens: list[int], stats: StepStats) -> int:
        """How many of the tokens sampled at a row's positions it keeps: those while each equals
        the draft it verifies, and one more, cut after a token that stops the request."""
        accepted = 0
        while accepted < len(drafts) and tokens[accepted] == drafts[accepted]:
            accepted += 1
        if drafts:
            r.draft_length.observe(len(drafts), accepted)
            stats.spec_drafts += 1
            stats.spec_draft_tokens += len(drafts)
            stats.spec_accepted_tokens += accepted
            stats.spec_accepted_per_pos += [0] * (len(drafts) - len(stats.spec_accepted_per_pos))
            for j in range(accepted):
                stats.spec_accepted_per_pos[j] += 1
        kept = min(accepted + 1, len(tokens))
        num_output = len(r.token_ids) - r.num_prompt_tokens
        for i, token in enumerate(tokens[:kept - 1]):
            if stops(r.sampling, r.eos_token_ids, token, num_output + i + 1):
                return i + 1
        return kept

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
    def _sampling_row(r: RequestState, params: SamplingParams,
                      drafts: list[int]) -> SamplingRequest:
        """The row sampling r's next token, after `drafts` taken as accepted (r's noise seed for
        its own params, not a fork's)."""
        return SamplingRequest(params=params, prompt_token_ids=r.token_ids[:r.num_prompt_tokens],
                               output_token_ids=r.token_ids[r.num_prompt_tokens:] + drafts,
                               eos_token_ids=r.eos_token_ids,
                               position=len(r.token_ids) + len(drafts),
                               noise_seed=r.noise_seed if params is r.sampling else None)


@dataclass
class _Row:
    """A request sampling in this step: at its last computed position, or (verifying drafts)
    at its last token's and each draft's."""
    request: RequestState
    hidden_rows: list[int]
    drafts: list[int]


def rows_at(rows: list[_Row], logits_row: int) -> _Row:
    """The row whose sampling positions include logits_row."""
    for row in rows:
        if logits_row < len(row.hidden_rows):
            return row
        logits_row -= len(row.hidden_rows)
    raise IndexError(logits_row)


def stops(params: SamplingParams, eos_token_ids: list[int], token: int, num_output: int) -> bool:
    """Whether token, the request's num_output-th output token, ends it (Request.check_stop's
    token rules; the scheduler decides, this only spares computing past it)."""
    if num_output >= params.max_tokens:
        return True
    if num_output < params.min_tokens:
        return False
    return (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids
