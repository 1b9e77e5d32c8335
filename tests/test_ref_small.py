"""Hand-written checks of the small references: RMSNorm, SiTU, AttnRes (explicit loops), router, MXFP4."""
import math

import pytest
import torch

from k3lab import mxfp4
from k3lab.ref.attnres import attnres, attnres_norm, attnres_weights
from k3lab.ref.rmsnorm import rms_norm
from k3lab.ref.router import RouterWeights, route
from k3lab.ref.situ import GLUWeights, situ, situ_glu_mlp

D64 = torch.float64


def test_rmsnorm_by_hand():
    x = torch.tensor([[3.0, 4.0]], dtype=D64)
    ms = (9 + 16) / 2
    assert torch.allclose(rms_norm(x, None, 0.0), x / math.sqrt(ms))
    w = torch.tensor([2.0, 0.5], dtype=D64)
    assert torch.allclose(rms_norm(x, w, 1e-6), x / math.sqrt(ms + 1e-6) * w)
    assert rms_norm(x.to(torch.bfloat16), w).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(3, dtype=D64))


@pytest.mark.parametrize("g,u", [(0.0, 1.0), (1.0, 2.0), (-3.0, 0.5), (10.0, 100.0), (-10.0, -40.0)])
def test_situ_points(g, u):
    sig = 1 / (1 + math.exp(-g))
    want = 4 * math.tanh(g / 4) * sig * 25 * math.tanh(u / 25)
    got = situ(torch.tensor(g, dtype=D64), torch.tensor(u, dtype=D64))
    assert abs(float(got) - want) < 1e-12


def test_situ_limits_and_mlp():
    # the gate branch saturates at b1 = 4 for large g, the up branch at b2 = 25
    big = situ(torch.tensor(50.0, dtype=D64), torch.tensor(1e4, dtype=D64))
    assert abs(float(big) - 4 * 25) < 1e-8
    g = torch.Generator().manual_seed(0)
    w = GLUWeights(torch.randn(5, 3, generator=g, dtype=D64), torch.randn(5, 3, generator=g, dtype=D64),
                   torch.randn(3, 5, generator=g, dtype=D64))
    x = torch.randn(2, 3, generator=g, dtype=D64)
    ref = torch.zeros(2, 3, dtype=D64)
    for b in range(2):
        for o in range(3):
            for i in range(5):
                gi = sum(w.w1[i, k] * x[b, k] for k in range(3))
                ui = sum(w.w3[i, k] * x[b, k] for k in range(3))
                ref[b, o] += w.w2[o, i] * situ(gi, ui)
    assert torch.allclose(situ_glu_mlp(x, w), ref, atol=1e-12)


def test_attnres_two_sources_by_hand():
    g = torch.Generator().manual_seed(1)
    D = 6
    b1 = torch.randn(1, D, generator=g, dtype=D64)
    p = torch.randn(1, D, generator=g, dtype=D64) * 3
    wn = 1 + 0.1 * torch.randn(D, generator=g, dtype=D64)
    wp = torch.randn(D, generator=g, dtype=D64)
    eps = 1e-6
    scores = []
    for s in (b1[0], p[0]):
        ms = sum(float(s[d]) ** 2 for d in range(D)) / D
        scores.append(sum(float(s[d]) / math.sqrt(ms + eps) * float(wn[d]) * float(wp[d]) for d in range(D)))
    m = max(scores)
    e = [math.exp(sc - m) for sc in scores]
    a = [v / sum(e) for v in e]
    want = [a[0] * float(b1[0, d]) + a[1] * float(p[0, d]) for d in range(D)]
    got = attnres([b1], p, wn, wp, eps)
    assert torch.allclose(got[0], torch.tensor(want, dtype=D64), atol=1e-12)
    assert torch.allclose(attnres_weights([b1], p, wn, wp, eps)[0], torch.tensor(a, dtype=D64), atol=1e-12)


def test_attnres_precision_and_single_source():
    g = torch.Generator().manual_seed(2)
    D = 16
    blocks = [torch.randn(3, D, generator=g).bfloat16() for _ in range(4)]
    p = torch.randn(3, D, generator=g).bfloat16()
    wn, wp = torch.ones(D).bfloat16(), torch.randn(D, generator=g).bfloat16()
    mix = attnres(blocks, p, wn, wp)
    assert mix.dtype == torch.float32  # the mix stays in fp32 for the following norm
    mix64 = attnres([b.double() for b in blocks], p.double(), wn.double(), wp.double())
    assert torch.allclose(mix.double(), mix64, atol=1e-5)
    # one source: softmax is 1 and the mix is the source itself
    assert torch.equal(attnres([], p, wn, wp), p.float())
    _, normed = attnres_norm(blocks, p, wn, wp, torch.ones(D).bfloat16())
    assert normed.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="source 0"):
        attnres([torch.zeros(2, D)], p, wn, wp)


def test_router_biased_choice_unbiased_weights():
    D, E = 4, 6
    h = torch.tensor([[1.0, 0, 0, 0]], dtype=D64)
    w = torch.zeros(E, D, dtype=D64)
    w[:, 0] = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0])  # scores fall with e
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 5.0], dtype=D64)  # lifts the worst expert into the top 2
    rw = RouterWeights(w, bias, top_k=2, scaling=2.5)
    idx, wts, _s = route(h, rw)
    assert idx.tolist() == [[5, 0]]
    sig = [1 / (1 + math.exp(-v)) for v in (3.0, 2.0, 1.0, 0.0, -1.0, -2.0)]
    want = [sig[5] / (sig[5] + sig[0]) * 2.5, sig[0] / (sig[5] + sig[0]) * 2.5]
    assert torch.allclose(wts[0], torch.tensor(want, dtype=D64), atol=1e-12)
    assert abs(float(wts.sum()) - 2.5) < 1e-12


# ---- MXFP4 ---------------------------------------------------------------------------------------

def test_e2m1_round_to_nearest_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 0.26, -0.74, -6.5])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.5, -0.5, -6.0])
    assert torch.equal(mxfp4.e2m1_decode(mxfp4.e2m1_encode(x)), want)


def test_mxfp4_exact_on_grid():
    g = torch.Generator().manual_seed(3)
    grid = torch.tensor(mxfp4.E2M1_VALUES)
    codes = torch.randint(0, 8, (4, 8, 64), generator=g)
    sign = torch.where(torch.rand(4, 8, 64, generator=g) < 0.5, -1.0, 1.0)
    exps = torch.randint(-20, 20, (4, 8, 2, 1), generator=g).float()
    w = (sign * grid[codes]).unflatten(-1, (2, 32))
    w[..., 0] = 6.0  # the block max sets the scale: amax 6 -> X = 2^(2-2) = 1 before the exponent shift
    w = (w * torch.exp2(exps)).flatten(-2)
    packed, scales = mxfp4.pack_mxfp4(w)
    assert packed.shape == (4, 8, 32) and scales.shape == (4, 8, 2)
    assert packed.dtype == scales.dtype == torch.uint8
    assert torch.equal(mxfp4.unpack_mxfp4(packed, scales), w)
    # nibble order: element 0 in the low nibble
    one = torch.zeros(1, 32)
    one[0, 0], one[0, 1] = 1.0, 6.0
    p, s = mxfp4.pack_mxfp4(one)
    assert int(p[0, 0]) == (7 << 4) | 2 and int(s[0, 0]) == 127  # scale 2^0


def test_mxfp4_bounded_error_and_errors():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 256, generator=g) * torch.exp2(torch.randint(-8, 8, (16, 1), generator=g).float())
    packed, scales = mxfp4.pack_mxfp4(w)
    back = mxfp4.unpack_mxfp4(packed, scales)
    X = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    # half a grid step: X/4 below 2X, X/2 below 4X, X up to 6X; amax/X < 8 so saturation adds < 2X
    a = w.abs() / X
    bound = torch.where(a < 2, X / 4, torch.where(a < 4, X / 2, X))
    sat = (w.abs() - 6 * X).clamp_min(0)
    assert bool(((back - w).abs() <= bound + sat + 1e-7).all())
    assert mxfp4.mxfp4_nbytes((16, 256)) == packed.numel() + scales.numel()
    assert torch.equal(mxfp4.unpack_mxfp4(*mxfp4.pack_mxfp4(torch.zeros(2, 32))), torch.zeros(2, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.pack_mxfp4(torch.zeros(2, 48))


def test_reference_router_breaks_ties_by_the_lower_expert_id():
    """Every biased score equal (zero router weights and bias): the reference takes experts 0..k-1, the router
    kernel's rule (k3lab.ops.trunk); a raised bias on expert 7 puts it first."""
    E, k = 40, 6
    w = RouterWeights(torch.zeros(E, 8, dtype=torch.float64), torch.zeros(E, dtype=torch.float64), top_k=k)
    idx, wts, _ = route(torch.randn(3, 8, dtype=torch.float64), w)
    assert idx.tolist() == [list(range(k))] * 3 and torch.allclose(wts, torch.full_like(wts, 1 / k))
    w.e_bias[7] = 0.5
    idx, _, _ = route(torch.randn(2, 8, dtype=torch.float64), w)
    assert idx.tolist() == [[7, 0, 1, 2, 3, 4]] * 2
