"""KDA multi-token verification (speculative decoding, T = 2..8 positions per sequence) in one CuTe
DSL launch, state kept on chip across positions.

Per (sequence b, head h) one CTA of 256 threads loads the 128 x 128 fp32 start state into registers
once and runs the T positions in order (conv update + silu, q/k l2norm, decay gate, beta, delta rule,
gated output RMSNorm), writing after every position:
    out        [B, T, H*D] bf16
    state_hist [B, T, H, D, D] fp32   (the state after each position, for rollback/commit)
    conv_hist  [B, T, 3*H*D, 3] bf16  (the conv window after each position)
`state` and `conv_state` are read, never written. All activations of the T positions are
prefetched before the first position; positions share the per-position shared-memory scratch in
two alternating buffers, so each position costs two CTA barriers.
`lengths` [B] int32 in 1..T selects the ragged path: positions >= lengths[b] write nothing (their
out/hist entries are left untouched); None compiles the uniform-length specialization.

Floor per (b, h): state 64 KiB read once + T x 64 KiB state_hist written, conv 2,304 B read +
T x 2,304 B conv_hist written, T x (768 + 256 + 256 + 256 + 2) B activations. For H = 12, B = 1:
T = 4 -> 4.1 MB -> 0.97 us at 4.275 TB/s; T = 8 -> 7.5 MB -> 1.75 us (latency bound: the positions
are a sequential chain inside each CTA). The kernel is the same generator as the decode step
(`kda_decode.py`, `verify=True`), so the two cannot drift apart.

    kda_verify(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist,
               lengths=None, tile_v=128) -> out
"""
from .kda_decode import kda_verify, kda_verify_bytes

__all__ = ["kda_verify", "kda_verify_bytes"]
