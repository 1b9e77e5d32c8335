"""A stack of K3 layers decoding N steps, exact reference (runs the `tiny` preset on CPU in seconds).

Per step, for tokens t [B]:
    x = embed[t]
    for L in layers: x, B = layer_step(x, B, ...)          # k3lab.ref.layers (B restarts each step)
    x = attnres(B, x; output_res_norm, output_res_proj)
    logits = lm_head rms(x; final_norm)
The stack holds every layer's KDA state and conv state, every MLA layer's latent cache and lengths.
Logits come back in the compute dtype (float32, float64 for the oracle). Greedy `generate` feeds the
argmax back. TP is not simulated (build the stack at tp=1).
"""
from __future__ import annotations

import torch

from k3lab.ref.attnres import attnres
from k3lab.ref.layers import layer_step, new_layer_state
from k3lab.ref.rmsnorm import compute_dtype, rms_norm
from k3lab.ref.situ import linear


class Stack:
    """Decoding state + weights (a `k3lab.weights.StackWeights`) for `batch` sequences."""

    def __init__(self, weights, batch: int = 1, capacity: int | None = None, *, dtype: torch.dtype | None = None,
                 kv_dtype: str | None = None, device="cpu"):
        self.w = weights
        self.cfg = weights.view.cfg
        if weights.view.tp != 1:
            raise ValueError(f"Stack runs whole layers: build its weights at tp=1, got tp={weights.view.tp}")
        self.batch = batch
        self.capacity = capacity or weights.view.context
        self.dtype = dtype or weights.embed.dtype
        self.device = torch.device(device)
        self.states = [new_layer_state(lw, batch, self.capacity, act_dtype=self.dtype, kv_dtype=kv_dtype,
                                       device=self.device) for lw in weights.layers]
        self.position = 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] int -> logits [B, vocab]; advances every state by one position."""
        if tokens.shape != (self.batch,):
            raise ValueError(f"Stack.step: tokens must have shape [{self.batch}], got {tuple(tokens.shape)}")
        if self.position >= self.capacity:
            raise ValueError(f"Stack.step: the MLA caches hold {self.capacity} positions; all are used")
        eps = self.cfg.rms_norm_eps
        x = self.w.embed[tokens.to(self.device)].to(self.dtype)
        blocks: list[torch.Tensor] = []
        for lw, st in zip(self.w.layers, self.states):
            x, blocks = layer_step(x, blocks, lw, st, block_size=self.cfg.attnres_block_size, eps=eps)
        self.last_blocks = len(blocks)
        x = attnres(blocks, x, self.w.output_res_norm, self.w.output_res_proj, eps)
        h = rms_norm(x, self.w.final_norm, eps, out_dtype=self.dtype)
        self.position += 1
        return linear(h.to(compute_dtype(h)), self.w.lm_head)

    def run(self, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: tokens [B, N] -> logits [B, N, vocab]."""
        return torch.stack([self.step(tokens[:, i]) for i in range(tokens.shape[1])], dim=1)

    def generate(self, first: torch.Tensor, n_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy: (tokens [B, n_steps] produced, logits [B, n_steps, vocab])."""
        tok, toks, logits = first, [], []
        for _ in range(n_steps):
            lg = self.step(tok)
            tok = lg.argmax(-1)
            toks.append(tok)
            logits.append(lg)
        return torch.stack(toks, 1), torch.stack(logits, 1)
