"""KDA / MLA / MoE layers, the AttnRes loop bookkeeping, the tiny stack, weights determinism."""
import pytest
import torch

from k3lab.config import ConfigError, preset
from k3lab.ref import layers as L
from k3lab.ref.dense import dense_mlp
from k3lab.ref.moe import ExpertWeight, moe_forward, moe_forward_tp
from k3lab.ref.stack import Stack
from k3lab.weights import make_kda_attn, make_layer, make_mla_attn, make_moe, make_stack, nbytes

D64 = torch.float64


def test_kda_layer_verify_equals_repeated_steps():
    view = preset("tiny", batch=2)
    w = make_kda_attn(view, 1, dtype=D64)
    g = torch.Generator().manual_seed(0)
    H, Dh = view.heads, view.cfg.kda_head_dim
    S0 = torch.randn(2, H, Dh, Dh, generator=g, dtype=D64) * 0.1
    C0 = torch.randn(2, 3 * H * Dh, 3, generator=g, dtype=D64)
    hs = torch.randn(2, 5, view.cfg.hidden_size, generator=g, dtype=D64)
    out, states, convs = L.kda_attention_verify(hs, w, S0, C0)
    S, C = S0, C0
    for t in range(5):
        o, S, C = L.kda_attention(hs[:, t], w, S, C)
        assert torch.allclose(o, out[:, t], rtol=0, atol=1e-12)
        assert torch.allclose(S, states[:, t], rtol=0, atol=1e-12)
        assert torch.allclose(C, convs[:, t], rtol=0, atol=1e-12)


def test_whole_layer_multi_position_equals_steps():
    view = preset("tiny", batch=2)
    bs = view.cfg.attnres_block_size
    for idx in (1, 3):  # a KDA layer and an MLA layer
        lw = make_layer(view, idx, dtype=D64)
        g = torch.Generator().manual_seed(idx)
        x = torch.randn(2, 4, view.cfg.hidden_size, generator=g, dtype=D64)
        blocks = [torch.randn(2, 4, view.cfg.hidden_size, generator=g, dtype=D64)]
        st1 = L.new_layer_state(lw, 2, 16, act_dtype=D64)
        st2 = L.new_layer_state(lw, 2, 16, act_dtype=D64)
        y_multi, _ = L.layer_step(x, blocks, lw, st1, block_size=bs)
        ys = [L.layer_step(x[:, t], [b[:, t] for b in blocks], lw, st2, block_size=bs)[0] for t in range(4)]
        assert torch.allclose(y_multi, torch.stack(ys, 1), rtol=0, atol=1e-11)


def test_attnres_block_bookkeeping():
    view = preset("tiny")
    cfg = view.cfg
    D = cfg.hidden_size
    lw = make_layer(view, 1, dtype=D64)
    for bs in (3, 12):
        x = torch.ones(1, D, dtype=D64)
        blocks = []
        for layer in range(25):
            x, blocks = L.attnres_layer(layer, x, blocks, lw, lambda h: 0.5 * h, lambda h: 0.25 * h, block_size=bs)
            assert len(blocks) == L.n_blocks_after(layer + 1, bs) == -(-(layer + 1) // bs)
    assert L.n_blocks_after(93, 12) == 8  # the final mix sees 8 blocks + x = 9 sources


def test_attnres_layer_follows_the_spec():
    """Layer 0 (block start, no history) and a mid-block layer, against the spec written out."""
    from k3lab.ref.attnres import attnres
    from k3lab.ref.rmsnorm import rms_norm
    view = preset("tiny")
    lw = make_layer(view, 1, dtype=D64)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 64, generator=g, dtype=D64)
    A = lambda h: torch.tanh(h) * 2
    M = lambda h: h ** 2 * 0.1
    # layer 0: B empty -> no first mix; a block starts with x
    y, B = L.attnres_layer(0, x, [], lw, A, M, block_size=3)
    a = A(rms_norm(x, lw.input_norm))
    m = M(rms_norm(attnres([x], a, lw.mlp_res_norm, lw.mlp_res_proj), lw.post_attn_norm))
    assert len(B) == 1 and torch.equal(B[0], x) and torch.allclose(y, a + m, atol=1e-14)
    # layer 1: mid-block, p continues from the prefix
    y2, B2 = L.attnres_layer(1, y, B, lw, A, M, block_size=3)
    h = attnres(B, y, lw.attn_res_norm, lw.attn_res_proj)
    p = y + A(rms_norm(h, lw.input_norm))
    m = M(rms_norm(attnres(B, p, lw.mlp_res_norm, lw.mlp_res_proj), lw.post_attn_norm))
    assert len(B2) == 1 and torch.allclose(y2, p + m, atol=1e-14)


def test_bf16_running_sum_is_stored_in_bf16():
    view = preset("tiny")
    lw = make_layer(view, 1)
    x = torch.randn(2, 64).bfloat16()
    y, B = L.attnres_layer(1, x, [x.clone()], lw, lambda h: h * 0.5, lambda h: h * 0.25, block_size=3)
    assert y.dtype == torch.bfloat16 and all(b.dtype == torch.bfloat16 for b in B)


def test_moe_tp_slices_sum_to_whole_and_formats():
    view = preset("tiny")
    whole = make_moe(view, 1, dtype=D64)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, view.cfg.hidden_size, generator=g, dtype=D64)
    ref = moe_forward(h, whole)
    for tp in (2, 4):
        v = preset("tiny").__class__(view.cfg, tp=tp)
        ranks = [make_moe(v, 1, rank=r, dtype=D64) for r in range(tp)]
        assert torch.allclose(moe_forward_tp(h, ranks), ref, rtol=0, atol=1e-12)
    # dense layer TP slices sum too
    dw = make_layer(view, 0, dtype=D64).mlp
    v2 = preset("tiny").__class__(view.cfg, tp=2)
    parts = [make_layer(v2, 0, rank=r, dtype=D64).mlp for r in range(2)]
    assert torch.allclose(sum(dense_mlp(h, p) for p in parts), dense_mlp(h, dw), atol=1e-12)
    # quantized experts stay close to the dense ones, and dequantize exactly by hand
    for fmt, tol in (("fp8", 0.1), ("mxfp4", 0.3)):
        q = make_moe(view, 1, dtype=D64, expert_dtype=fmt)
        assert q.w1.fmt == fmt
        assert (moe_forward(h, q) - ref).norm() / ref.norm() < tol
    e = ExpertWeight.quantize(torch.tensor([[[1.0, -2.0], [448.0, 0.5]]]), "fp8")
    assert torch.allclose(e.dequant(torch.float32), torch.tensor([[[1.0, -2.0], [448.0, 0.5]]]), rtol=0.07)


def test_weights_deterministic_and_independent_of_what_else_is_built():
    view = preset("tiny")
    a = make_layer(view, 5, seed=7, dtype=torch.float32)
    make_layer(view, 2, seed=7)
    b = make_stack(view, seed=7, dtype=torch.float32).layers[5]
    for name in ("w_qkv", "w_o", "w_fa"):
        assert torch.equal(getattr(a.attn, name), getattr(b.attn, name))
    assert torch.equal(a.mlp.w1.data, b.mlp.w1.data)
    c = make_layer(view, 5, seed=8, dtype=torch.float32)
    assert not torch.equal(a.attn.w_qkv, c.attn.w_qkv)
    # TP rank slices are slices of the whole; a few experts are the first of the pool
    v2 = view.__class__(view.cfg, tp=2)
    r1 = make_kda_attn(v2, 5, seed=7, rank=1, dtype=torch.float32)
    HD = v2.kda_width
    assert torch.equal(r1.w_g, a.attn.w_g[HD:])
    assert torch.equal(r1.w_o, a.attn.w_o[:, HD:])
    few = make_moe(view, 5, seed=7, n_experts=4, dtype=torch.float32)
    assert torch.equal(few.w2.data, a.mlp.w2.data[:4]) and torch.equal(few.router.w, a.mlp.router.w[:4])
    m2 = make_mla_attn(v2, 3, rank=1, dtype=torch.float32)
    m1 = make_mla_attn(view, 3, dtype=torch.float32)
    assert torch.equal(m2.w_uk, m1.w_uk[2:]) and torch.equal(m2.w_dq, m1.w_dq)
    with pytest.raises(ConfigError, match="rank"):
        make_kda_attn(v2, 1, rank=2)
    with pytest.raises(ConfigError, match="n_experts"):
        make_moe(view, 1, n_experts=2)


def test_tp8_layer_byte_counts_match_the_spec():
    view = preset("tp8")
    kda = make_kda_attn(view, 1)
    mla = make_mla_attn(view, 3)
    assert kda.w_qkv.shape == (3 * 1536, 7168) and kda.w_o.shape == (7168, 1536)
    assert 110e6 < nbytes(kda) < 114e6  # docs/MODEL.md: about 112 MB
    assert 83e6 < nbytes(mla) < 86e6  # about 84 MB
    assert 29e6 < nbytes(mla.w_dq) + nbytes(mla.w_dkv) < 31e6  # 30 MB of q and kv down


def test_tiny_stack_runs_deterministically():
    view = preset("tiny", batch=2)
    out = []
    for _ in range(2):
        st = Stack(make_stack(view, seed=3), batch=2)
        toks, logits = st.generate(torch.tensor([1, 2]), 12)
        out.append((toks, logits))
        assert st.last_blocks == -(-view.cfg.num_hidden_layers // view.cfg.attnres_block_size)
        assert logits.shape == (2, 12, view.cfg.vocab_size) and torch.isfinite(logits).all()
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    # the MLA caches and KDA states moved
    assert int(st.states[3].lengths[0]) == 12 and st.states[1].state.abs().sum() > 0


def test_tiny_stack_bf16_tracks_fp64():
    # n_experts = top_k: every expert is chosen, so no routing decision can flip between bf16 and fp64
    # (with 16 experts a flip at a near tie changes a layer's output by tens of percent, legitimately)
    view = preset("tiny", batch=1)
    toks = torch.tensor([[5, 9, 33, 7, 100, 2]])
    E = view.cfg.num_experts_per_tok
    lg64 = Stack(make_stack(view, seed=1, dtype=D64, n_experts=E), batch=1).run(toks)
    lg16 = Stack(make_stack(view, seed=1, n_experts=E), batch=1).run(toks)
    assert (lg16.double() - lg64).norm() / lg64.norm() < 0.06
    lg8 = Stack(make_stack(view, seed=1, n_experts=E), batch=1, kv_dtype="fp8").run(toks)
    assert (lg8.double() - lg64).norm() / lg64.norm() < 0.1
