"""Draft-model speculation: a smaller checkpoint of the same vocabulary proposes each request's
drafts, and rejection sampling keeps what the target's distribution allows.

The draft keeps its own paged KV cache under the block ids the scheduler gives the request (the
lookahead slots included). A request's draft KV is valid up to `draft_computed` tokens: a request
new to this worker (its prompt prefilled elsewhere, or found in the prefix cache) starts at 0,
and the draft computes what it lacks in the first forward of each proposal, with the request's
last token:

    forward 1       tokens [draft_computed, len)        -> q_1, d_1
    forward i > 1   d_{i-1} at position len - 2 + i       -> q_i, d_i        (i = 2 .. k + 1)

d_1 .. d_k go through the target with the last token (k + 1 positions, p_1 .. p_{k+1}); d_{k+1}
is only verified. Position j keeps d_j when u_j < p_j(d_j) / q_j(d_j), else draws from
max(0, p_j - q_j) renormalized and ends the step: every position has a draft, so the token at a
position depends only on the request's history, its seed and that position (draft, acceptance
and residual draws use their own salts), never on where a step's run of drafts began: a seeded
request resumed elsewhere gives the same tokens.
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
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, sampler: Sampler):
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.block_size = cache.layout.block_size

    def propose(self, requests: list, make_row: Callable[[Any, list[int]], SamplingRequest]
                ) -> dict[str, tuple[list[int], torch.Tensor]]:
        """requests: (RequestState, k) of decoding requests, k >= 1 drafts each; make_row(r,
        drafts so far): the request's sampling row after them. Returns request id -> (k + 1
        drafts, q [k + 1, vocab]), and advances each request's draft_computed."""
        device = self.cache.tensor.device
        out: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        # forward 1: what the draft lacks of each sequence, its last token included
        chunks = [(r.draft_computed, len(r.token_ids) - r.draft_computed, r.block_ids)
                  for r, _ in requests]
        ids = [t for r, _ in requests for t in r.token_ids[r.draft_computed:]]
        positions = [p for r, _ in requests for p in range(r.draft_computed, len(r.token_ids))]
        last = torch.tensor([n for _, n, _ in chunks]).cumsum(0) - 1
        hidden = self._forward(ids, positions, AttentionMetadata.build([], chunks,
                                                                        self.block_size))
        self._draw(requests, make_row, self.model.compute_logits(hidden[last.to(device)]), out)
        for r, _ in requests:
            r.draft_computed = len(r.token_ids)
        # forwards 2 .. k + 1: one draft each, of the requests still drafting
        for i in range(1, max(k for _, k in requests) + 1):
            live = [(r, k) for r, k in requests if k >= i]
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
        tokens = self.sampler.race(q, batch, DRAFT_SALT).tolist()
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
