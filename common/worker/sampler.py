"""Batched token sampler for one model step, vLLM semantics.

Pipeline, all vectorized over the batch:

    raw logits --+--> log_softmax --> logprobs (sampled token + top k, from RAW logits)
                 |
                 +--> logit_bias --> penalties (repetition, frequency, presence) --> min_tokens mask
                        --> greedy rows: argmax
                        --> random rows: / temperature --> top_k, top_p, min_p
                              (thresholds from one topk) --> softmax
                              --> argmax(probs / Exp(1) noise)
                                  (the CPU kernel exponentiates in passing, no softmax written)

The Exp(1) noise (-log U) of a row with a seed is a function of (seed, position) alone (its
own generator, or on the CPU a hash in the fused race kernel of csrc/sampling.cpp), so a request
resumed on another worker at the same position samples the same token whatever else shares the
batch. Rows without a seed take theirs from the sampler's generator.
"""

from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams, TokenLogprobs, TopLogprob

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them overflows.
SAMPLING_EPS = 1e-5

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRequest:
    """One row of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far, before this step
    eos_token_ids: list[int]
    position: int  # of the token being sampled (= len(prompt) + len(output)); seeds the RNG
    noise_seed: int | None = None  # an unseeded row's own seed, where it has one (a draft
                                   # model's drafts share its noise: draft.py)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs < 0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, position: int) -> int:
    """64-bit seed of a seeded row's generator at one position: a function of both, nothing else."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))


def _repetition_penalty(p: SamplingParams) -> float:
    return p.repetition_penalty or 1.0  # 0 (protobuf's unset) means none


def _flat_index(id_lists: list[list[int]], rows: list[int], vocab: int,
                device: torch.device) -> torch.Tensor:
    """Flat indices row * vocab + token into a [B, vocab] tensor, one per listed token."""
    ids = torch.tensor([t for ids in id_lists for t in ids], dtype=torch.long, device=device)
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long, device=device)
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long, device=device), lengths)
    return row_idx * vocab + ids


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRequest]) -> torch.Tensor:
    """Adds each row's logit_bias to its logits (OpenAI's, applied before penalties as vLLM v1
    does); returns a new tensor, or logits itself when no row has a bias. Ids outside the
    vocabulary are ignored: the gateway refuses them, and one stray id from another client must
    not fail the whole batch."""
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    pairs = [[(t, b) for t, b in rows[i].params.logit_bias if 0 <= t < vocab] for i in biased]
    flat = _flat_index([[t for t, _ in p] for p in pairs], biased, vocab, logits.device)
    bias = torch.tensor([b for p in pairs for _, b in p], dtype=logits.dtype,
                        device=logits.device)
    logits.view(-1).index_add_(0, flat, bias)
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRequest]) -> torch.Tensor:
    """Repetition, frequency and presence penalties as vLLM applies them; returns a new tensor,
    or logits itself when no row has a penalty.

    repetition (tokens in prompt OR output): logit > 0 -> logit / r, else logit * r
    frequency: logit -= f * count(token in output); presence: logit -= p * (token in output)
    """
    num_rows, vocab = logits.shape  # [B, V]
    device = logits.device
    rep_rows = [i for i, r in enumerate(rows) if _repetition_penalty(r.params) != 1.0]
    out_rows = [i for i, r in enumerate(rows)
                if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
    rep_rows_with_output = [i for i in rep_rows if rows[i].output_token_ids]
    if not rep_rows and not out_rows:
        return logits

    counts = torch.zeros(num_rows * vocab, dtype=torch.int32, device=device)
    count_rows = sorted(set(out_rows) | set(rep_rows_with_output))
    if count_rows:
        outputs = [rows[i].output_token_ids for i in count_rows]
        flat = _flat_index(outputs, count_rows, vocab, device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    counts = counts.view(num_rows, vocab)  # [B, V]
    output_mask = counts > 0  # [B, V]

    if rep_rows:
        seen = torch.zeros(num_rows * vocab, dtype=torch.bool, device=device)
        flat = _flat_index([rows[i].prompt_token_ids for i in rep_rows], rep_rows, vocab, device)
        seen[flat] = True
        seen = seen.view(num_rows, vocab) | output_mask  # [B, V]
        rep = torch.tensor([_repetition_penalty(r.params) for r in rows],
                           dtype=logits.dtype, device=device).unsqueeze(1)  # [B, 1]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    if out_rows:
        freq = torch.tensor([r.params.frequency_penalty for r in rows],
                            dtype=logits.dtype, device=device).unsqueeze(1)  # [B, 1]
        pres = torch.tensor([r.params.presence_penalty for r in rows],
                            dtype=logits.dtype, device=device).unsqueeze(1)  # [B, 1]
        logits = logits - freq * counts.to(logits.dtype) - pres * output_mask.to(logits.dtype)
    return logits


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRequest]) -> torch.Tensor:
    """Below min_tokens, stop ids and eos ids (even with ignore_eos, as vLLM) cannot be sampled.

    Masks in place and returns logits.
    """
    masked = [i for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens]
    if not masked:
        return logits
    id_lists = [list(rows[i].params.stop_token_ids) + list(rows[i].eos_token_ids) for i in masked]
    flat = _flat_index(id_lists, masked, logits.shape[1], logits.device)
    vocab = logits.shape[1]
    logits[flat // vocab, flat % vocab] = float("-inf")
    return logits


# top_p looks for each row's nucleus among its most likely tokens first (one topk, no sort), and
# a top_k up to MAX_CANDIDATES is cut from the same topk; a row past either (a flat distribution,
# a larger top_k) is sorted whole
TOP_P_CANDIDATES = 256
MAX_CANDIDATES = 1024


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                            top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf what top_k, then top_p, then min_p remove; returns a new tensor."""
    return cut_below(logits, top_k_top_p_min_p_cut(logits, top_k, top_p, min_p))


def cut_below(logits: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with each row's values below its cut [B] masked to -inf (a new tensor)."""
    return logits.masked_fill(logits < cut.unsqueeze(1), float("-inf"))


def top_k_top_p_min_p_cut(logits: torch.Tensor, top_k: torch.Tensor | None,
                          top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """[B] each row's cut: the smallest logit that top_k, then top_p, then min_p keep (-inf
    where none cuts); the tokens below it are what they remove.

    top_k: [B] long in [1, V]; top_p: [B] float in (0, 1]; min_p: [B] float in [0, 1]; None skips.
    At least the most likely token always survives. Each cut is a threshold on the row's logits
    (a token tied with the last one kept stays), so one masked fill applies all three. The
    candidates for top_k and top_p come from one topk: a sort of 64 x 32000 floats costs a CPU
    core ~150 ms, a topk of 256 ~6 ms.
    """
    rows, vocab = logits.shape
    cut = torch.full((rows,), float("-inf"), dtype=logits.dtype, device=logits.device)  # [B]
    if top_k is not None or top_p is not None:
        k = top_k if top_k is not None else torch.full((rows,), vocab, device=logits.device)
        bounded = k[k < vocab]  # rows that have a top_k
        want = min(vocab, max(TOP_P_CANDIDATES if top_p is not None else 1,
                              min(int(bounded.max()), MAX_CANDIDATES) if len(bounded) else 1))
        values, _ = logits.topk(want, dim=-1)  # [B, want], most likely first
        kept = torch.arange(want, device=logits.device) < k.unsqueeze(1)  # [B, want]
        wide = (k > want) & (k < vocab)  # a top_k past the candidates
        uncut = k >= vocab  # rows neither cut keeps whole
        if top_p is not None:
            # each candidate's probability in its row's distribution after top_k: that row's
            # candidates hold all of it where top_k fits among them, else the whole row counts
            masked = values.masked_fill(~kept, float("-inf"))
            norm = torch.where(k <= want, masked.logsumexp(dim=-1), logits.logsumexp(dim=-1))
            probs = (masked - norm.unsqueeze(1)).exp()  # [B, want]
            mass = probs.cumsum(dim=-1)
            cuts = top_p < 1  # [B]; at 1 nothing is cut (the mass above saturates at 1.0)
            uncut &= ~cuts
            kept &= ((mass - probs) < top_p.unsqueeze(1)) | ~cuts.unsqueeze(1)
            kept[:, 0] = True
            # the nucleus lies among the candidates unless they hold less than top_p
            wide |= cuts & (k > want) & (mass[:, -1] < top_p)
        cut = values.gather(1, (kept.sum(dim=-1) - 1).unsqueeze(1)).squeeze(1)  # a prefix
        cut[uncut] = float("-inf")
        if bool(wide.any()):
            p = top_p[wide] if top_p is not None else torch.ones_like(cut[wide])
            cut[wide] = _sorted_cut(logits[wide], k[wide], p)
    if min_p is not None:  # p < min_p * p_max, in logits: l < l_max + log(min_p)
        floor = logits.amax(dim=-1) + min_p.log()
        cut = torch.maximum(cut, floor)
    return cut


def _sorted_cut(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R] the smallest logit top_k then top_p keep, for rows whose nucleus is too wide for the
    candidates: the whole row sorted, least likely first, its tail dropped while the mass up to
    and including a token is at most 1 - top_p."""
    vocab = logits.shape[1]
    ordered, _ = logits.sort(dim=-1)  # [R, V], most likely last
    kth = ordered.gather(1, (vocab - top_k).unsqueeze(1))
    masked = ordered.masked_fill(ordered < kth, float("-inf"))
    drop = masked.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    first_kept = drop.sum(dim=-1)  # drop is a prefix
    return masked.gather(1, first_kept.unsqueeze(1)).squeeze(1)


def _processed(logits: torch.Tensor, rows: list[SamplingRequest]) -> torch.Tensor:
    """logit_bias, penalties and min_tokens applied: a new tensor where any applies, logits
    itself (never modified) where none does."""
    out = apply_penalties(apply_logit_bias(logits, rows), rows)
    if out is logits and any(len(r.output_token_ids) < r.params.min_tokens for r in rows):
        out = logits.clone()  # min_tokens masks in place
    return apply_min_tokens(out, rows)


class Sampler:
    """Samples one token per row from a step's logits; see the module docstring for the pipeline."""

    def __init__(self, vocab_size: int, seed: int = 0, cpu_kernels=None):
        """cpu_kernels: the CPU kernels' op library (kernels/cpu_attention.load()); with it rows
        on the CPU race in one fused kernel whose noise is a hash of each row's key
        (benchmarks/sampler.py); without it (a GPU, a CPU that cannot build the kernels) torch's
        generators draw other noise, so a seeded request moved between the two kinds of worker
        samples other tokens."""
        self.vocab_size = vocab_size
        self.seed = seed
        self._cpu_kernels = cpu_kernels
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRequest]) -> SamplerOutput:
        """logits: [B, V >= vocab_size] raw model logits of the B rows, in row order.

        Columns past vocab_size (padding of the embedding) are never sampled. The input is not
        modified.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(rows), \
            f"logits {tuple(logits.shape)} for {len(rows)} rows"
        assert logits.shape[1] >= self.vocab_size, \
            f"logits have {logits.shape[1]} columns, vocab_size is {self.vocab_size}"
        logits = self._vocab(logits)  # [B, V]
        token_ids = self._draw(logits, rows, 0)
        return SamplerOutput(token_ids.tolist(), self._logprobs(logits, token_ids, rows))

    def draw(self, logits: torch.Tensor, rows: list[SamplingRequest],
             salt: int = 0) -> torch.Tensor:
        """[B] the tokens __call__ samples, without logprobs; another salt draws independent
        ones. A coupled draft draws with salt 0: the target's very race (noise and weights)."""
        return self._draw(self._vocab(logits), rows, salt)

    def _vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The vocabulary's columns (past them: the embedding's padding), as float32."""
        return logits[:, :self.vocab_size].float().contiguous()

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRequest], salt: int) -> torch.Tensor:
        processed = _processed(logits, rows)
        greedy = [r.params.temperature < SAMPLING_EPS for r in rows]
        if all(greedy):
            return self._argmax(processed)
        tempered, cut = self._random_logits(processed, rows, greedy)
        random_tokens = self.race(tempered, rows, salt, logits=True, cut=cut)  # [B]
        if not any(greedy):
            return random_tokens
        greedy_t = torch.tensor(greedy, device=logits.device)  # [B]
        return torch.where(greedy_t, self._argmax(processed), random_tokens)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[B] each row's argmax: in the CPU kernel where there is one (torch's argmax reads a
        row at a tenth of its rate), else torch's; the same tokens."""
        if self._cpu_kernels is not None and logits.device.type == "cpu":
            from kernels import cpu_attention
            return cpu_attention.argmax_rows(logits, ops=self._cpu_kernels)
        return logits.argmax(dim=-1)

    def _random_logits(self, logits: torch.Tensor, rows: list[SamplingRequest],
                       greedy: list[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, V] processed logits / temperature (greedy rows at temperature 1; logits
        itself where no row has another), [B] the logit below which top_k, top_p and min_p cut
        each row (None where no row has any)): the cut is applied by whoever samples, the CPU
        kernel in passing."""
        device = logits.device
        vocab = logits.shape[1]
        temperatures = [1.0 if g else r.params.temperature for r, g in zip(rows, greedy)]
        if any(t != 1.0 for t in temperatures):
            temperature = torch.tensor(temperatures, dtype=logits.dtype, device=device)  # [B]
            if self._cpu_kernels is not None and device.type == "cpu":
                # on the kernels' threads, which may be their pool's (step_threads.py)
                from kernels import cpu_attention
                logits = cpu_attention.divide_rows(logits, temperature, ops=self._cpu_kernels)
            else:
                logits = logits / temperature.unsqueeze(1)

        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_p = [r.params.top_p if 0 < r.params.top_p < 1 else 1.0 for r in rows]
        min_p = [r.params.min_p for r in rows]
        use_k, use_p, use_min_p = min(top_k) < vocab, min(top_p) < 1, max(min_p) > 0
        if not (use_k or use_p or use_min_p):
            return logits, None
        return logits, top_k_top_p_min_p_cut(
            logits,
            torch.tensor(top_k, dtype=torch.long, device=device) if use_k else None,
            torch.tensor(top_p, dtype=logits.dtype, device=device) if use_p else None,
            torch.tensor(min_p, dtype=logits.dtype, device=device) if use_min_p else None)

    def distribution(self, logits: torch.Tensor, rows: list[SamplingRequest]) -> torch.Tensor:
        """[B, vocab_size]: the distribution each row samples from (what __call__ draws from),
        one-hot at the argmax for greedy rows."""
        logits = self._vocab(logits)
        processed = _processed(logits, rows)
        greedy = [r.params.temperature < SAMPLING_EPS for r in rows]
        if all(greedy):
            probs = torch.zeros_like(processed)
        else:
            tempered, cut = self._random_logits(processed, rows, greedy)
            probs = (tempered if cut is None else cut_below(tempered, cut)).softmax(dim=-1)
        hot = torch.tensor(greedy, device=logits.device)
        one_hot = torch.zeros_like(processed).scatter_(1, processed.argmax(-1, keepdim=True), 1.0)
        return torch.where(hot.unsqueeze(1), one_hot, probs)

    def race(self, probs: torch.Tensor, rows: list[SamplingRequest], salt: int = 0,
             logits: bool = False, cut: torch.Tensor | None = None) -> torch.Tensor:
        """[B] one token per row drawn from probs [B, V] (rows need not sum to 1; with `logits`,
        log-weights, softmaxed first or, in the CPU kernel, exponentiated in passing): the
        exponential race argmax(p / E), E ~ Exp(1) iid, drawn as -log(U) with U ~ U[0, 1)
        (on a CPU uniform_ and a vectorised log cost a quarter of exponential_). A seeded row's
        noise comes from (seed ^ salt, position) alone (its noise_seed where it has no seed);
        distinct salts give independent draws at one position; the other rows share the
        sampler's generator. `cut` [B] (with `logits`): each row's tokens below it take no
        part (top_k, top_p, min_p), masked in passing by the CPU kernel."""
        seeds = [r.params.seed if r.params.seed is not None else r.noise_seed for r in rows]
        assert cut is None or logits, "a cut applies to logits"
        if self._cpu_kernels is not None and probs.device.type == "cpu":
            return self._cpu_race(probs, rows, seeds, salt, logits, cut)
        if cut is not None:
            probs = cut_below(probs, cut)
        if logits:
            probs = probs.softmax(dim=-1)
        noise = torch.empty_like(probs)
        shared = [i for i, seed in enumerate(seeds) if seed is None]
        if len(shared) == len(rows):
            noise.uniform_(generator=self._generator(probs.device))
        elif shared:
            noise[shared] = torch.empty_like(noise[shared]).uniform_(
                generator=self._generator(probs.device))
        for i, (r, seed) in enumerate(zip(rows, seeds)):
            if seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(row_seed(seed ^ salt, r.position))
                noise[i].uniform_(generator=gen)
        # E = -log(U): U = 0 gives E = inf (that token cannot win); an E of exactly 0 would make
        # p / E NaN (0 / 0) or inf, so it is kept positive
        noise.log_().neg_().clamp_min_(torch.finfo(noise.dtype).tiny)
        return torch.div(probs, noise, out=noise).argmax(dim=-1)

    def _cpu_race(self, probs: torch.Tensor, rows: list[SamplingRequest],
                  seeds: list[int | None], salt: int, logits: bool,
                  cut: torch.Tensor | None) -> torch.Tensor:
        """The race in the CPU kernel: a seeded row's key from (seed ^ salt, position) alone, the
        other rows' from the sampler's generator."""
        from kernels import cpu_attention
        fresh = iter(torch.randint(0, 1 << 62, (seeds.count(None),),
                                   generator=self._generator(probs.device)).tolist())
        keys = [next(fresh) if seed is None else row_seed(seed ^ salt, r.position)
                for r, seed in zip(rows, seeds)]
        return cpu_attention.exponential_race(probs, keys, logits, ops=self._cpu_kernels, cut=cut)

    def new_seed(self) -> int:
        """A seed from the sampler's own generator: an unseeded request's noise seed."""
        return int(torch.randint(0, 1 << 62, (1,), generator=self._generator(torch.device("cpu"))))

    def uniform(self, rows: list[SamplingRequest], salt: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
        """[B] U(0, 1) draws, a seeded row's from (seed ^ salt, position) alone."""
        u = torch.rand(len(rows), generator=self._generator(torch.device(device)),
                       dtype=torch.float64)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                gen = torch.Generator()
                gen.manual_seed(row_seed(r.params.seed ^ salt, r.position))
                u[i] = torch.rand(1, generator=gen, dtype=torch.float64)[0]
        return u.to(device)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    @staticmethod
    def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                  rows: list[SamplingRequest]) -> list[TokenLogprobs | None]:
        """From RAW logits (before penalties and temperature), as vLLM returns by default."""
        wanted = [r.params.logprobs for r in rows]
        if max(wanted, default=-1) < 0:
            return [None] * len(rows)
        entries = token_logprobs(logits, token_ids, [max(k, 0) for k in wanted])
        return [e if k >= 0 else None for e, k in zip(entries, wanted)]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int],
                   rank: bool = False) -> list[TokenLogprobs]:
    """logits: [R, V]. Row i's log_softmax at token_ids[i] with its ks[i] most likely tokens,
    best first, and with `rank` the token's 1-based rank in the vocabulary (ties rank as the
    best of them; 0 without)."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [R, V]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    max_k = min(max(ks, default=0), logprobs.shape[1])
    top_lp, top_ids = (logprobs.topk(max_k, dim=-1) if max_k > 0  # [R, max_k], best first
                       else (logprobs[:, :0], logprobs[:, :0].long()))
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist() if rank else [0] * len(ks)
    top_lp_rows, top_id_rows = top_lp.tolist(), top_ids.tolist()
    return [TokenLogprobs(lp, tuple(TopLogprob(t, v) for t, v in
                                    zip(top_id_rows[i][:k], top_lp_rows[i][:k])), ranks[i])
            for i, (lp, k) in enumerate(zip(chosen.squeeze(1).tolist(), ks))]
