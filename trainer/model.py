"""A small GPT decoder, written so that every parallel wrapper can use it unchanged.

Model code knows nothing of parallelism (that is trainer/parallelize.py):
- layers live in an ``nn.ModuleDict`` keyed by their global index, so parameter
  names (``layers.3.attn.wq.weight``) are the same in every pipeline stage and
  every (pp, dp, tp) layout; that is what lets a DCP checkpoint reshard.
- ``forward`` is stage-agnostic: a pipeline stage deletes the parts it does not own
  (``tok``/``pos`` on later stages, ``norm``/``head`` on earlier ones) and forward
  skips what is ``None``.
- attention reshapes with ``view(B, T, -1, head_dim)``, so the same code runs with
  all heads or with a tensor-parallel shard of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.head_dim = d // n_heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w1 = nn.Linear(d, 4 * d, bias=False)
        self.w2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)
        # Activation checkpointing: recompute this block in backward instead of keeping
        # its activations. Done inside forward (not with a wrapper module) so parameter
        # names, and therefore checkpoints, do not change.
        self.checkpoint_activations = False

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg.d_model, cfg.n_heads) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok(x) + self.pos(positions)
        for blk in self.layers.values():
            x = blk(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


def init_weights(model: GPT, seed: int) -> None:
    """Deterministic init from ``seed`` alone, so every rank and every layout starts from the same weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # LayerNorm
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_params(cfg: ModelConfig, include_embedding: bool = True) -> int:
    d, L, V, T = cfg.d_model, cfg.n_layers, cfg.vocab, cfg.seq_len
    block = 4 * d * d + 8 * d * d + 4 * d  # attention + MLP + two LayerNorms
    n = L * block + 2 * d + V * d  # + final norm + head
    if include_embedding:
        n += V * d + T * d
    return n


def flops_per_token(cfg: ModelConfig) -> float:
    """PaLM (appendix B) training FLOPs per token: 6N + 12·L·H·Q·T.

    N excludes the embedding tables (token and position), as torchtitan does: a lookup
    is not a matmul. The output head is counted (it is a real matmul). H = heads,
    Q = head dim, T = sequence length; the second term is attention's score/value matmuls.
    """
    n = count_params(cfg, include_embedding=False)
    head_dim = cfg.d_model // cfg.n_heads
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * head_dim * cfg.seq_len
