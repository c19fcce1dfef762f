"""Draft-model speculation: a smaller checkpoint of the same vocabulary proposes each request's
drafts; the target keeps what its own distribution allows, by one of two acceptance methods.

The draft keeps its own paged KV cache under the block ids the scheduler gives the request (the
lookahead slots included). A request's draft KV is valid up to `draft_computed` tokens: a request
new to this worker (its prompt prefilled elsewhere, or found in the prefix cache) starts at 0,
and the draft computes what it lacks in the first forward of each proposal, with the request's
last token:

    forward 1       tokens [draft_computed, len)        -> q_1, d_1
    forward i > 1   d_{i-1} at position len - 2 + i       -> q_i, d_i        (i = 2 .. k + 1)

d_1 .. d_k go through the target with the last token (k + 1 positions, p_1 .. p_{k+1}).

coupled (the default): the draft draws d_j = argmax(q_j / E_j) with the very Exp(1) noise E_j the
    target's sampler uses at that position (the request's seed, or a noise seed of its own, and
    the position), and the step keeps drafts while each equals the target's own draw
    argmax(p_j / E_j), then that draw: every token is what plain decoding samples, so output
    never changes with speculation (greedy, seeded, across preemption or a worker's loss). A
    draft is kept with probability P(argmax(p / E) = argmax(q / E)): 1 where q = p, a little
    below the rejection sampler's sum min(p, q) otherwise.
rejection_sampler: a (k + 1)-th draft is drawn too, and only verified. Position j keeps d_j when
    u_j < p_j(d_j) / q_j(d_j), else draws from max(0, p_j - q_j) renormalized and ends the step
    (the most a draft can be kept with). Each draw is keyed by (seed, position), so seeded
    requests repeat run after run; but a position sampled without a draft (the first token, a
    step without drafts, a recompute after preemption) draws otherwise than it would with one,
    so after a preemption or a worker's loss a seeded request's later tokens may differ. For
    the same reason a seeded request's draft length follows its acceptance record alone, not
    the draft's measured cost (timing, which differs from run to run).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from common.kv_cache import PagedKVCache
from common.models.attention import AttentionMetadata
from common.models.llama import LlamaForCausalLM
from common.worker.sampler import Sampler, SamplingRequest

DRAFT_SALT = 0x5EED_D4AF7
ACCEPT_SALT = 0x5EED_ACCE
RESIDUAL_SALT = 0x5EED_4E51


class DraftModel:
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, sampler: Sampler,
                 coupled: bool = True):
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.block_size = cache.layout.block_size
        self.coupled = coupled  # else: rejection sampling (module docstring)

    def propose(self, requests: list, make_row: Callable[[Any, list[int]], SamplingRequest]
                ) -> dict[str, tuple[list[int], torch.Tensor]]:
        """requests: (RequestState, k) of decoding requests, k >= 1 drafts each; make_row(r,
        drafts so far): the request's sampling row after them. Returns request id -> (its
        drafts, q [drafts, vocab]): k coupled, k + 1 for rejection sampling; and advances each
        request's draft_computed."""
        device = self.cache.tensor.device
        out: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        # forward 1: what the draft lacks of each sequence, its last token included
        chunks = [(r.draft_computed, len(r.token_ids) - r.draft_computed, r.block_ids)
                  for r, _ in requests]
        assert all(n > 0 for _, n, _ in chunks), "a draft's KV ahead of its request's tokens"
        ids = [t for r, _ in requests for t in r.token_ids[r.draft_computed:]]
        positions = [p for r, _ in requests for p in range(r.draft_computed, len(r.token_ids))]
        last = torch.tensor([n for _, n, _ in chunks]).cumsum(0) - 1
        hidden = self._forward(ids, positions, AttentionMetadata.build([], chunks,
                                                                        self.block_size))
        self._draw(requests, make_row, self.model.compute_logits(hidden[last.to(device)]), out)
        for r, _ in requests:
            r.draft_computed = len(r.token_ids)
        # forwards 2 .. k (+ 1): one draft each, of the requests still drafting
        extra = 0 if self.coupled else 1
        for i in range(1, max(k for _, k in requests) + extra):
            live = [(r, k) for r, k in requests if k + extra > i]
            decodes = [(r.draft_computed, r.block_ids) for r, _ in live]
            hidden = self._forward([out[r.request_id][0][-1] for r, _ in live],
                                   [r.draft_computed for r, _ in live],
                                   AttentionMetadata.build(decodes, [], self.block_size))
            self._draw(live, make_row, self.model.compute_logits(hidden), out)
            for r, _ in live:
                r.draft_computed += 1
        return {rid: (drafts, torch.stack(qs)) for rid, (drafts, qs) in out.items()}

    def _forward(self, ids: list[int], positions: list[int], meta: AttentionMetadata):
        device = self.cache.tensor.device
        if device.type != "cpu":
            meta = meta.to(device)
        return self.model(torch.tensor(ids, dtype=torch.long, device=device),
                          torch.tensor(positions, dtype=torch.long, device=device),
                          self.cache.layers, meta)

    def _draw(self, requests: list, make_row: Callable[[Any, list[int]], SamplingRequest],
              logits: torch.Tensor, out: dict) -> None:
        """The next draft of each request: q under the request's own pipeline, after the
        drafts it has."""
        batch = [make_row(r, out[r.request_id][0] if r.request_id in out else [])
                 for r, _ in requests]
        q = self.sampler.distribution(logits, batch)
        # coupled: the target's own race at each position; else a draw of the draft's own
        tokens = self.sampler.draw(logits, batch, 0 if self.coupled else DRAFT_SALT).tolist()
        for (r, _), token, q_row in zip(requests, tokens, q):
            drafts, qs = out.setdefault(r.request_id, ([], []))
            drafts.append(token)
            qs.append(q_row)


def rejection_sample(sampler: Sampler, p: torch.Tensor, q: torch.Tensor, drafts: list[int],
                     rows: list[SamplingRequest]) -> list[int]:
    """One request's kept tokens: p, q [m + 1, V] (target and draft distributions at its m + 1
    positions), drafts its m + 1 drafts, rows its sampling rows. Keeps d_j while u_j <
    p_j(d_j) / q_j(d_j); the first rejected position draws from max(0, p_j - q_j) instead."""
    idx = torch.tensor(drafts, device=p.device).unsqueeze(1)
    p_d = p.gather(1, idx).squeeze(1).double()
    q_d = q.gather(1, idx).squeeze(1).double()
    u = sampler.uniform(rows, ACCEPT_SALT, p.device)
    accepted = (u * q_d < p_d).tolist()
    kept: list[int] = []
    for j, ok in enumerate(accepted):
        if ok:
            kept.append(drafts[j])
            continue
        residual = (p[j] - q[j]).clamp_min(0)
        if residual.sum() <= 0:  # p == q there: the draft could not have been refused
            residual = p[j]
        kept.append(int(sampler.race(residual.unsqueeze(0), [rows[j]], RESIDUAL_SALT)[0]))
        break
    return kept
