"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from common.models.attention import AttentionBackend, AttentionMetadata
from common.models.config import ModelConfig
from common.models.gguf import GGUFCheckpoint, find_gguf
from common.models.ops import ModelOps
from common.models.packed_linear import pack_linears, packs, panel_library
from common.models.parallel import PipelineParallel, TensorParallel, VocabParallelEmbedding
from kernels import reference


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: ModelOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x, residual=None):
        """With a residual: (rms_norm(x + residual), x + residual), fused where the ops can."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 tp: TensorParallel | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads = local_heads(cfg, tp)
        self.tp = tp
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        # q, k and v in one matmul; the checkpoint's q_proj/k_proj/v_proj load into its rows
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend.ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend.ops)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim ** -0.5
        self.backend = backend

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.contiguous().view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.backend.ops.rope(q, k, rope)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        out = self.o_proj(out.reshape(t, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModelOps, tp: TensorParallel | None = None):
        super().__init__()
        self.ops = ops
        self.tp = tp
        inter = per_rank(cfg.intermediate_size, tp)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(self.ops.silu_mul(gate, up))
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 tp: TensorParallel | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, backend, tp)
        self.mlp = MLP(cfg, backend.ops, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)

    def forward(self, h, residual, rope, kv_cache, meta):
        """-> (mlp output, residual stream before it): the next layer's norm adds the two, so
        the residual add fuses into the norm (same sums as `h + attn(norm(h))`, bit for bit)."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    rope_cos: torch.Tensor  # [max_position_embeddings, head_dim], a non-persistent buffer
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 tp: TensorParallel | None = None, pp: PipelineParallel | None = None):
        """With `tp`, this rank's part of a tensor-parallel group; with `pp`, its stage of a
        pipeline: its layers only, the embedding on the first stage, the final norm and LM
        head on the last (parallel.py)."""
        super().__init__()
        self.config = cfg
        self.tp, self.pp = tp, pp
        if tp is not None:
            tp.check(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)
        self.first_layer, last_layer = pp.layers(cfg.num_layers) if pp else (0, cfg.num_layers)
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding | None = None
        if pp is None or pp.is_first:
            # given its weight, nn.Embedding skips its random init (normal_ on the meta device
            # imports torch._dynamo)
            self.embed_tokens = nn.Embedding(
                cfg.vocab_size, cfg.hidden_size,
                _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)) if tp is None \
                else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, tp)
                                    for _ in range(last_layer - self.first_layer))
        self.ops = backend.ops
        self.norm: RMSNorm | None = None
        self.lm_head: nn.Linear | None = None
        if pp is None or pp.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)
            self.lm_head = nn.Linear(cfg.hidden_size, per_rank(cfg.vocab_size, tp), bias=False)
        self.tie_weights()
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden].
        on_layer(i) runs once layer i's KV for this step is in the cache."""
        rope = self.ops.rope_step(positions, self.rope_cos, self.rope_sin)
        if self.embed_tokens is not None:
            h, residual = self.embed_tokens(input_ids), None
        else:  # a later pipeline stage: the stage before's hidden states and residual stream
            assert self.pp is not None
            h, residual = self.pp.recv(len(input_ids), self.config.hidden_size,
                                       self.rope_cos.dtype, input_ids.device)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer(h, residual, rope, kv_cache, meta)
            if on_layer is not None:
                on_layer(i)
        if self.norm is None:  # not the last stage: on to the next one
            assert self.pp is not None and residual is not None
            self.pp.send(h, residual)
            return h
        return self.norm(h, residual)[0]

    def tie_weights(self) -> None:
        """The LM head reads the embedding's weights (tied checkpoints), where a stage has
        both; a last stage without the embedding loads them into its LM head."""
        if self.config.tie_word_embeddings and self.lm_head is not None and \
                self.embed_tokens is not None:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "logits come from the last pipeline stage"
        logits = self.lm_head(hidden).float()
        return logits if self.tp is None else self.tp.all_gather_last(logits)

    @property
    def num_kv_heads(self) -> int:
        """KV heads of this rank's cache (all of them without tensor parallelism)."""
        return local_heads(self.config, self.tp)[1]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """tensors: (HF checkpoint name, tensor) pairs; source names them in errors."""
        own = dict(self.named_parameters())
        loaded = set()
        for name, tensor in tensors:
            local = self._stage_name(name.removeprefix("model."))
            if local is None:
                continue  # another pipeline stage's
            key, rows = self._fused_rows(local)
            if key not in own:
                continue
            tensor = self._tp_part(local, tensor)
            param = own[key] if rows is None else own[key][rows[0]:rows[1]]
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                 f"model shape {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(local if rows is not None else key)
        expected = {shard for key in own for shard in self._shards(key)}
        missing = expected - loaded
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint {source} lacks weights: {sorted(missing)[:8]}")


    def _stage_name(self, key: str) -> str | None:
        """A checkpoint name as this pipeline stage's parameter, or None for another stage's:
        layers renumbered from the stage's first, the embedding into a last stage's LM head
        where they are tied."""
        if key.startswith("layers."):
            _, index, rest = key.split(".", 2)
            i = int(index) - self.first_layer
            return f"layers.{i}.{rest}" if 0 <= i < len(self.layers) else None
        if key.startswith("embed_tokens.") and self.embed_tokens is None:
            tied = self.config.tie_word_embeddings and self.lm_head is not None
            return key.replace("embed_tokens", "lm_head") if tied else None
        if (key.startswith("lm_head.") and self.lm_head is None) or \
                (key.startswith("norm.") and self.norm is None):
            return None
        return key

    def _tp_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows (column-parallel, vocab-parallel) or columns (row-parallel) of a
        checkpoint tensor; all of it without tensor parallelism, and for norms."""
        tp = self.tp
        if tp is None:
            return tensor
        c, hd = self.config, self.config.head_dim
        q0, q1 = tp.share(c.num_heads)
        k0, k1 = tp.kv_heads(c.num_heads, c.num_kv_heads)
        i = tp.share(c.intermediate_size)
        rows = {"q_proj": (q0 * hd, q1 * hd), "k_proj": (k0 * hd, k1 * hd),
                "v_proj": (k0 * hd, k1 * hd), "gate_proj": i, "up_proj": i,
                "embed_tokens": tp.share(c.vocab_size), "lm_head": tp.share(c.vocab_size)}
        cols = {"o_proj": (q0 * hd, q1 * hd), "down_proj": i}
        part = name.split(".")[-2]
        if part in rows:
            a, b = rows[part]
            return tensor[a:b]
        if part in cols:
            a, b = cols[part]
            return tensor[:, a:b]
        return tensor

    def _layout(self) -> dict[str, list[tuple[str, int]]]:
        """Fused parameter -> its checkpoint shards and their sizes along dim 0, in order (this
        rank's sizes under tensor parallelism)."""
        c = self.config
        heads, kv_heads = local_heads(c, self.tp)
        q, kv = heads * c.head_dim, kv_heads * c.head_dim
        inter = per_rank(c.intermediate_size, self.tp)
        return {"self_attn.qkv_proj": [("self_attn.q_proj", q), ("self_attn.k_proj", kv),
                                       ("self_attn.v_proj", kv)],
                "mlp.gate_up_proj": [("mlp.gate_proj", inter), ("mlp.up_proj", inter)]}

    def _fused_rows(self, key: str) -> tuple[str, tuple[int, int] | None]:
        """A checkpoint name -> (our parameter, its rows) for shards of fused parameters."""
        for fused, shards in self._layout().items():
            start = 0
            for shard, size in shards:
                if f".{shard}." in f".{key}":
                    return key.replace(shard, fused), (start, start + size)
                start += size
        return key, None

    def _shards(self, key: str) -> list[str]:
        """The checkpoint names that fill our parameter `key`."""
        for fused, shards in self._layout().items():
            if f".{fused}." in f".{key}":
                return [key.replace(fused, shard) for shard, _ in shards]
        return [key]


def local_heads(cfg: ModelConfig, tp: TensorParallel | None) -> tuple[int, int]:
    """(query heads, KV heads) of one rank."""
    if tp is None:
        return cfg.num_heads, cfg.num_kv_heads
    k0, k1 = tp.kv_heads(cfg.num_heads, cfg.num_kv_heads)
    return cfg.num_heads // tp.size, k1 - k0


def per_rank(n: int, tp: TensorParallel | None) -> int:
    """One rank's even share of n rows (all of them without tensor parallelism)."""
    return n // tp.size if tp else n


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_position_embeddings, head_dim] each, computed on the CPU even inside a
    meta-device context (arithmetic on meta tensors imports torch._dynamo: seconds of start-up)."""
    with torch.device("cpu"):
        inv_freq = reference.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if cfg.rope_freq_factors:
            inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=inv_freq.dtype)
        return reference.rope_cos_sin(inv_freq, cfg.max_position_embeddings)


def load_model(model_dir: str | Path, backend: AttentionBackend,
               dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", prepack: bool = True,
               progress: bool = True, tp: TensorParallel | None = None,
               pp: PipelineParallel | None = None) -> LlamaForCausalLM:
    """From a HF checkpoint directory (*.safetensors), a .gguf file or a directory holding one
    (dequantized to float32, then cast to `dtype`). On a CPU, `prepack` packs the linear
    weights once (packed_linear.py: into panels for the CPU kernels' float32 linear on an AVX2
    CPU, else for oneDNN) where that serves the dtype. `progress`: a
    progress bar over the tensors read, on stderr and only where stderr is a terminal."""
    gguf_file = find_gguf(model_dir)
    if gguf_file is None:
        cfg = ModelConfig.from_pretrained(model_dir)
        num_tensors, tensors = _safetensors(Path(model_dir))
        kind = "safetensors"
    else:
        checkpoint = GGUFCheckpoint(gguf_file)  # its metadata is read once, for both
        cfg = ModelConfig.from_gguf(checkpoint)
        num_tensors = checkpoint.num_tensors()
        tensors = ((name, torch.from_numpy(w)) for name, w in checkpoint.tensors())
        kind = "GGUF"
    if progress:  # disable=None: tqdm shows nothing where stderr is not a terminal
        tensors = tqdm(tensors, total=num_tensors, desc=f"Loading {kind} weights",
                       unit="tensor", disable=None, dynamic_ncols=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, tp, pp)
    # the weights get CPU memory to load into; the rope tables, not in the checkpoint, were
    # computed on the CPU already and stay (to_empty's empty_like of a meta tensor would run
    # torch's Python reference, which imports sympy: half a second of every start-up)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu") if t.is_meta else t)
    model.tie_weights()
    model.load_weights(tensors, str(model_dir))
    model = model.to(device=device, dtype=dtype).train(False)  # inference mode for every module
    if prepack and packs(dtype, device):
        pack_linears(model, panel_library(dtype, backend, device))
    return model


def _safetensors(model_dir: Path) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """The number of tensors in the directory's *.safetensors (read from their headers), and
    the tensors, read one at a time."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    num_tensors = 0
    for f in files:
        with safe_open(str(f), framework="pt") as checkpoint:
            num_tensors += len(checkpoint.keys())

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(f), framework="pt") as checkpoint:
                for name in checkpoint.keys():
                    yield name, checkpoint.get_tensor(name)

    return num_tensors, tensors()
