"""Linear weights packed once (for oneDNN, or into panels for the CPU kernels' float32 linear)
compute what nn.Linear computes, and the model that a CPU worker serves is built with them, in
panels on an AVX2 CPU (test_model_vs_hf compares that model with HuggingFace)."""
import pytest
import torch
from torch import nn

from common.models.attention import create_attention_backend
from common.models.llama import load_model
from common.models.packed_linear import PackedLinear, pack_linears, packs, panel_library
from common.worker.config import WorkerConfig
from common.worker.service import build_worker
from kernels import cpu_attention

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch build has no oneDNN")


@pytest.fixture(params=["oneDNN", "panels"])
def library(request):
    return cpu_attention.load() if request.param == "panels" else None


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_equals_linear(rows, bias, library):
    g = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(160, 96, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(160, generator=g))
    x = torch.randn(rows, 96, generator=g)
    packed = PackedLinear(linear, library=library)
    assert packed.kernel == ("oneDNN" if library is None else "panels")
    with torch.inference_mode():
        out, ref = packed(x), linear(x)
    assert out.shape == ref.shape == (rows, 160)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    # a strided view of the rows (the model feeds slices of fused projections)
    wide = torch.randn(rows, 2 * 96, generator=g)[:, :96]
    torch.testing.assert_close(packed(wide), linear(wide), rtol=1e-5, atol=1e-4)


def test_packs_only_what_onednn_computes_well():
    assert packs(torch.float32)
    assert not packs(torch.float16)
    assert not packs(torch.float32, "cuda")
    from kernels.cpu_attention import has_fast_bf16_gemm
    assert packs(torch.bfloat16) == has_fast_bf16_gemm()


def test_panels_serve_float32_on_avx2_only():
    backend = create_attention_backend("torch")
    avx2 = cpu_attention.cpu_isa() == "AVX2"
    assert (panel_library(torch.float32, backend) is cpu_attention.load()) if avx2 else \
        panel_library(torch.float32, backend) is None
    assert panel_library(torch.bfloat16, backend) is None
    assert panel_library(torch.float32, backend, "cuda") is None


def test_linears_pack_for_onednn_when_the_kernels_cannot_be_built(tiny_llama, monkeypatch):
    def no_compiler(isa=None):
        raise RuntimeError("Error building extension: c++: not found")
    monkeypatch.setattr(cpu_attention, "load", no_compiler)
    model = load_model(tiny_llama, create_attention_backend("torch"))
    assert {m.kernel for m in model.modules() if isinstance(m, PackedLinear)} == {"oneDNN"}


def test_pack_linears_replaces_every_linear_and_keeps_tied_embeddings(tiny_llama):
    backend = create_attention_backend("torch")
    plain = load_model(tiny_llama, backend, prepack=False)
    model = load_model(tiny_llama, backend)
    n = plain.config.num_layers
    kinds = [type(m) for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert kinds == [PackedLinear] * (4 * n + 1)  # qkv, o, gate_up, down per layer; lm_head
    kernel = "panels" if cpu_attention.cpu_isa() == "AVX2" else "oneDNN"
    assert {m.kernel for m in model.modules() if isinstance(m, PackedLinear)} == {kernel}
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, nn.Linear) for m in plain.modules()) == 4 * n + 1
    # the embedding keeps its weight whether or not lm_head shared it
    torch.testing.assert_close(model.embed_tokens.weight, plain.embed_tokens.weight, rtol=0,
                               atol=0)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, plain.config.hidden_size, generator=g)
    torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden),
                               rtol=1e-5, atol=1e-4)
    assert pack_linears(model) == 0  # nothing left to pack


@pytest.mark.parametrize("prepack", [True, False])
def test_worker_flag_chooses_the_linears(tiny_llama, prepack):
    worker, _ = build_worker(WorkerConfig(role="decode", model=str(tiny_llama),
                                          worker_id=f"packed-{prepack}", num_kv_blocks=8,
                                          dtype="float32", prepack_weights=prepack))
    try:
        model = worker.runner.model
        assert isinstance(model.lm_head, PackedLinear) == prepack
        assert isinstance(model.layers[0].mlp.down_proj, PackedLinear) == prepack
    finally:
        worker.close()
