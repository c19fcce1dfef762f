"""The attention kernels compile a fixed set of variants whatever lengths they are given.

Triton compiles a kernel once per set of compile-time constants and, for each integer argument it
specializes, per case of that integer (1, a multiple of 16, neither). Steps that run eagerly (mixed
steps, batches past the largest CUDA graph, --enforce-eager) hand the kernels block tables as wide
as their longest sequence, so anything that follows the length compiles again while serving: on
an H200, 0.5-0.7 s at the first decode step of each new context length, and at the first prefill
whose table width was not a multiple of 16. These tests launch the kernels over many lengths with
a recorder in place of each and count what would key its compilation."""
import inspect

import pytest
import torch

from kernels import paged_decode_attention as decode
from kernels import paged_prefill_attention as prefill

BLOCK = 16
WIDTHS = [1, 2, 3, 7, 8, 16, 17, 31, 32, 64, 100, 129, 188, 256, 260]  # blocks per table row


class Recorder:
    """Stands in for a Triton kernel: `kernel[grid](...)` records the launch, runs nothing."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))

    def variants(self) -> set:
        """Distinct compilation keys among the launches: the constants, and per specialized
        integer argument which case it is."""
        fn = getattr(self.kernel, "fn", self.kernel)
        names = list(inspect.signature(fn).parameters)
        free = getattr(self.kernel, "do_not_specialize", None) or \
            getattr(self.kernel, "kwargs", {}).get("do_not_specialize") or []
        free = {names[f] if isinstance(f, int) else f for f in free}
        keys = set()
        for args, kwargs in self.launches:
            ints = tuple((n, 1 if a == 1 else 16 if a % 16 == 0 else 0)
                         for n, a in zip(names, args)
                         if isinstance(a, int) and not isinstance(a, bool) and n not in free)
            keys.add((ints, tuple(sorted(kwargs.items()))))
        return keys


@pytest.fixture
def recorders(monkeypatch):
    out = {}
    for module, name in [(decode, "_decode_kernel"), (decode, "_combine_kernel"),
                         (prefill, "_prefill_kernel")]:
        out[name] = Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, out[name])
    return out


def _cache(dtype, num_kv_heads=2, head_dim=64):
    return torch.zeros((2, max(WIDTHS) * 3, BLOCK, num_kv_heads, head_dim), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_compiles_two_variants_at_any_length_and_batch(recorders, dtype):
    """One split or several; the combine kernel once. Batch 1 splits long contexts, batch 64
    does not (its programs fill the GPU)."""
    cache = _cache(dtype)
    for batch in (1, 3, 64):
        for width in WIDTHS:
            q = torch.zeros((batch, 8, 64), dtype=dtype)
            tables = torch.zeros((batch, width), dtype=torch.long)
            lens = torch.full((batch,), width * BLOCK)
            decode.paged_decode_attention(q, cache, tables, lens, 0.125)
    kernel, combine = recorders["_decode_kernel"], recorders["_combine_kernel"]
    splits = {kw["SPLIT"] for _, kw in kernel.launches}
    assert splits == {False, True}, "both cases reached"
    assert len(kernel.variants()) == 2
    assert len(combine.launches) > 10 and len(combine.variants()) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_compiles_one_variant_at_any_length(recorders, dtype):
    cache = _cache(dtype)
    for num_seqs in (1, 2, 5):
        for width in WIDTHS:
            tokens = width * BLOCK - 3
            q = torch.zeros((tokens * num_seqs, 8, 64), dtype=dtype)
            tables = torch.zeros((num_seqs, width), dtype=torch.long)
            starts = torch.arange(num_seqs + 1) * tokens
            prefill.paged_prefill_attention(q, cache, tables, starts,
                                            torch.zeros(num_seqs, dtype=torch.long), tokens,
                                            0.125)
    assert len(recorders["_prefill_kernel"].launches) == 3 * len(WIDTHS)
    assert len(recorders["_prefill_kernel"].variants()) == 1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the recorders leave outputs unwritten
def test_start_up_warm_up_reaches_every_variant(recorders, tiny_llama):
    """The worker's warm-up on a GPU launches each kernel in every variant serving compiles (the
    two decode variants, the combine, the prefill over a cached prefix), so none compiles on a
    user's request; with the recorders, the model on the triton backend."""
    from common.kv_layout import KVLayout
    from common.models.attention import create_attention_backend
    from common.models.llama import load_model
    from common.worker.memory import warm_up_kernels
    from tests.kernels.paged import DEVICE

    model = load_model(tiny_llama, create_attention_backend("triton", DEVICE), torch.float32,
                       DEVICE, progress=False)
    c = model.config
    layout = KVLayout(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                      head_dim=c.head_dim, block_size=BLOCK, dtype="float32")
    warm_up_kernels(model, layout, torch.device(DEVICE))
    kernel, combine, pre = (recorders[k] for k in ("_decode_kernel", "_combine_kernel",
                                                   "_prefill_kernel"))
    assert {kw["SPLIT"] for _, kw in kernel.launches} == {False, True}
    assert len(kernel.variants()) == 2 and len(combine.variants()) == 1
    assert len(pre.variants()) == 1
    assert len(pre.launches) == c.num_layers  # the mixed step's, one per layer
