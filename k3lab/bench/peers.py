"""Peer implementations timed side by side with k3lab's kernels (imported only when present).

fla (flash-linear-attention, `fla-core`): `fused_recurrent_kda` is the recurrence alone (gate,
beta sigmoid and q/k l2norm in the kernel; no short conv, no output norm). The served decode path
is three launches: fla's `causal_conv1d_update` (silu) over the qkv channels, the recurrence, and
fla's gated RMSNorm with a sigmoid gate. Both are built here on the same inputs as ours.
"""
from __future__ import annotations

import importlib.util

import torch


def fla_version() -> str | None:
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        from importlib.metadata import version

        return version("fla-core")
    except Exception:  # noqa: BLE001
        return "unknown"


def fla_available() -> tuple[bool, str]:
    v = fla_version()
    if v is None:
        return False, "fla-core is not installed (extra 'peers')"
    if not torch.cuda.is_available():
        return False, "fla kernels need a GPU"
    return True, f"fla-core {v}"


def fla_recurrence(q, k, v, fgate, b, A_log, dt_bias, state, out, lower_bound=-5.0):
    """fla's fused_recurrent_kda as served: in-place state, gate/beta/l2norm in the kernel.
    q, k, v, fgate [B, T, H, D] (q, k, v already conv'd), b [B, T, H], state [B, H, D, D] fp32."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    return fused_recurrent_kda_fwd(
        q=q, k=k, v=v, g=fgate, beta=b, A_log=A_log, dt_bias=dt_bias, initial_state=state,
        inplace_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound, out=out,
    )


class FlaDecodePath:
    """fla's KDA decode as its layer runs it: one short conv per q, k, v (fla's
    `causal_conv1d_update`, silu), the recurrence, and fla's gated RMSNorm (sigmoid gate):
    five launches. fla keeps W conv entries per channel ([B, C, W]); ours keeps W-1, so fla's
    caches are built from ours and both start from the same history."""

    def __init__(self, params, state, conv_state, B: int):
        H, D = params.heads, params.head_dim
        self.H, self.D, self.B = H, D, B
        self.p = params
        W = params.conv_kernel
        HD = H * D
        self.caches, self.ws = [], []
        for i in range(3):
            c = torch.zeros(B, HD, W, dtype=conv_state.dtype, device=conv_state.device)
            c[..., 1:] = conv_state[:, i * HD:(i + 1) * HD]
            self.caches.append(c)
            self.ws.append(params.conv_w[i * HD:(i + 1) * HD].contiguous())
        self.state = state
        self.o = torch.empty(B, 1, H, D, dtype=torch.bfloat16, device=state.device)

    def __call__(self, qkv, f, b, gate):
        """qkv [B, 3HD], f [B, HD], b [B, H], gate [B, HD] (T = 1) -> out [B, HD]."""
        from fla.modules.causal_conv1d.ops import causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import rms_norm_gated

        B, H, D = self.B, self.H, self.D
        HD = H * D
        qkv_ = [causal_conv1d_update(qkv[:, i * HD:(i + 1) * HD], self.caches[i], weight=self.ws[i],
                                     activation="silu")[0].view(B, 1, H, D) for i in range(3)]
        o, _ = fla_recurrence(*qkv_, f.view(B, 1, H, D), b.view(B, 1, H), self.p.A_log, self.p.dt_bias,
                              self.state, self.o, self.p.lower_bound)
        out = rms_norm_gated(o.view(B * H, D), gate.view(B * H, D), self.p.o_norm_w, None,
                             activation="sigmoid", eps=self.p.eps)
        return out.view(B, HD)
