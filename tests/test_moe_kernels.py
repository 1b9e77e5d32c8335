"""Triton MoE expert kernel (k3lab_kernels.triton.moe_experts) through the shared checker (fp64 reference on the
dequantized weights, output NaN-poisoned, inputs unchanged) at small shapes under TRITON_INTERPRET=1: every
weight format, batch 1 and odd batches, ragged routing (an expert every token chose, experts with many, one and
no tokens), groups larger than the kernel's token tile, TP8 and TP16 slices; the MXFP4 dequantization bit-exact
against k3lab.mxfp4; argument errors by name. GPU tests run K3's sizes (896 experts, latent 3584) and a CUDA
graph capture. Tolerances and their reasons: k3lab.ops.moe."""
from __future__ import annotations

import pytest
import torch

from k3lab import mxfp4, registry, routing
from k3lab.components import moe as c_moe
from k3lab.harness import checker
from k3lab.ops import moe as ops_moe
from k3lab.switches import BackendUnavailable, SwitchError

OP = registry.get("moe_experts")
K3 = dict(latent=3584, inter=3072, n_experts=896, top_k=16)
FORMATS = ("bf16", "fp8", "mxfp4")


def _check(backend="triton", options=None, seed=0, **shape):
    res = checker.require(checker.check(OP, OP.case(**shape), backend=backend, options=options or {}, seed=seed))
    assert res.ran and res.ran[-1].backend == backend
    return res


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("batch,path", [(1, "gemv"), (5, "grouped")])
def test_formats_and_batches(dtype, batch, path):
    """Each path in each format (the kernel's rule picks by format and batch: `default_path`); MXFP4's few-token
    path is simt (one token a pass at batch 1)."""
    path = "simt" if (dtype, path) == ("mxfp4", "gemv") else path
    res = _check(dtype=dtype, batch=batch, options=dict(path=path))
    assert res.ran[-1].options["path"] == path


@pytest.mark.parametrize("batch,routing,tp", [(3, "uniform", 1), (6, "ragged", 1), (19, "same16", 2)])
def test_tc_path(batch, routing, tp):
    """The MXFP4 tensor-core path on the kernel layout (`tc`): odd batches, ragged routing (an expert every token
    chose, experts with none), a group larger than the 16-token tile (same16 at 19 tokens), a TP slice."""
    res = _check(dtype="mxfp4", batch=batch, routing=routing, tp=tp, options=dict(path="tc"))
    assert res.ran[-1].options["path"] == "tc"


def test_tc_path_leaders_list():
    """The tc path over the leaders' list (`leaders=True`): the programs past the count exit, the leaders run;
    ragged routing at an odd batch (the list's buffers, reset by the prologue, are checked by the simt path's
    test_simt_tickets_over_leaders)."""
    res = _check(dtype="mxfp4", batch=7, routing="ragged", tp=1, options=dict(path="tc", leaders=True))
    assert res.ran[-1].options["leaders"] is True


def test_tc_path_is_the_rule_above_64_tokens():
    res = _check(dtype="mxfp4", batch=65, routing="uniform", tp=1, latent=64, inter=64)
    assert res.ran[-1].options["path"] == "tc" and "rule" in res.ran[-1].notes


def test_tc_path_refusals():
    d = OP.make_inputs(OP.case(dtype="bf16", batch=2), 0, "cpu")
    with pytest.raises(ValueError, match="'path'"):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="triton", path="tc")
    d = OP.make_inputs(OP.case(dtype="mxfp4", batch=2), 0, "cpu")  # I = 32: not a multiple of 64
    with pytest.raises(ValueError, match="'path'.*I=32"):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="triton", path="tc")
    d = OP.make_inputs(OP.case(dtype="mxfp4", batch=2, tp=1), 0, "cpu")
    with pytest.raises(ValueError, match="'block_n'"):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="triton", path="tc", block_n=32)


@pytest.mark.parametrize("dtype", FORMATS)
def test_ragged_routing(dtype):
    """Expert 0 chosen by every token, 1..3 by most, 4 by none, the rest by one or none."""
    inp = OP.make_inputs(OP.case(dtype=dtype, batch=6, routing="ragged"), 0, "cpu")
    idx = inp["idx"]
    assert bool((idx == 0).any(1).all()) and not bool((idx == 4).any())
    counts = torch.bincount(idx.flatten(), minlength=24)
    assert counts.max() == 6 and (counts == 1).any() and (counts == 0).any()
    # MXFP4: the simt path, two tokens a pass (expert 0's six members take three), persistent (two programs a
    # multiprocessor); bf16, fp8: gemv (grouped: test_tp16_and_blocks)
    opts = dict(path="simt", block_t=2, persist=2, block_n=32) if dtype == "mxfp4" else dict(path="gemv")
    _check(dtype=dtype, batch=6, routing="ragged", options=opts)


@pytest.mark.parametrize("dtype", FORMATS)
def test_same_experts_for_every_token(dtype):
    """Every token chooses the same top-k: each expert runs once with all tokens (one tile of 16 at batch 5;
    at batch 19 a second tile, block_t 16)."""
    inp = OP.make_inputs(OP.case(dtype=dtype, batch=5, routing="same16"), 0, "cpu")
    assert torch.unique(inp["idx"]).numel() == 4
    _check(dtype=dtype, batch=5, routing="same16")
    if dtype == "bf16":
        _check(dtype=dtype, batch=19, routing="same16", options=dict(block_t=16))


def test_batch_one_repeated_id():
    """Batch 1 on the simt path takes each pair as its own group: an expert id repeated in the token's row (not
    what a top-k router makes, but a caller may pass it) adds that expert twice, each with its own weight, as the
    reference does."""
    inp = OP.make_inputs(OP.case(dtype="mxfp4", batch=1), 0, "cpu")
    idx = inp["idx"].clone()
    idx[0, 1] = idx[0, 0]
    ran: list = []
    y = c_moe.experts(inp["z"], idx, inp["weights_k"], inp["moe"], backend="triton", path="simt", ran=ran)
    ref = c_moe.experts(inp["z"], idx, inp["weights_k"], inp["moe"], backend="reference")
    assert torch.isfinite(y).all() and "path simt" in ran[0].notes
    assert float((y - ref).norm() / ref.norm()) < 1e-2  # the simt tolerance (module docstring: f16 products)


def test_simt_tickets_over_leaders():
    """`leaders` (the default from batch 16): a one-program prologue lists the leading pairs and the items run over
    them only; ragged routing (an expert chosen by every token, one by none), two tokens a pass, persistent and not,
    twice in a row (its per-expert minima are reset by the kernel), and batch 1 with a repeated id (the groups of
    one are off with it); off below the default's batch."""
    from k3lab_kernels.triton import moe_experts as kern

    for _ in range(2):
        _check(dtype="mxfp4", batch=6, routing="ragged",
               options=dict(path="simt", block_t=2, persist=2, block_n=32, leaders=True))
    _check(dtype="mxfp4", batch=5, routing="same16", options=dict(path="simt", persist=0, leaders=True))
    _check(dtype="mxfp4", batch=1, options=dict(path="simt", leaders=True))
    first = next(iter(kern._leader_ws.values()))[0]
    assert bool((first == kern.LEAD_BIG).all())
    inp = OP.make_inputs(OP.case(dtype="mxfp4", batch=1), 3, "cpu")
    idx = inp["idx"].clone()
    idx[0, 1] = idx[0, 0]
    ran: list = []
    y = c_moe.experts(inp["z"], idx, inp["weights_k"], inp["moe"], backend="triton", path="simt", leaders=True,
                      ran=ran)
    ref = c_moe.experts(inp["z"], idx, inp["weights_k"], inp["moe"], backend="reference")
    assert ran[0].options["leaders"] is True and float((y - ref).norm() / ref.norm()) < 1e-2
    ran = []
    c_moe.experts(inp["z"], inp["idx"], inp["weights_k"], inp["moe"], backend="triton", path="simt", ran=ran)
    assert ran[0].options["leaders"] is False and ran[0].options["maxnreg"] is None  # batch 1: the kernel's rule
    with pytest.raises(c_moe.MoEArgumentError, match="'leaders'"):
        c_moe.experts(inp["z"], inp["idx"], inp["weights_k"], inp["moe"], backend="triton", path="grouped",
                      leaders=True)


def test_simt_wait_per_expert():
    """`wait="expert"`: a role-B item waits for its own pair's role-A items and the y-zeroing ones, not every A item;
    the pairs' counters are zeroed by the last program (checked by running twice and reading the workspace back):
    batch 1 (groups of one), ragged routing persistent with two tokens a pass, the leaders' list, more latent than
    one zeroing item covers; 'wait' is refused off the simt path and for another value, by name."""
    from k3lab_kernels.triton import moe_experts as kern

    for _ in range(2):
        _check(dtype="mxfp4", batch=1, options=dict(path="simt", wait="expert"))
    _check(dtype="mxfp4", batch=6, routing="ragged", options=dict(path="simt", block_t=2, persist=2, block_n=32,
                                                                   wait="expert"))
    _check(dtype="mxfp4", batch=5, routing="same16", options=dict(path="simt", persist=0, leaders=True,
                                                                   wait="expert"))
    for key, (ws, _act) in kern._workspaces.items():
        assert key[1] != "simt" or int(ws.abs().sum()) == 0  # tickets, counters, the pairs' counters: all zero
    inp = OP.make_inputs(OP.case(dtype="mxfp4", batch=1), 0, "cpu")
    ran: list = []
    c_moe.experts(inp["z"], inp["idx"], inp["weights_k"], inp["moe"], backend="triton", path="simt", ran=ran)
    assert ran[0].options["wait"] == kern.default_blocks(1, 4, 256, 64, "mxfp4", "simt")["wait"]
    for kw in (dict(path="grouped", wait="expert"), dict(path="simt", wait="some")):
        with pytest.raises(c_moe.MoEArgumentError, match="'wait'"):
            c_moe.experts(inp["z"], inp["idx"], inp["weights_k"], inp["moe"], backend="triton", **kw)


_TTGIR = """#blocked = #ttg.blocked<{sizePerThread = [1, 1, 4], threadsPerWarp = [8, 4, 1], warpsPerCTA = [2, 1, 1], \
order = [2, 1, 0]}>
#blocked3 = #ttg.blocked<{sizePerThread = [1, 1, %d], threadsPerWarp = [1, 8, 4], warpsPerCTA = [1, 2, 1], \
order = [2, 0, 1]}>
    %%a = tt.elementwise_inline_asm "..." {constraints = "...", packed_element = 4 : i32, pure = true} %%w, %%acc : \
tensor<16x16x4xi32, #blocked3>, tensor<16x16x4xf32, #blocked3> -> tensor<16x16x4xf32, #blocked3>
    %%b = tt.elementwise_inline_asm "..." {constraints = "...", packed_element = 4 : i32, pure = true} %%v : \
tensor<128x4x4xi32, #blocked> -> tensor<128x4x4xf32, #blocked>
"""


def test_pack4_layout_guard():
    """The packed PTX assumes each thread holds a block's four words in four consecutive registers; the guard reads
    the compiled TTGIR (here: the layouts Triton 3.6 chose for the w1/w3 tile at 2 warps, [1, 1, 1] along the
    words, which gave wrong sums on the H200) and the launcher refuses such a kernel instead of returning its sums."""
    from k3lab_kernels.triton import moe_experts as kern

    bad = kern.pack4_layout_problems(_TTGIR % 1)
    assert {b[0] for b in bad} == {"16x16x4xi32", "16x16x4xf32"}  # the 128x4x4 operands are laid out right
    assert kern.pack4_layout_problems(_TTGIR % 4) == []

    class Fake:
        asm = {"ttgir": _TTGIR % 1}
        hash = "fake-2-warps"
    with pytest.raises(RuntimeError, match="splits a block's four words"):
        kern._require_pack4_layout(Fake(), dict(num_warps=2))
    kern._require_pack4_layout(None, {})  # the interpreter's launch returns no compiled kernel: nothing to check


@pytest.mark.parametrize("dtype", FORMATS)
def test_tp16_and_blocks(dtype):
    opts = dict(block_n=32, block_k=64 if dtype == "mxfp4" else 32, num_warps=4)
    if dtype == "mxfp4":  # the rule's path (simt), one token a pass
        opts["block_t"] = 1
    _check(dtype=dtype, batch=4, tp=16, inter=512, routing="ragged", options=opts)


def test_int32_ids_and_auto_is_reference_on_cpu():
    inp = OP.make_inputs(OP.case(batch=3), 0, "cpu")
    ran: list = []
    y = c_moe.experts(inp["z"], inp["idx"].int(), inp["weights_k"], inp["moe"], backend="triton", ran=ran)
    y_ref = c_moe.experts(inp["z"].double(), inp["idx"], inp["weights_k"].double(), inp["moe"])
    assert (y.double() - y_ref).norm() / y_ref.norm() < ops_moe.TOL
    c_moe.experts(inp["z"], inp["idx"], inp["weights_k"], inp["moe"], backend="auto", ran=ran)
    assert ran[0].backend == "triton" and ran[1].backend == "reference"


# ---- MXFP4 dequantization -------------------------------------------------------------------------------

def test_mxfp4_dequant_bit_exact():
    """The simt path's in-register dequantization (its kernel layout, decode and block factor) against
    k3lab.mxfp4.unpack_mxfp4: every byte value under every scale 0..240 (the exact window reaches 246 in the
    kernel's own factor), and quantized weights across 11 decades; the layout round-trips."""
    from k3lab_kernels.triton.moe_experts import mxfp4_dequant_simt

    g = torch.Generator().manual_seed(0)
    p = torch.arange(256, dtype=torch.uint8).repeat(16, 2)  # every code pair
    kl = mxfp4.to_kernel_layout(p)
    assert kl.dtype == torch.int32 and kl.shape == (16, 128) and torch.equal(mxfp4.from_kernel_layout(kl), p)
    s = torch.randint(0, 241, (16, 32), generator=g, dtype=torch.uint8)
    s[0, :2] = torch.tensor([0, 240], dtype=torch.uint8)
    got, want = mxfp4_dequant_simt(kl, s), mxfp4.unpack_mxfp4(p, s)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # signed zeros too
    w = torch.randn(32, 256, generator=g) * torch.logspace(-8, 3, 32).unsqueeze(1)
    p, s = mxfp4.pack_mxfp4(w)
    assert torch.equal(mxfp4_dequant_simt(mxfp4.to_kernel_layout(p), s), mxfp4.unpack_mxfp4(p, s))


def test_kernel_layout_cache():
    """The component converts an MXFP4 stack to the simt layout once and again only after an in-place change."""
    m = OP.make_inputs(OP.case(batch=1, dtype="mxfp4"), 0, "cpu")["moe"]
    a = c_moe.kernel_layout(m.w2)
    assert c_moe.kernel_layout(m.w2) is a and torch.equal(mxfp4.from_kernel_layout(a), m.w2.data)
    m.w2.data[0, 0, 0] ^= 1
    b = c_moe.kernel_layout(m.w2)
    m.w2.data[0, 0, 0] ^= 1
    assert b is not a and torch.equal(mxfp4.from_kernel_layout(b)[0, 0, 0], m.w2.data[0, 0, 0] ^ 1)
    with pytest.raises(ValueError, match="'packed'"):
        mxfp4.to_kernel_layout(torch.zeros(2, 3, dtype=torch.uint8))
    # the grouped up kernel's copy: quad-transposed (word 4 u + t of each 16 -> 4 t + u), kept beside the plain one
    w1 = OP.make_inputs(OP.case(batch=1, dtype="mxfp4", latent=256, inter=64, n_experts=4), 0, "cpu")["moe"].w1
    q = c_moe.kernel_layout(w1, quad=True)
    assert c_moe.kernel_layout(w1, quad=True) is q and q is not c_moe.kernel_layout(w1)
    plain = c_moe.kernel_layout(w1)
    assert torch.equal(mxfp4.quad_transpose(q), plain)  # its own inverse
    assert torch.equal(q[..., 1], plain[..., 4]) and torch.equal(q[..., 4 + 2], plain[..., 4 * 2 + 1])
    with pytest.raises(ValueError, match="'words'.*K % 128"):
        mxfp4.quad_transpose(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="quad=True.*K % 128"):
        mxfp4.to_kernel_layout(torch.zeros(2, 32, dtype=torch.uint8), quad=True)
    big = torch.randint(0, 256, (3, 12000, 128), dtype=torch.uint8)  # two conversion slices of 32768 rows
    assert torch.equal(mxfp4.to_kernel_layout(big, quad=True), mxfp4.quad_transpose(mxfp4.to_kernel_layout(big)))


# ---- argument errors -----------------------------------------------------------------------------------

def _inp(dtype="bf16"):
    return OP.make_inputs(OP.case(batch=2, dtype=dtype), 0, "cpu")


@pytest.mark.parametrize("name,change", [
    ("z", lambda d: dict(d, z=d["z"].float())),
    ("idx", lambda d: dict(d, idx=d["idx"].float())),
    ("weights_k", lambda d: dict(d, weights_k=d["weights_k"].double())),
    ("out", lambda d: dict(d, y=torch.empty(2, 7))),
    ("out", lambda d: dict(d, y=torch.empty(2, 64, dtype=torch.float64))),
])
def test_triton_argument_errors(name, change):
    d = change(_inp())
    with pytest.raises(ValueError, match=f"'{name}'"):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="triton", out=d["y"])


@pytest.mark.parametrize("knob,value,dtype", [("block_n", 48, "bf16"), ("block_n", 16, "mxfp4"),
                                              ("block_t", 3, "mxfp4"), ("num_warps", 2, "mxfp4"),
                                              ("block_k", 96, "bf16"), ("block_t", 8, "bf16"),
                                              ("num_warps", 3, "bf16"), ("num_stages", 9, "bf16"),
                                              ("path", "fast", "bf16")])
def test_knob_errors(knob, value, dtype):
    d = _inp(dtype)
    kw = {knob: value} if knob in ("path", "block_n") else {knob: value, "path": "gemv"}
    if dtype == "mxfp4" and knob in ("block_t", "num_warps"):  # simt: 2 warps gave wrong sums on the H200
        kw["path"] = "simt"
    if knob == "block_n":
        kw["path"] = "grouped"  # block_n 16 is the gemv path's, not MXFP4's on the grouped path
    with pytest.raises(c_moe.MoEArgumentError, match=f"'{knob}'"):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="triton", **kw)
    if knob != "path":
        return
    big = OP.make_inputs(OP.case(batch=17), 0, "cpu")  # the gemv path holds at most 16 tokens
    with pytest.raises(c_moe.MoEArgumentError, match="'path'"):
        c_moe.experts(big["z"], big["idx"], big["weights_k"], big["moe"], backend="triton", path="gemv")
    with pytest.raises(c_moe.MoEArgumentError, match="'path'"):  # simt: MXFP4 only
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="triton", path="simt")
    m = _inp("mxfp4")
    with pytest.raises(c_moe.MoEArgumentError, match="'path'"):  # gemv: not MXFP4 (simt is its few-token path)
        c_moe.experts(m["z"], m["idx"], m["weights_k"], m["moe"], backend="triton", path="gemv")
    with pytest.raises(c_moe.MoEArgumentError, match="'num_stages'"):  # simt: register double-buffered
        c_moe.experts(m["z"], m["idx"], m["weights_k"], m["moe"], backend="triton", num_stages=2)
    for cap in (100, 32, 512, True):  # simt: a multiple of 8 in 64..255
        with pytest.raises(c_moe.MoEArgumentError, match="'maxnreg'"):
            c_moe.experts(m["z"], m["idx"], m["weights_k"], m["moe"], backend="triton", maxnreg=cap)
    with pytest.raises(c_moe.MoEArgumentError, match="'maxnreg'"):  # the simt path's only
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="triton", path="grouped", maxnreg=128)


def test_common_argument_errors():
    d = _inp()
    with pytest.raises(ValueError, match="'idx'"):
        c_moe.experts(d["z"], d["idx"] + 100, d["weights_k"], d["moe"], backend="triton")
    with pytest.raises(ValueError, match="'idx' and 'weights_k'"):
        c_moe.experts(d["z"], d["idx"][:, :2], d["weights_k"], d["moe"], backend="triton")
    with pytest.raises(TypeError, match="'moe'"):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], object(), backend="triton")
    with pytest.raises(c_moe.MoEArgumentError, match="'block_n'"):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="reference", block_n=32)
    with pytest.raises(SwitchError, match="'nope'"):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="nope")
    with pytest.raises(BackendUnavailable):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="cute")


def test_bytes_count_distinct_experts():
    c = OP.case(batch=64, routing="uniform", **K3)
    assert ops_moe.distinct_experts(c) == pytest.approx(613.2, abs=0.1)
    one = ops_moe.per_expert_bytes(c)
    assert one == 3 * 384 * 3584 * 2
    same = OP.case(batch=8, routing="same16", **K3)
    assert ops_moe.experts_bytes(same) == 16 * one + 8 * 3584 * 6 + 8 * 16 * 12
    mx = OP.case(batch=1, dtype="mxfp4", **K3)
    assert 16 * ops_moe.per_expert_bytes(mx) == pytest.approx(35.1e6, rel=0.01)
    tr = OP.case(batch=16, routing="k3_reuse30", **K3)
    assert OP.valid(tr) and ops_moe.distinct_experts(tr) == pytest.approx(routing.load("k3_reuse30").mean_distinct(16))
    assert not OP.valid(OP.case(routing="k3_reuse30"))  # a K3 trace on a 24-expert pool


# ---- GPU: K3's sizes ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FORMATS)
def test_gpu_k3_sizes(dtype):
    """K3's pool (896 experts, latent 3584) at TP16, ragged routing at an odd batch; `k3lab bench moe` checks every
    timed row (TP8, batch 1..64, uniform / same16 / traced) the same way."""
    _check(dtype=dtype, batch=33, routing="ragged", tp=16, **K3)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,routing,tp", [(1, "uniform", 8), (33, "ragged", 16), (64, "k3_reuse30", 8)])
def test_gpu_wait_per_expert(batch, routing, tp):
    """The simt path's per-expert wait on the H200 at K3's pool (the race it could lose: a role-B item reading act
    or adding into y before its expert's role-A items or the zeroing ones are done), twice in a row."""
    for seed in (0, 1):
        _check(dtype="mxfp4", batch=batch, routing=routing, tp=tp, seed=seed, options=dict(path="simt", wait="expert"),
               **K3)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,routing,tp", [(1, "uniform", 8), (33, "ragged", 16), (64, "uniform", 8),
                                              (256, "uniform", 8), (8, "same16", 8)])
def test_gpu_tc_path(batch, routing, tp):
    """The MXFP4 tensor-core path (`tc`) at K3's pool: one token, a ragged odd batch at TP16, 64 and 256 tokens (the
    batch-64 verify at draft depth 3), every token on the same 16 experts."""
    _check(dtype="mxfp4", batch=batch, routing=routing, tp=tp, options=dict(path="tc"), **K3)


@pytest.mark.gpu
def test_gpu_trace_routing():
    _check(dtype="mxfp4", batch=16, routing="k3_reuse30", **K3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["mxfp4", "fp8"])  # at batch 8: the grouped path, the gemv path
def test_gpu_graph_capture_no_host_sync(dtype):
    """The triton path captures into a CUDA graph (no host sync) and replays on new routing."""
    case = OP.case(batch=8, dtype=dtype, **K3)
    a, b = OP.make_inputs(case, 1, "cuda"), OP.make_inputs(case, 2, "cuda")
    run = lambda: c_moe.experts(a["z"], a["idx"], a["weights_k"], a["moe"], backend="triton", out=a["y"],  # noqa
                                check_values=False)
    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for k in ("z", "idx", "weights_k"):
        a[k].copy_(b[k])
    g.replay()
    torch.cuda.synchronize()
    want = ops_moe.ref_experts(b, case)["y"]
    assert (a["y"].double() - want).norm() / want.norm() < ops_moe.TOL


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FORMATS)
def test_gpu_step_tiny_sizes(dtype):
    """The decode step's tiny preset sizes on the GPU (latent 32, intermediate 32, 16 experts, top 4): the step's
    numerics on the H200 went non-finite from its first MoE layer in the ninth session while the same code under
    the interpreter stayed finite (docs/NOTES_step.md); this pins the experts kernel at those sizes."""
    for batch in (1, 3, 17):
        _check(dtype=dtype, batch=batch, latent=32, inter=32, tp=1, n_experts=16, top_k=4)


def test_batch_above_the_kernel_batch_in_launches(monkeypatch):
    """More tokens than the kernel's batch (a verify step: 64 sequences x 8 positions = 512 against 256) run as
    several launches of at most MAX_BATCH tokens into the output's rows, recorded as such; here MAX_BATCH is
    lowered to 4 so that 9 tokens take three launches (ragged routing: expert 0 chosen in every launch)."""
    from k3lab_kernels.triton import moe_experts as km

    monkeypatch.setattr(km, "MAX_BATCH", 4)
    for dtype in ("bf16", "mxfp4"):
        res = _check(dtype=dtype, batch=9, routing="ragged")
        assert res.ran[-1].notes.startswith("3 launches of <= 4 tokens"), res.ran[-1].notes


@pytest.mark.gpu
def test_gpu_batch_512():
    """K3's pool at 512 tokens (the batch-64 verify at draft depth 7): two launches of 256."""
    res = _check(dtype="mxfp4", batch=512, routing="uniform", **K3)
    assert res.ran[-1].notes.startswith("2 launches")


def test_simt_batch_one_wide_b_items():
    """Batch 1's 256 latent rows a role-B item (`default_blocks`) against fp64, at a latent that takes them (512)."""
    from k3lab_kernels.triton.moe_experts import default_blocks

    assert default_blocks(1, 4, 256, 512, "mxfp4", "simt")["block_l"] == 256
    assert default_blocks(2, 4, 256, 512, "mxfp4", "simt")["block_l"] == 128
    res = _check(dtype="mxfp4", batch=1, latent=512)
    assert "path simt" in res.ran[-1].notes


def test_auto_takes_the_cute_experts_for_mxfp4_up_to_64_tokens(monkeypatch):
    """data/moe_defaults.json: `auto` runs the CuTe DSL experts up to 64 tokens with MXFP4 weights (where CuTe DSL
    runs: one-token kernels at 1, grouped above), at one token for bf16 / fp8 and from 17 to 64 for fp8, and passes
    them over, by the op's `supports`, for too many products; the Triton kernels then (the fallback rule at batch 1,
    the measured one above 64)."""
    from k3lab.components import dispatch

    monkeypatch.setattr(dispatch, "can_run", lambda op, b: b in ("cute", "triton", "reference"))
    sel = lambda B, fmt, K=16, I=384: dispatch.select("moe_experts", "auto", B=B, shape=dict(B=B, fmt=fmt, K=K, I=I))  # noqa
    assert sel(1, "mxfp4")[0] == "cute"
    # bf16 / fp8 (the dense CuTe kernels, thirty-sixth session's moe_dense bundle): cute at one token, triton at 2..16,
    # cute for fp8 above 16; a format no rule names takes the Triton rule
    assert sel(1, "fp8")[0] == "cute" and sel(1, "bf16")[0] == "cute" and sel(1, "dense")[0] == "triton"
    be, _, why = sel(8, "fp8")
    assert be == "triton" and "measured rule" in why and sel(16, "bf16")[0] == "triton"
    assert sel(2, "mxfp4")[0] == "cute" and sel(8, "mxfp4")[0] == "cute" and sel(64, "mxfp4")[0] == "cute"  # grouped
    assert sel(128, "mxfp4")[0] == "triton" and sel(128, "fp8")[0] == "triton"
    assert sel(64, "fp8")[0] == "cute" and sel(64, "bf16")[0] == "triton"
    be, _, why = sel(1, "mxfp4", K=64, I=768)
    assert be == "triton" and "<= 1024" in why
    monkeypatch.setattr(dispatch, "can_run", lambda op, b: b in ("triton", "reference"))  # no CuTe DSL
    assert sel(1, "mxfp4")[0] == "triton"
    # the benchmark asks with a case of the op (full intermediate size and tp)
    assert OP.supports("cute", OP.case(batch=1, dtype="mxfp4", **K3)) is None
    assert "top-k x I/32" in OP.supports("cute", OP.case(batch=1, dtype="mxfp4", **dict(K3, top_k=96, tp=1)))
    assert OP.supports("cute", OP.case(batch=2, dtype="mxfp4", **K3)) is None  # the grouped kernels
    assert "latent % 64 " in OP.supports("cute", OP.case(batch=2, dtype="mxfp4", **dict(K3, latent=3616)))


def test_prepare_makes_only_what_the_call_reads(monkeypatch):
    """`prepare(moe, tokens, backend)`: the kernel layouts the experts' call at that many tokens reads, by the backend
    the dispatcher resolves: plain for triton and cute at one token, W1 / W3 quad-transposed and W2 plain or quad
    (I % 128) for cute's grouped kernels, none for the reference; bad token counts refused by name."""
    moe = OP.make_inputs(OP.case(dtype="mxfp4", batch=2, tp=1, latent=256, inter=128, n_experts=4, top_k=2), 0,
                         "cpu")["moe"]
    I = moe.w1.shape[1]

    def made(be, tokens):
        c_moe._kernel_layouts.clear()
        monkeypatch.setattr(c_moe.dispatch, "select", lambda *a, **k: (be, {}, "test"))
        c_moe.prepare(moe, tokens=tokens, backend=be)
        names = {id(w.data): n for n, w in (("w1", moe.w1), ("w3", moe.w3), ("w2", moe.w2))}
        return sorted((names[key[0]], key[1]) for key in c_moe._kernel_layouts)

    plain = [("w1", False), ("w2", False), ("w3", False)]
    assert made("triton", 64) == plain
    assert made("cute", 1) == plain
    assert made("cute", 8) == [("w1", True), ("w2", I % 128 == 0), ("w3", True)]
    assert made("reference", 8) == []
    with pytest.raises(ValueError, match="'tokens'"):
        c_moe.prepare(moe, tokens=0)
    c_moe._kernel_layouts.clear()


def test_bench_floor_from_the_experts_the_sets_touch():
    """The bench's floor takes the bytes of the experts each timed input set's routing chose (a uniform draw touches
    more or fewer than the expectation), recorded beside the formula's expectation; same16's sets touch exactly K."""
    from k3lab.bench import runner

    bd = runner.run("moe", ops=["moe_experts"], grid=dict(batch=(5,), dtype=("bf16",), routing=("uniform", "same16")),
                    backends=[], peers=True, skip={"torch_compile", "cublas_loop"}, reps=1, log=lambda s: None)
    assert bd.rows
    for r in bd.rows:
        case = OP.case(batch=5, dtype="bf16", routing=r.extra["routing"])
        each = [ops_moe.experts_set_bytes(OP.make_inputs(case, 1000 + i, "cpu"), case)
                for i in range(len(r.extra["bytes_by_set"]))]
        assert r.extra["bytes_by_set"] == each and r.bytes == round(sum(each) / len(each))
        assert r.extra["bytes_formula"] == ops_moe.experts_bytes(case)
        if r.extra["routing"] == "same16":
            assert r.bytes == r.extra["bytes_formula"]
