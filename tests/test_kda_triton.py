"""Triton KDA kernels (decode, verify + commit, chunked prefill) against the fp64 reference.
Verify with a checkpoint c (state_hist: the state after every c-th position and the last) and the commit's
replay (a slot copy or up to c - 1 positions recomputed from the last slot) through the shared checker too.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; tests
marked `gpu` run the real shapes (D=128, 6/12/96 heads, B up to 64, every tile_v, T 1..8).

Tolerances (relative Frobenius norm against fp64 on fp64-upcast inputs/params/state):
  out (bf16)        1e-2: the output is rounded to bf16 (2^-9 relative per element with the GPU's
                    round-to-nearest, 2^-8 with the interpreter's truncating cast), ~2-5e-3 measured.
  fp32 state        1e-4: fp32 arithmetic over a D-long dot product and a few steps, ~1e-7 measured.
  bf16 state        2e-2: every step stores the state rounded to bf16 (2^-9 .. 2^-8 per element) and
                    the rounding compounds over T <= 8 steps.
  conv state / hist EXACT: they only shift bf16 inputs.
  prefill fp32 inverse 1e-4 on the state; bf16 inverse 1e-2 (A rounded to bf16 before the inverse).
"""
from __future__ import annotations

import pytest
import torch

from k3lab.ref.kda import kda_decode as ref_decode
from k3lab.ref.kda import kda_prefill_sequential, make_kda_inputs
from k3lab.ref.kda import kda_verify as ref_verify
from k3lab.harness.numerics import rel_norm_error

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL_OUT, TOL_S32, TOL_S16 = 1e-2, 1e-4, 2e-2
NAN = float("nan")


rel = rel_norm_error  # the one relative-error helper (NaN never passes a tolerance)


def tol_state(dt):
    return TOL_S32 if dt == torch.float32 else TOL_S16


def inputs(B, H, D, T=None, seed=0, dev=DEV):
    inp, p, st, cs = make_kda_inputs(B, H, D, T=T, seed=seed, device=dev)
    return inp, p, st, cs


def args64(inp):
    return [inp[k].double() for k in ("qkv", "f", "b", "gate")]


def args(inp):
    return [inp[k] for k in ("qkv", "f", "b", "gate")]


# ---- decode ------------------------------------------------------------------------------------

def _decode_check(B, H, D, tile_v, sdt, steps=2, seed=0, num_warps=None):
    from k3lab_kernels.triton.kda_decode import kda_decode

    _, p, st, cs = inputs(B, H, D, seed=seed)
    S, c = st.to(sdt).clone(), cs.clone()
    S64, c64 = S.double(), c.double()
    p64 = p.to(torch.float64)
    for step in range(steps):  # consecutive launches: the arrival counters must reset
        inp, *_ = inputs(B, H, D, seed=seed * 100 + step + 1)
        out = torch.full((B, H * D), NAN, dtype=torch.bfloat16, device=DEV)
        kda_decode(*args(inp), p, S, c, out, tile_v=tile_v, num_warps=num_warps)
        o64, S64, c64 = ref_decode(*args64(inp), p64, S64, c64)
        assert rel(out, o64) < TOL_OUT
        assert rel(S, S64) < tol_state(sdt)
        assert torch.equal(c.double(), c64), "conv_state must match exactly"
        S64 = S.double()  # re-anchor on the kernel's (possibly bf16) state: per-step error


@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tile_v", [4, 8, 16, 32])
def test_decode_tiles_small(tile_v, sdt):
    _decode_check(B=2, H=3, D=32, tile_v=tile_v, sdt=sdt, seed=tile_v)


@pytest.mark.parametrize("tile_v", [64, 128])
def test_decode_wide_tiles_d128(tile_v):
    _decode_check(B=1, H=2, D=128, tile_v=tile_v, sdt=torch.float32, steps=1, seed=7)


# ---- verify + commit ---------------------------------------------------------------------------

def _verify_check(B, H, D, T, tile_v, sdt, ragged, seed=0):
    from k3lab_kernels.triton.kda_verify import kda_verify

    inp, p, st, cs = inputs(B, H, D, T=T, seed=seed)
    S = st.to(sdt)
    S_before, c_before = S.clone(), cs.clone()
    out = torch.full((B, T, H * D), NAN, dtype=torch.bfloat16, device=DEV)
    sh = torch.full((B, T, H, D, D), NAN, dtype=sdt, device=DEV)
    chh = torch.full((B, T, 3 * H * D, 3), NAN, dtype=torch.bfloat16, device=DEV)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int32) if ragged else None
    if ragged:
        lens[0] = T  # one full-length row, the rest random
        lens = lens.to(DEV)
    kda_verify(*args(inp), p, S, cs, out, sh, chh, lengths=lens, tile_v=tile_v)
    o64, S64, c64 = ref_verify(*args64(inp), p.to(torch.float64), S.double(), cs.double())
    assert torch.equal(S, S_before) and torch.equal(cs, c_before), "verify must not modify state/conv_state"
    n = lens.tolist() if ragged else [T] * B
    for bb in range(B):
        k = n[bb]
        assert rel(out[bb, :k], o64[bb, :k]) < TOL_OUT
        assert rel(sh[bb, :k], S64[bb, :k]) < tol_state(sdt)
        assert torch.equal(chh[bb, :k].double(), c64[bb, :k]), "conv_hist must match exactly"
        # positions past the length are not computed: the poison is still there
        assert torch.isnan(out[bb, k:].float()).all()
        assert torch.isnan(sh[bb, k:].float()).all()
        assert torch.isnan(chh[bb, k:].float()).all()
    return inp, p, S, cs, sh, chh


@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
@pytest.mark.parametrize("tile_v", [4, 8, 16, 32])
def test_verify_tiles_small(tile_v, ragged):
    _verify_check(B=3, H=2, D=32, T=4, tile_v=tile_v, sdt=torch.float32, ragged=ragged, seed=tile_v)


@pytest.mark.parametrize("T", [1, 2, 5, 8])
def test_verify_T(T):
    _verify_check(B=2, H=2, D=16, T=T, tile_v=8, sdt=torch.float32, ragged=T > 1, seed=T)


@pytest.mark.parametrize("tile_v", [8, 32])
def test_verify_bf16_state(tile_v):
    _verify_check(B=2, H=2, D=32, T=3, tile_v=tile_v, sdt=torch.bfloat16, ragged=tile_v == 8, seed=5)


def test_commit_equals_decode_of_accepted():
    """Verify 4 positions, accept a prefix per sequence, commit; then it must equal running only the
    accepted tokens one by one with the decode kernel (same arithmetic: bit-identical is expected,
    1e-6 allowed)."""
    from k3lab_kernels.triton.kda_decode import kda_decode
    from k3lab_kernels.triton.kda_verify import commit, kda_verify

    B, H, D, T = 3, 2, 32, 4
    inp, p, st, cs = inputs(B, H, D, T=T, seed=11)
    out = torch.full((B, T, H * D), NAN, dtype=torch.bfloat16, device=DEV)
    sh = torch.full((B, T, H, D, D), NAN, device=DEV)
    chh = torch.full((B, T, 3 * H * D, 3), NAN, dtype=torch.bfloat16, device=DEV)
    kda_verify(*args(inp), p, st, cs, out, sh, chh, tile_v=8)
    n_acc = torch.tensor([2, 4, 1], dtype=torch.int32, device=DEV)
    S_c, c_c = st.clone(), cs.clone()
    commit(sh, chh, n_acc, S_c, c_c)
    for bb in range(B):
        S_d, c_d = st[bb:bb + 1].clone(), cs[bb:bb + 1].clone()
        for t in range(int(n_acc[bb])):
            o = torch.full((1, H * D), NAN, dtype=torch.bfloat16, device=DEV)
            kda_decode(*(x[bb:bb + 1, t].contiguous() for x in args(inp)), p, S_d, c_d, o, tile_v=16)
            assert rel(o, out[bb:bb + 1, t]) < 1e-2
        assert float((S_c[bb] - S_d[0]).abs().max()) < 1e-6
        assert torch.equal(c_c[bb], c_d[0])


# ---- verify checkpoints and the commit's replay ------------------------------------------------

def _ck_cases():
    """(T, c) for c in {1, 2, 4, T} at T 2, 4, 8, and c = 3 at T = 8 (slots at positions 2, 5, 7)."""
    out = [(T, c) for T in (2, 4, 8) for c in sorted({1, 2, 4, T}) if c <= T]
    return out + [(8, 3)]


@pytest.mark.parametrize("T,c", _ck_cases())
def test_verify_checkpoint_checker(T, c):
    """The shared checker on state_hist's slots (the fp64 reference's states at checkpoint_positions), uniform
    and ragged (a slot whose position is >= lengths[b] must stay untouched), two tiles a head and one."""
    from k3lab import registry
    from k3lab.harness import checker

    op = registry.get("kda_verify")
    for ragged, tile_v in ((False, 8), (True, 16)):
        case = op.case(heads=2, batch=3, D=16, T=T, ragged=ragged, checkpoint=c)
        res = checker.require(checker.check(op, case, backend="triton", options=dict(tile_v=tile_v), seed=T + c))
        assert res.errors["state_hist"]["rel_norm"] < 1e-5


@pytest.mark.parametrize("T,c", [(8, 2), (8, 4), (8, 8), (8, 3), (4, 2), (4, 4), (2, 2)])
@pytest.mark.parametrize("tile_v", [8, 16])
def test_commit_checkpoint_checker(T, c, tile_v):
    """The commit op through the shared checker: a batch of T sequences accepting 1..T positions (every slot
    copy and every replay length 1..c-1, from a slot and from the start state), state against the fp64 state at
    p = n_b - 1 within the verify's state tolerance (1e-4), conv_state bit-exact."""
    from k3lab import registry
    from k3lab.harness import checker

    op = registry.get("kda_commit")
    case = op.case(heads=2, batch=T, D=16, T=T, checkpoint=c, accepted="each")
    res = checker.require(checker.check(op, case, backend="triton", options=dict(tile_v=tile_v), seed=c + tile_v))
    assert res.ran[-1].op == "kda_commit" and "_kda_replay_kernel" in res.ran[-1].kernel
    assert res.errors["state"]["rel_norm"] < 1e-5


def test_commit_checkpoint_bf16_state():
    from k3lab import registry
    from k3lab.harness import checker

    op = registry.get("kda_commit")
    case = op.case(heads=2, batch=8, D=16, T=8, checkpoint=4, accepted="each", state_dtype="bf16")
    checker.require(checker.check(op, case, backend="triton", options=dict(tile_v=8), seed=2))


@pytest.mark.parametrize("c", [2, 4, pytest.param(8, marks=pytest.mark.slow)])  # 8: ~9 s on the interpreter
def test_verify_then_commit_every_accept(c):
    """The chain the decode step runs: the Triton verify with checkpoint c, then the Triton commit for every
    n_b in 1..T (sequence b accepts n_b = 1 + (b + shift) mod T), each time from the same start state. The
    committed state must match the fp64 state at p = n_b - 1 (relative norm < 1e-4, the verify's state
    tolerance; ~1e-7 measured) and the c = 1 commit's (max abs < 1e-5); conv_state bit-exact."""
    from k3lab_kernels.triton.kda_verify import commit, kda_verify

    B, H, D, T = 8, 2, 16, 8
    inp, p, st, cs = inputs(B, H, D, T=T, seed=40 + c)
    o64, S64, c64 = ref_verify(*args64(inp), p.to(torch.float64), st.double(), cs.double())
    out = torch.full((B, T, H * D), NAN, dtype=torch.bfloat16, device=DEV)
    sh1 = torch.full((B, T, H, D, D), NAN, device=DEV)
    shc = torch.full((B, -(-T // c), H, D, D), NAN, device=DEV)
    chh = torch.full((B, T, 3 * H * D, 3), NAN, dtype=torch.bfloat16, device=DEV)
    kda_verify(*args(inp), p, st, cs, out, sh1, chh, tile_v=8)
    kda_verify(*args(inp), p, st, cs, out, shc, chh, tile_v=8, checkpoint=c)
    idx = torch.arange(B, device=DEV)
    for shift in (0, 3):
        n = ((torch.arange(B) + shift) % T + 1).to(torch.int32).to(DEV)
        S1, c1, Sc, cc = st.clone(), cs.clone(), st.clone(), cs.clone()
        commit(sh1, chh, n, S1, c1)
        commit(shc, chh, n, Sc, cc, checkpoint=c, qkv=inp["qkv"], f=inp["f"], b=inp["b"], params=p, tile_v=8)
        assert rel(Sc, S64[idx, n.long() - 1]) < TOL_S32
        assert float((Sc - S1).abs().max()) < 1e-5
        assert torch.equal(cc, c1) and torch.equal(cc.double(), c64[idx, n.long() - 1])


@pytest.mark.parametrize("W", [2, 3, 5])
def test_conv_kernel_widths(W):
    """The conv window is a tuple of W 1-D column vectors: any kernel width W >= 2 (the model uses 4)."""
    from k3lab_kernels.triton.kda_decode import kda_decode
    from k3lab_kernels.triton.kda_verify import kda_verify

    B, H, D, T = 2, 2, 16, 3
    for tile_v in (8, 16):  # two tiles per head (scratch + last arriver) and one (direct)
        inp, p, st, cs = make_kda_inputs(B, H, D, W=W, seed=W, device=DEV)
        p64 = p.to(torch.float64)
        S, c = st.clone(), cs.clone()
        out = torch.full((B, H * D), NAN, dtype=torch.bfloat16, device=DEV)
        kda_decode(*args(inp), p, S, c, out, tile_v=tile_v)
        o64, S64, c64 = ref_decode(*args64(inp), p64, st.double(), cs.double())
        assert rel(out, o64) < TOL_OUT and rel(S, S64) < TOL_S32
        assert torch.equal(c.double(), c64)
        inp, p, st, cs = make_kda_inputs(B, H, D, T=T, W=W, seed=W + 1, device=DEV)
        out = torch.full((B, T, H * D), NAN, dtype=torch.bfloat16, device=DEV)
        sh = torch.full((B, T, H, D, D), NAN, device=DEV)
        chh = torch.full((B, T, 3 * H * D, W - 1), NAN, dtype=torch.bfloat16, device=DEV)
        kda_verify(*args(inp), p, st, cs, out, sh, chh, tile_v=tile_v)
        o64, S64, c64 = ref_verify(*args64(inp), p.to(torch.float64), st.double(), cs.double())
        assert rel(out, o64) < TOL_OUT and rel(sh, S64) < TOL_S32
        assert torch.equal(chh.double(), c64)


def test_one_tile_per_head_uses_no_scratch():
    """tile_v == D: the program holds the whole head, so no o scratch or arrival counter is allocated
    (the kernels' NT == 1 branch has no atomics and no scratch reload)."""
    from k3lab_kernels.triton import kda_decode as dec
    from k3lab_kernels.triton.kda_verify import kda_verify

    B, H, D, T = 1, 2, 16, 2
    dec._SCRATCH.clear()
    inp, p, st, cs = inputs(B, H, D, seed=21)
    out = torch.full((B, H * D), NAN, dtype=torch.bfloat16, device=DEV)
    dec.kda_decode(*args(inp), p, st, cs, out, tile_v=D)
    inp, p, st, cs = inputs(B, H, D, T=T, seed=22)
    out = torch.full((B, T, H * D), NAN, dtype=torch.bfloat16, device=DEV)
    sh = torch.full((B, T, H, D, D), NAN, device=DEV)
    chh = torch.full((B, T, 3 * H * D, 3), NAN, dtype=torch.bfloat16, device=DEV)
    kda_verify(*args(inp), p, st, cs, out, sh, chh, tile_v=D)
    assert not dec._SCRATCH, list(dec._SCRATCH)
    assert not torch.isnan(out.float()).any()


# ---- prefill -----------------------------------------------------------------------------------

@pytest.mark.parametrize("L", [1, 70, pytest.param(130, marks=pytest.mark.slow)])  # 130: three chunks (slow run)
@pytest.mark.parametrize("grouped", [False, True], ids=["seq", "grouped"])
@pytest.mark.parametrize("inverse", ["fp32", "bf16"])
def test_prefill(L, grouped, inverse):
    from k3lab_kernels.triton.kda_prefill import kda_prefill

    B, H, D = 2, 2, 32
    inp, p, st, cs = inputs(B, H, D, T=L, seed=L)
    S, c = st.clone(), cs.clone()
    out = torch.full((B, L, H * D), NAN, dtype=torch.bfloat16, device=DEV)
    kda_prefill(*args(inp), p, S, c, out, inverse=inverse, grouped=grouped)
    o64, S64, c64 = kda_prefill_sequential(*args64(inp), p.to(torch.float64), st.double(), cs.double())
    assert rel(out, o64) < TOL_OUT
    assert rel(S, S64) < (1e-4 if inverse == "fp32" else 1e-2)
    assert torch.equal(c.double(), c64)


def test_prefill_bf16_inverse_loses_information():
    """The bf16 inverse switch must actually round: its state error is visibly above the fp32 one."""
    from k3lab_kernels.triton.kda_prefill import kda_prefill

    B, H, D, L = 1, 2, 32, 128
    inp, p, st, cs = inputs(B, H, D, T=L, seed=3)
    _, S64, _ = kda_prefill_sequential(*args64(inp), p.to(torch.float64), st.double(), cs.double())
    errs = {}
    for inv in ("fp32", "bf16"):
        S, c = st.clone(), cs.clone()
        out = torch.empty((B, L, H * D), dtype=torch.bfloat16, device=DEV)
        kda_prefill(*args(inp), p, S, c, out, inverse=inv)
        errs[inv] = rel(S, S64)
    assert errs["bf16"] > 10 * errs["fp32"], errs


# ---- GPU: the real shapes ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tile_v", [4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("B,H", [(1, 12), (2, 6), (8, 12), (64, 12), (2, 96)])
def test_gpu_decode(B, H, tile_v, sdt):
    _decode_check(B, H, 128, tile_v, sdt, steps=2, seed=B + H)


@pytest.mark.gpu
@pytest.mark.parametrize("num_warps", [1, 2, 4, 8])
@pytest.mark.parametrize("tile_v", [8, 16, 32, 64, 128])
def test_gpu_decode_every_warp_count(tile_v, num_warps):
    """Every launch width the tuner may pick. Regression: with the in-place conv shift placed before the
    windows' last use, Triton 3.6 re-issued window loads after the shift at 2-4 warps (H200, state error
    up to 0.17 at B=64) while 1 warp and the CPU interpreter were correct."""
    if num_warps * 32 > 128 * tile_v:
        pytest.skip("more threads than state elements")
    _decode_check(64, 12, 128, tile_v, torch.float32, steps=2, seed=tile_v + num_warps, num_warps=num_warps)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_v", [4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 6, 7, 8])
def test_gpu_verify(T, tile_v):
    _verify_check(1, 12, 128, T, tile_v, torch.float32, ragged=False, seed=T)
    _verify_check(8, 12, 128, T, tile_v, torch.float32, ragged=True, seed=T)


@pytest.mark.gpu
@pytest.mark.parametrize("c", [2, 4, 8])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_gpu_verify_checkpoint(B, c):
    """The H200 shapes: 12 heads, T = 8, the Triton verify's slots (uniform and ragged) and the commit of every
    n_b through the shared checker."""
    from k3lab import registry
    from k3lab.harness import checker

    ver, com = registry.get("kda_verify"), registry.get("kda_commit")
    for ragged in (False, True):
        for tile_v in (8, 32, 128):
            checker.require(checker.check(ver, ver.case(heads=12, batch=B, T=8, ragged=ragged, checkpoint=c),
                                          backend="triton", options=dict(tile_v=tile_v), seed=B + c))
    for accepted in ("each", c - 1 if c > 1 else 1, 8):
        for tile_v in (8, 32):
            checker.require(checker.check(com, com.case(heads=12, batch=B, T=8, checkpoint=c, accepted=accepted),
                                          backend="triton", options=dict(tile_v=tile_v), seed=B + c))


@pytest.mark.gpu
@pytest.mark.parametrize("tile_v", [4, 32, 128])
def test_gpu_verify_bf16_and_heads(tile_v):
    _verify_check(2, 6, 128, 4, tile_v, torch.bfloat16, ragged=True, seed=1)
    _verify_check(2, 96, 128, 4, tile_v, torch.float32, ragged=True, seed=2)


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("inverse", ["fp32", "bf16"])
def test_gpu_prefill(grouped, inverse):
    from k3lab_kernels.triton.kda_prefill import kda_prefill

    B, H, D, L = 2, 12, 128, 300
    inp, p, st, cs = inputs(B, H, D, T=L, seed=9)
    S, c = st.clone(), cs.clone()
    out = torch.full((B, L, H * D), NAN, dtype=torch.bfloat16, device=DEV)
    kda_prefill(*args(inp), p, S, c, out, inverse=inverse, grouped=grouped)
    o64, S64, c64 = kda_prefill_sequential(*args64(inp), p.to(torch.float64), st.double(), cs.double())
    assert rel(out, o64) < TOL_OUT
    assert rel(S, S64) < (1e-4 if inverse == "fp32" else 1e-2)
    assert torch.equal(c.double(), c64)
