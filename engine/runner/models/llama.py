"""A Llama-family decoder in plain torch: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3
(per-head RMSNorm of q and k before RoPE).

The model sees a flat step of tokens (`[T]` ids and positions) from many requests at once;
attention goes through `kernels.attention.paged_attention` with the step's metadata, and the
elementwise stages through `kernels.fused` (one Triton kernel each on CUDA, torch on CPU).

Under tensor parallelism (`tp`, with this rank's `Partition`) the modules are built at the
rank's shapes; the rank's partial outputs of o_proj and down_proj are summed over the ranks,
the embedding lookups too (each rank knows its vocabulary rows only), and the logits of the
vocabulary shards are gathered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from engine.config import ModelConfig, ModelLoadError
from engine.parallel.partition import Partition
from kernels import fused
from kernels.attention import AttentionMetadata, paged_attention
from kernels.fp8 import Fp8Rows
from kernels.linear import Linear
from lora.layers import DEFER_DOWN_MAX_ROWS, deferred_projection

if TYPE_CHECKING:
    from engine.parallel.collectives import TPGroup


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor, delta: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); may write into x and residual. `delta`: the
        deferred LoRA output of x's projection, added to x first."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps, delta)

    def add_quantized(self, x: torch.Tensor, residual: torch.Tensor,
                      delta: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, Fp8Rows]:
        """`add`, and the normed rows quantized for an FP8 projection (by the same kernel)."""
        return fused.add_rms_norm_fp8(x, residual, self.weight, self.eps, delta)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]`, with linear or llama3 scaling applied."""
    d = cfg.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r}")


class QKNorm(nn.Module):
    """Qwen3's RMSNorm over each head of q and k (weights `[head_dim]`, shared by the heads)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D] -> the same shapes, each head normalised (in place on
        CUDA: one kernel for both)."""
        return fused.qk_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)


class Attention(nn.Module):
    kv_scales: torch.Tensor

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one matmul: rows [q | k | v].
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        self.qk_norm = QKNorm(cfg) if cfg.qk_norm else None
        # An FP8 KV cache's scales [2, KVH] fp32 (K's, V's; `kernels.fp8_kv`): ones, or the
        # checkpoint's k_scale / v_scale. Set by `LlamaForCausalLM.init_rope`.
        self.register_buffer("kv_scales", torch.empty(2, cfg.num_kv_heads), persistent=False)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata,
                x_rows: Fp8Rows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output projection's (output, deferred LoRA delta or None: its consumer adds
        it, `lora.layers.deferred_projection`)."""
        q = self.project(x, cos, sin, kv_cache, meta.slot_mapping, x_rows)
        o = paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale,
                            kv_scales=self.kv_scales)
        if self.tp is not None:  # the delta of a row-parallel projection is a partial sum
            return self.output(o), None
        return deferred_projection(self.o_proj, o.reshape(o.shape[0], self.q_size))

    def project(self, x, cos, sin, kv_cache, slot_mapping: torch.Tensor,
                x_rows: Fp8Rows | None = None) -> torch.Tensor:
        """x: [T, hidden] -> the rotated queries [T, heads, head_dim]; this step's K/V are
        written to `kv_cache` at `slot_mapping`. (Attention's first half: the piecewise CUDA
        graphs, engine/runner/piecewise_graphs.py, replay it and run the attention between.)
        `x_rows`: x quantized for an FP8 qkv projection, if the norm before did it."""
        T = x.shape[0]
        if self.qk_norm is None:  # RoPE's kernel adds the adapters' deferred output
            qkv, delta = deferred_projection(self.qkv_proj, x, x_rows)
        else:
            qkv, delta = self.qkv_proj(x, x_rows), None
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        return fused.rope_cache(
            q,
            k,
            v.view(T, self.num_kv_heads, self.head_dim),
            cos,
            sin,
            kv_cache[0],
            kv_cache[1],
            slot_mapping,
            self.kv_scales,
            delta,
        )

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The attention's output o: [T, heads, head_dim] -> [T, hidden]."""
        out = self.o_proj(o.reshape(o.shape[0], self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fp8_inputs = False  # FP8 projections: each input quantized by its producer

    def forward(self, x: torch.Tensor, x_rows: Fp8Rows | None = None) -> torch.Tensor:
        """`x_rows`: x quantized for an FP8 gate_up projection, if the norm before did it."""
        out = self.down_proj(*self._activation(x, x_rows))
        return out if self.tp is None else self.tp.all_reduce(out)

    def deferred(self, x: torch.Tensor, x_rows: Fp8Rows | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` as (output, down_proj's deferred LoRA delta or None), for the next
        RMSNorm to add (`lora.layers.deferred_projection`). Not under tensor parallelism: there
        the output is a partial sum, and its adapters' part goes in before the all-reduce.
        Only in steps of up to `DEFER_DOWN_MAX_ROWS` rows (measured there)."""
        if self.tp is not None:
            return self(x, x_rows), None
        return deferred_projection(self.down_proj, *self._activation(x, x_rows),
                                   max_rows=DEFER_DOWN_MAX_ROWS)

    def _activation(self, x: torch.Tensor, x_rows: Fp8Rows | None
                    ) -> tuple[torch.Tensor, Fp8Rows | None]:
        """SiLU-and-mul of the gate_up projection (its rows quantized for an FP8 down_proj)."""
        gate_up, delta = deferred_projection(self.gate_up_proj, x, x_rows)
        if self.fp8_inputs:
            return fused.silu_mul_fp8(gate_up, delta)
        return fused.silu_mul(gate_up, delta), None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg, tp)
        # FP8 projections (set by the loader): each norm also quantizes its output for the
        # projection after it, in the same kernel (one launch less each).
        self.fp8_inputs = False

    def forward(self, x, residual, cos, sin, kv_cache, meta, delta=None):
        """x: the previous layer's MLP output (the embeddings for the first layer, whose
        `residual` is None) and `delta` its down projection's deferred LoRA output (or None);
        returns this layer's MLP output, the residual stream before it, and its delta. Each
        residual add is fused into the RMSNorm after it, which adds the delta too."""
        rows = None
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        elif self.fp8_inputs:
            x, residual, rows = self.input_layernorm.add_quantized(x, residual, delta)
        else:
            x, residual = self.input_layernorm.add(x, residual, delta)
        x, delta = self.self_attn(x, cos, sin, kv_cache, meta, rows)
        if self.fp8_inputs:
            x, residual, rows = self.post_attention_layernorm.add_quantized(x, residual, delta)
        else:
            x, residual = self.post_attention_layernorm.add(x, residual, delta)
        out, delta = self.mlp.deferred(x, rows)
        return out, residual, delta


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, part: Partition | None = None,
                 tp: TPGroup | None = None):
        """`cfg`: the whole model's shape; with `tp`, this rank's modules take `part`'s."""
        super().__init__()
        self.cfg = cfg
        self.tp, self.part = tp, part
        local = self.local_cfg = cfg if part is None else part.local(cfg)
        # Built with its (uninitialised) weight: the loader fills it, and a random init under
        # the meta device would import torch._dynamo (3 s of start-up) for nothing.
        self.embed_tokens = nn.Embedding(local.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(local.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(local, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = Linear(cfg.hidden_size, local.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)  # (P, D/2) fp32
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_rope()

    def init_rope(self) -> None:
        """(Re)build the fp32 cos/sin tables and the FP8 KV scales (ones), e.g. after loading on
        the meta device (where there is nothing to build, and tracing it would import
        torch._dynamo: 3 s)."""
        device = self.embed_tokens.weight.device
        if device.type == "meta":
            return
        for attn in self.attentions():
            attn.kv_scales = torch.ones(2, attn.num_kv_heads, device=device)
        inv_freq = rope_inv_freq(self.cfg).to(device)
        pos = torch.arange(self.cfg.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv_freq)
        self.rope_cos, self.rope_sin = freqs.cos(), freqs.sin()

    def attentions(self) -> list[Attention]:
        """Each decoder layer's attention module, in order."""
        return [cast(DecoderLayer, layer).self_attn for layer in self.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]. `kv_caches` is
        iterated once, layer by layer, as the layers are queued (the host KV tier's waits)."""
        x = self.embed(input_ids)
        cos = self.rope_cos[positions].unsqueeze(1).to(x.dtype)  # (T, 1, D/2)
        sin = self.rope_sin[positions].unsqueeze(1).to(x.dtype)
        residual: torch.Tensor | None = None  # the first layer starts it
        delta = None  # the layer before's deferred LoRA output (`DecoderLayer.forward`)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual, delta = layer(x, residual, cos, sin, kv, meta, delta)
        assert residual is not None
        return self.norm.add(x, residual, delta)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, hidden]; a rank looks up its own vocabulary rows, the others
        give zeros, and the sum over the ranks has every row."""
        if self.tp is None or self.part is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.part.vocab_start
        outside = (local < 0) | (local >= self.part.vocab_rows)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(1), 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> fp32 logits [N, vocab]."""
        logits = self.lm_head(hidden)
        if self.tp is not None:  # (N, vocab_rows) shards -> (N, size * vocab_rows), cut
            logits = self.tp.gather_columns(logits)[:, : self.cfg.vocab_size]
        return logits.float().contiguous()
