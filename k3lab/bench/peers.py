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


# ---- FlashInfer (carried as an archive: ../shared/device/bundle-flashinfer.sh; FI_SITE set by its unpack) ----

def flashinfer_module(name: str):
    """Import `flashinfer.<name>` through a package stub (the carried tree lacks modules that
    `import flashinfer` pulls in). Raises ImportError naming what is missing."""
    import importlib
    import os
    import sys
    import types

    site = os.environ.get("FI_SITE")
    if "flashinfer" not in sys.modules:
        if not site:
            import importlib.util as iu
            if iu.find_spec("flashinfer") is None:
                raise ImportError("FlashInfer is not importable: unpack .gpu/fi (FI_SITE) or install flashinfer-python")
        else:
            pkg = types.ModuleType("flashinfer")
            pkg.__path__ = [os.path.join(site, "flashinfer")]
            sys.modules["flashinfer"] = pkg
    return importlib.import_module(f"flashinfer.{name}")


def flashinfer_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "FlashInfer kernels need a GPU"
    try:
        flashinfer_module("kda_kernels.fused_kda_decode")
    except Exception as e:  # noqa: BLE001 - ImportError or the DSL failing at import
        return False, f"FlashInfer's fused KDA decode does not import: {type(e).__name__}: {str(e)[:200]}"
    return True, "flashinfer 0.7.2 fused_kda_decode (CuTe DSL)"


class FlashInferKDADecode:
    """FlashInfer's one-launch KDA decode (conv update, silu, q/k l2norm, gate, beta, delta rule, gated
    RMSNorm) on our inputs. Its layouts differ from ours and are converted here, outside any timed region:
    state [slots, H, V, K] (value-major rows: ours transposed), conv cache [slots, 3HD, W-1] stored
    sequence-strided (memory [slots, W-1, 3HD]), conv weight [3, W, HD] fp32, norm weight fp32. Slot 0 is
    FlashInfer's null slot (a row whose state index is <= 0 is skipped and writes zeros: `is_live` in its
    kernel), so sequence b lives in slot b + 1 and slot 0 is an unused dummy."""

    def __init__(self, params, state, conv_state, B: int):
        self.mod = flashinfer_module("kda_kernels.fused_kda_decode")
        H, D, W = params.heads, params.head_dim, params.conv_kernel
        HD = H * D
        self.B, self.H, self.D = B, H, D
        self.p = params
        self.weight = params.conv_w.view(3, HD, W).permute(0, 2, 1).contiguous().float()
        self.A_log = params.A_log.float().contiguous()
        self.dt_bias = params.dt_bias.float().contiguous()
        self.norm_w = params.o_norm_w.float().contiguous()
        st = state.transpose(-1, -2)
        self.state = torch.cat([torch.zeros_like(st[:1]), st]).contiguous()  # slot 0: the null slot
        cs = conv_state.transpose(1, 2)
        self.conv = torch.cat([torch.zeros_like(cs[:1]), cs]).contiguous().transpose(1, 2)  # strides (.., 1, 3HD)
        self.idx = torch.arange(1, B + 1, dtype=torch.int32, device=state.device)
        self.out = torch.empty(1, B, H, D, dtype=torch.bfloat16, device=state.device)

    def __call__(self, qkv, f, b, gate):
        B, H, D = self.B, self.H, self.D
        return self.mod.run_fused_kda_decode(
            qkv, self.weight, self.conv, f.view(1, B, H, D), b.view(1, B, H), self.A_log, self.dt_bias, self.idx,
            self.state, gate.view(B, H, D), self.norm_w, lower_bound=self.p.lower_bound, norm_eps=self.p.eps,
            output=self.out)

    def ours(self):
        """(out [B, HD], state [B, H, K, V], conv_state [B, 3HD, W-1]) in our layouts."""
        return (self.out.view(self.B, -1), self.state[1:].transpose(-1, -2).contiguous(), self.conv[1:].contiguous())
