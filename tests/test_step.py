"""k3lab.step (the per-GPU decode step), k3lab.acceptance (draft acceptance curves), k3lab.dashboards' pieces.

CPU tests on the `tiny` preset: the step equals the reference stack's composition (k3lab.ref.layers.layer_step
over the same weights and states) in fp64, decode and verify; the fused wiring (Triton KDA and MLA under the
interpreter) against the fp64 oracle; the per-layer sum check and the launch attribution; the kernel
attribution on a synthetic GPU trace (the path a GPU run takes); the acceptance fits. GPU tests (-m gpu) build
the tp8 step and check what the H200 run relies on (capture report, kernels counted, trace saved).
"""
from __future__ import annotations

import copy
import gzip
import json
import math

import pytest
import torch

from k3lab import acceptance
from k3lab import step as S
from k3lab.config import preset
from k3lab.harness.numerics import error_stats
from k3lab.ref.layers import layer_step
from k3lab.switches import COMPONENTS, BackendUnavailable, SwitchError, Switches

AUTO = Switches(backend={c: "auto" for c in COMPONENTS})


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny preset's ops are microseconds; spinning OpenMP threads on a busy 2-core machine make them
    milliseconds. One intra-op thread for this module, restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny(**kw):
    kw.setdefault("context", 24)
    kw.setdefault("expert_dtype", "bf16")
    return preset("tiny", **kw)


# ---- composition ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft_depth,batch,expert_dtype", [(0, 1, "mxfp4"), (2, 3, "bf16")])
def test_step_equals_reference_stack_composition(draft_depth, batch, expert_dtype):
    """fp64 on the CPU: every layer's output of the step == the reference layer loop (layer_step, what
    k3lab.ref.stack.Stack.step runs) over the same weights, states and input, the block list carried through."""
    view = _tiny(batch=batch, draft_depth=draft_depth, expert_dtype=expert_dtype)
    st = S.DecodeStep(view, Switches(), device="cpu", dtype=torch.float64)
    assert st.ids == list(range(view.cfg.num_hidden_layers))
    kinds = [L.kind for L in st.layers]
    assert kinds.count("mla") == 2 and kinds.count("kda") == 6 and st.layers[0].w.mlp_kind == "dense"
    states = [copy.deepcopy(L.state) for L in st.layers]
    x0 = st.x_in.clone()
    out = st.run()
    x, blocks = x0, []
    for L, s in zip(st.layers, states):
        x, blocks = layer_step(x, blocks, L.w, s, block_size=view.cfg.attnres_block_size, eps=view.cfg.rms_norm_eps)
        err = error_stats(L.buf["x_out"], x).rel_norm
        assert err < 1e-12, (L.index, err)
        if L.kind == "kda" and draft_depth == 0:  # decode advances the state in place, as the reference does
            assert error_stats(L.state.state, s.state).rel_norm < 1e-12
    assert torch.equal(out, st.layers[-1].buf["x_out"])
    assert len(blocks) == len(st.layers[-1].buf["blocks_mlp"])


def test_kda_checkpoint_switch_on_the_verify_path():
    """`kda_checkpoint`: the verify path's KDA layers keep ceil(T / c) states ("auto": c = 4 at T = 8 from batch 8;
    a fixed c above T keeps the last only); the commit (every position accepted) leaves the same states and the
    step the same outputs as c = 1 (fp64, reference path). Toggled (auto <-> 1) on the verify path only."""
    view = _tiny(batch=8, draft_depth=7, expert_dtype="bf16")
    runs = {}
    for ck in (1, "auto", 8):
        st = S.DecodeStep(view, Switches(kda_checkpoint=ck), device="cpu", dtype=torch.float64)
        x = torch.randn(tuple(st.x_in.shape), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        out = st.run(x)
        st.commit()
        kdas = [L for L in st.layers if L.kind == "kda"]
        assert all(L.buf["state_hist"].shape[1] == {1: 8, "auto": 2, 8: 1}[ck] for L in kdas)
        runs[ck] = (out, [L.state.state.clone() for L in kdas])
    for ck in ("auto", 8):
        assert torch.equal(runs[ck][0], runs[1][0])
        assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(runs[ck][1], runs[1][1]))
    assert "kda_checkpoint=auto->1" in dict(S.toggle_list(Switches(), Switches(), verify=True))
    assert not any(k.startswith("kda_checkpoint") for k in dict(S.toggle_list(Switches(), Switches())))
    with pytest.raises(SwitchError, match="kda_checkpoint"):
        Switches(kda_checkpoint=3)


def test_step_tp8_composition_is_the_k3_block():
    """The tp8 view's block 0 is layers 0..11: 9 KDA + 3 MLA in the model's order, layer 0 dense (no build)."""
    cfg = preset("tp8").cfg
    ids = S.block_layer_ids(cfg, 0)
    assert ids == list(range(12))
    assert [cfg.layer_kind(i) for i in ids].count("kda") == 9 and [cfg.layer_kind(i) for i in ids].count("mla") == 3
    assert cfg.mlp_kind(0) == "dense" and all(cfg.mlp_kind(i) == "moe" for i in ids[1:])
    assert S.block_layer_ids(cfg, 7) == list(range(84, 93))  # the last block is short
    with pytest.raises(S.StepError, match="'block'"):
        S.block_layer_ids(cfg, 8)


FUSED = Switches(backend={c: "triton" for c in ("kda", "mla", "attnres", "router", "moe", "proj")}, kda_tile_v=16)


def test_fused_wiring_routes_every_group_to_its_kernel():
    """The fused switches reach a kernel for every group that has one: KDA and MLA through the layer builder,
    AttnRes and the experts through the builder, the projections fused by shared input with the router's top-k and
    the glue ops through their component APIs (`_fused_parts`), recorded per component. (Wiring only: the numbers
    are the slow test below.)"""
    st = S.DecodeStep(_tiny(batch=1, expert_dtype="mxfp4"), FUSED, device="cpu")
    assert st.overridden == {"proj": "triton"}  # the builder runs AttnRes, router and experts on Triton itself
    kda, mla = st.layers[1], st.layers[3]
    assert list(st.comps[1]) == ["attnres_attn", "in_proj", "decay_proj", "kda_core", "out_proj", "attnres_mlp",
                                 "moe_in", "experts", "moe_out"]
    assert list(st.comps[3])[:6] == ["attnres_attn", "in_proj", "q_proj", "kv_proj", "attn", "out_proj"]
    assert set(kda.ran.values()) == {"triton"} and set(mla.ran.values()) == {"triton"}
    assert list(st.comps[0])[-1] == "dense_mlp" and st.layers[0].ran["dense_mlp"] == "triton"
    # the fused groups read one weight; the layer's own tensors are views of it (no second copy)
    w = kda.w.attn
    assert w.w_g._base is w.w_qkv._base and w.w_b._base is w.w_qkv._base
    base = w.w_qkv._base
    st.set_switches(Switches())
    assert st.overridden == {} and set(st.layers[1].ran.values()) == {"reference"}
    st.set_switches(FUSED)  # the same concatenated weight again, not a new one
    assert st.layers[1].w.attn.w_qkv._base is base


def test_proj_cute_switch_routes_the_wide_one_token_projections(monkeypatch):
    """`proj_cute` sends the projections `proj_cute_takes` accepts (one token, bf16, no prologue or fused selection,
    where the trunk's proj rule says cute: short inputs, or >= 3584 outputs over the model width) to backend "cute"
    and records it per component; off, or on at two tokens, nothing
    changes; toggled alone when the projections run on triton; the rule's edges. (Wiring: the calls are captured, not
    run; the GPU tests of the kernel are tests/test_proj_cute.py.)"""
    from k3lab.components import trunk

    takes = S.proj_cute_takes
    assert takes(1, 2304, 1536) and takes(1, 7168, 1536) and takes(1, 6204, 7168) and takes(1, 5248, 7168)
    assert takes(1, 3648, 7168) and takes(1, 3584, 7168)
    assert not takes(1, 3583, 7168) and not takes(1, 1536, 7168) and not takes(1, 7168, 4352)
    assert not takes(2, 7168, 1536)
    assert not takes(1, 7168, 1536, prologue=True) and not takes(1, 7168, 7168, select=True)
    assert not takes(1, 7168, 1536, wdtype=torch.float8_e4m3fn)
    seen: list = []
    monkeypatch.setattr(trunk, "proj", lambda *a, backend, **k: seen.append(("proj", backend)))
    monkeypatch.setattr(trunk, "proj_group", lambda *a, backend, **k: seen.append(("group", backend,
                                                                                  k.get("chain") is not None)))
    assert takes(1, 24, 64)  # every tiny-preset input is short
    st = S.DecodeStep(_tiny(batch=1, expert_dtype="mxfp4"), FUSED.replace(proj_cute=True), device="cpu")
    kda = st.layers[1]
    assert kda.ran["in_proj"] == "cute" and kda.ran["out_proj"] == "cute" and kda.ran["moe_out"] == "triton+cute"
    assert "proj_cute" in st.why and "CuTe DSL GEMV" in st.why["proj_cute"]
    st.comps[1]["in_proj"][0]()
    # the decay's second factor rides in the input group's launch (its `chain`), decay_proj is gone; with
    # KDA_DECAY_CHAIN_MAX_TOKENS 0 it is its own launch on the GEMV again
    assert "decay_proj" not in st.comps[1] and seen == [("group", "cute", True)]
    monkeypatch.setattr(S, "KDA_DECAY_CHAIN_MAX_TOKENS", 0)
    st.set_switches(FUSED.replace(proj_cute=True))
    seen.clear()
    st.comps[1]["in_proj"][0]()
    st.comps[1]["decay_proj"][0]()
    assert seen == [("group", "cute", False), ("proj", "cute")]
    monkeypatch.setattr(S, "KDA_DECAY_CHAIN_MAX_TOKENS", 16)
    # the tiny preset's rope width (8) is not the one-launch query kernel's (a multiple of 16): the MLA query step
    # keeps its three launches, Wuq on the GEMV (the H200 headline's numerics section refused here, 2026-12-03)
    mla = st.layers[3]
    assert mla.kind == "mla" and mla.ran["q_proj"] == "triton+cute"
    st.comps[3]["q_proj"][0]()
    assert seen[-1] == ("proj", "cute")
    st.set_switches(FUSED)
    assert kda.ran["in_proj"] == "triton" and "proj_cute" not in st.why
    two = S.DecodeStep(_tiny(batch=2, expert_dtype="mxfp4"), FUSED.replace(proj_cute=True), device="cpu")
    assert set(two.layers[1].ran.values()) == {"triton"}
    assert "proj_cute=False->True" in dict(S.toggle_list(FUSED, st.switches))


def test_proj_mma_routes_the_few_token_projections(monkeypatch):
    """PROJ_MMA_MAX_TOKENS (0, off, until measured inside the step): with `proj_cute` at 2..N tokens the projections
    `proj_mma_takes` accepts go to the cute backend's tensor-core path (path "mma"), none of the one-token folds
    (chain, GLU output, rmsp) with them; at one token the GEMV rule is unchanged. (Wiring: the calls are captured.)"""
    from k3lab.components import trunk

    takes = S.proj_mma_takes
    monkeypatch.setattr(S, "PROJ_MMA_MAX_TOKENS", 16)
    assert takes(2, 7168) and takes(16, 1536) and takes(8, 7168, wdtype=torch.float8_e4m3fn)
    assert not takes(1, 7168) and not takes(17, 7168) and not takes(4, 7168, prologue=True)
    assert not takes(4, 7168, select=True) and not takes(4, 96, wdtype=torch.float8_e4m3fn)
    assert not takes(4, 40) and not takes(4, 64, wdtype=torch.float32)
    assert S.proj_backend(S.MMA) == dict(backend="cute", path="mma")
    assert S.proj_backend("triton") == {"backend": "triton"}
    seen: list = []
    monkeypatch.setattr(trunk, "proj", lambda *a, backend, path=None, **k: seen.append(("proj", backend, path)))
    monkeypatch.setattr(trunk, "proj_group", lambda *a, backend, path=None, **k: seen.append(
        ("group", backend, path, k.get("chain") is not None, k.get("glu") is not None)))
    st = S.DecodeStep(_tiny(batch=2, expert_dtype="mxfp4"), FUSED.replace(proj_cute=True), device="cpu")
    kda = st.layers[1]
    assert kda.ran["in_proj"] == "cute" and kda.ran["out_proj"] == "cute"
    assert "proj_mma_takes" in st.why["proj_cute"]
    st.comps[1]["in_proj"][0]()
    st.comps[1]["decay_proj"][0]()  # no chain: its own launch, on triton here (the tiny preset's K 8 is no 32)
    st.comps[1]["out_proj"][0]()
    assert seen == [("group", "cute", "mma", False, False), ("proj", "triton", None), ("proj", "cute", "mma")]
    monkeypatch.setattr(S, "PROJ_MMA_MAX_TOKENS", 0)
    st.set_switches(FUSED)
    st.set_switches(FUSED.replace(proj_cute=True))
    assert set(st.layers[1].ran.values()) == {"triton"}


def test_moe_glue_fold_same_output(monkeypatch):
    """With the MoE input group on the CuTe GEMV (proj_cute) at one token the MoE output's glue folds into the
    launches around it (`moe_glue_fold`): the group stores situ(g, u) as its GLU output, the experts write
    bf16(y routed_norm) and the partial sums of y^2 (`glue`), and moe_out reads that input through the "rmsp"
    prologue, one launch fewer; MOE_GLUE_FOLD_MAX_TOKENS 0 keeps glue.norm_glu. Both compositions (the projections
    run by their reference forms here, the calls recorded; the experts on the reference backend) give the same layer
    output up to bf16 rounding (CPU, tiny)."""
    from k3lab.components import trunk
    from k3lab.harness.numerics import rel_norm_error

    seen: list = []
    real_p, real_g = trunk.proj, trunk.proj_group

    def proj(*a, backend, **k):
        seen.append(("proj", backend, (k.get("prologue") or ("none",))[0]))
        return real_p(*a, backend="reference", **k)

    def group(*a, backend, **k):
        seen.append(("group", backend, k.get("glu")))
        return real_g(*a, backend="reference", **k)
    monkeypatch.setattr(trunk, "proj", proj)
    monkeypatch.setattr(trunk, "proj_group", group)
    monkeypatch.setattr(S, "MOE_GLUE_FOLD_ALIGN", 1)  # the tiny latent (the GEMV itself takes whole 256-column steps)
    # the selection on the GEMV too (router cute), the experts by the reference (their glue by torch)
    sw = FUSED.replace(proj_cute=True, backend={**FUSED.backend, "router": "cute", "moe": "reference"})
    st = S.DecodeStep(_tiny(batch=1, expert_dtype="mxfp4"), sw, device="cpu")
    L = st.layers[1]
    g = torch.Generator().manual_seed(7)
    h2 = torch.randn(L.buf["h2"].shape, generator=g).to(L.buf["h2"].dtype)
    p = torch.randn(L.buf["h2"].shape, generator=g).to(L.buf["h2"].dtype)
    outs = []
    for on in (1, 0):
        monkeypatch.setattr(S, "MOE_GLUE_FOLD_MAX_TOKENS", on)
        st.set_switches(sw)
        seen.clear()
        L.buf["h2"].copy_(h2)
        L.buf["p"] = p.clone()
        for name in ("moe_in", "experts", "moe_out"):
            st.comps[1][name][0]()
        outs.append(L.buf["x_out"].clone())
        m = L.w.mlp
        if on:
            assert seen == [("group", "cute", (m.shared[0].b1, m.shared[0].b2)), ("proj", "cute", "rmsp")]
            assert L.ran["moe_out"] == "cute"
        else:
            assert seen[0] == ("group", "cute", None) and len(seen) == 2 and seen[1][::2] == ("proj", "none")
    assert rel_norm_error(outs[0], outs[1]) < 1e-2


def test_fuse_prologues_switch_same_output():
    """fuse_prologues=False (the default) runs the norms and SiTU as launches of their own (the MoE output:
    routed_norm and SiTU-GLU into the two segments of one input, then one projection over [Wup | w2]) and gives the
    fused composition's output up to bf16 rounding (interpreter, tiny)."""
    from k3lab.harness.numerics import rel_norm_error

    st = S.DecodeStep(_tiny(batch=1, expert_dtype="mxfp4"), FUSED, device="cpu")
    L, outs = st.layers[1], []
    g = torch.Generator().manual_seed(7)
    y = torch.randn(L.buf["y"].shape, generator=g)
    for fuse in (True, False):
        st.set_switches(FUSED.replace(fuse_prologues=fuse))
        st.comps[1]["moe_in"][0]()
        L.buf["y"].copy_(y)
        outs.append(st.comps[1]["moe_out"][0]().clone())
    assert rel_norm_error(outs[0], outs[1]) < 1e-2
    assert "fuse_prologues=False->True" in dict(S.toggle_list(FUSED, st.switches))


def test_tp_switches_equal_the_plain_path():
    """split_router and owned_output, TP2 emulated on one GPU (interpreter, tiny at tp=2): every rank's share in
    turn, assembled (ranks "all", what the numerics run), gives the plain path's routing and output up to bf16
    rounding (owned_output rounds the shared part once more); ranks "one" (the timed step) computes rank 0's share:
    its logits and latent columns, its output coordinates, fewer bytes, the other shares as exchanged at build."""
    from k3lab.config import GpuView, k3_tiny
    from k3lab.harness.numerics import rel_norm_error

    view = GpuView(k3_tiny(), tp=2, context=24, batch=2)
    g = torch.Generator().manual_seed(11)
    res = {}
    for ranks in ("all", "one"):
        st = S.DecodeStep(view, FUSED, device="cpu", ranks=ranks)
        L = st.layers[1]
        y = torch.randn(L.buf["y"].shape, generator=g) if ranks == "all" else res[("all", False, False)][3]
        for split, owned in ((False, False), (True, False), (False, True), (True, True)):
            st.set_switches(FUSED.replace(split_router=split, owned_output=owned))
            c = st.comps[1]
            idx, wk = (t.clone() for t in c["moe_in"][0]())
            L.buf["y"].copy_(y)
            res[(ranks, split, owned)] = (idx, wk, c["moe_out"][0]().clone(), y, c["moe_in"][1], c["moe_out"][1])
            if split or owned:
                assert f"TP2 emulated on one GPU ('{ranks}'" in st.why["split_router" if split else "owned_output"]
    plain = res[("all", False, False)]
    for key, (idx, wk, out, *_) in res.items():
        if key[0] == "all":
            assert torch.equal(idx, plain[0]) and rel_norm_error(wk, plain[1]) < 1e-6
            assert rel_norm_error(out, plain[2]) < 1e-2, key
    one_split, one_owned = res[("one", True, False)], res[("one", False, True)]
    assert torch.equal(one_split[0], plain[0])  # rank 0's logits fresh, rank 1's from the build's exchange
    assert rel_norm_error(one_owned[2][:, :32], plain[2][:, :32]) < 1e-2  # rank 0's coordinates hold the routed part
    assert rel_norm_error(one_owned[2][:, 32:], plain[2][:, 32:]) > 1e-3  # rank 1's do not (its GPU adds them)
    assert one_split[4] < plain[4] and one_owned[5] < plain[5]  # fewer weight bytes on the timed rank
    tl = dict(S.toggle_list(FUSED, FUSED))
    assert {"split_router=False->True", "owned_output=False->True", "shared_expert_stream=False->True"} <= set(tl)
    with pytest.raises(S.StepError, match="'ranks'"):
        S.DecodeStep(view, FUSED, device="cpu", ranks="two")


def test_shared_expert_stream_same_output():
    """shared_expert_stream: the shared experts' w1/w3 leave moe_in's launch and run beside the routed experts (in
    order off the GPU): the same MoE output as the plain fused path, alone and with split_router; moe_in reads fewer
    bytes and the experts component the shared weights' bytes more."""
    from k3lab.harness.numerics import rel_norm_error

    st = S.DecodeStep(_tiny(batch=2, expert_dtype="bf16"), FUSED, device="cpu")
    L = st.layers[1]
    y = torch.randn(L.buf["y"].shape, generator=torch.Generator().manual_seed(3))
    res = {}
    for sw in (FUSED, FUSED.replace(shared_expert_stream=True),
               FUSED.replace(shared_expert_stream=True, split_router=True)):
        st.set_switches(sw)
        c = st.comps[1]
        idx = c["moe_in"][0]()[0].clone()
        c["experts"][0]()
        L.buf["y"].copy_(y)
        res[(sw.shared_expert_stream, sw.split_router)] = (idx, c["moe_out"][0]().clone(), c["moe_in"][1],
                                                           c["experts"][1])
    plain = res[(False, False)]
    for key, (idx, out, *_) in res.items():
        assert torch.equal(idx, plain[0]) and rel_norm_error(out, plain[1]) < 1e-6, key
    assert res[(True, False)][2] < plain[2] and res[(True, False)][3] > plain[3]
    st.set_switches(FUSED.replace(shared_expert_stream=True))
    assert "side stream" in st.why["shared_expert_stream"]
    st.set_switches(Switches(shared_expert_stream=True))
    assert "no effect" in st.why["shared_expert_stream"]


def test_tp_switches_numerics_against_fp64():
    """step_numerics builds the step with every rank's share (ranks "all"): split_router and owned_output on keep
    the plain fused step's error against the fp64 oracle (tiny at tp=2, two steps)."""
    from k3lab.config import GpuView, k3_tiny

    view = GpuView(k3_tiny(), tp=2, context=24, batch=2)
    on = S.step_numerics(view, FUSED.replace(split_router=True, owned_output=True), n_steps=2, device="cpu")
    off = S.step_numerics(view, FUSED, n_steps=2, device="cpu")
    for a, b in zip(on["rel_err"], off["rel_err"]):
        assert math.isfinite(a[-1]) and a[-1] < 2 * b[-1] + 1e-3 and a[-1] < S.NUMERICS_TOL


def test_prefetch_switch_wraps_each_attnres(monkeypatch):
    """prefetch=True: each AttnRes launches the L2 prefetch of the next group's weight (in_proj's concatenated
    weight, then moe_in's) with the step's token count and budget, and an MLA output projection Wo's beside the
    combine; the record says so; off the triton projections it does nothing and the record says that instead."""
    from k3lab.components import trunk

    calls = []
    monkeypatch.setattr(trunk, "prefetch_l2", lambda w, n, **kw: calls.append((w, n, kw["budget"])))
    st = S.DecodeStep(_tiny(batch=1, expert_dtype="mxfp4"), FUSED.replace(prefetch=True), device="cpu")
    assert "on: 0.5 of L2" in st.why["prefetch"]
    L = st.layers[1]
    for part in ("attnres_attn", "attnres_mlp"):
        st.comps[1][part][0]()
    want = [L.w.attn.w_qkv._base, L.w.mlp.router.w._base]
    assert [c[0] for c in calls] == want and {c[1:] for c in calls} == {(1, S.prefetch_budget("cpu"))}
    # an MLA layer's output projection prefetches Wo beside the combine
    i = next(i for i, x in enumerate(st.layers) if x.kind == "mla")
    calls.clear()
    st.comps[i]["out_proj"][0]()
    assert [c[0] for c in calls] == [st.layers[i].w.attn.w_o]
    assert "prefetch=False->True" in dict(S.toggle_list(FUSED, st.switches))
    st.set_switches(Switches(prefetch=True))
    assert "no effect" in st.why["prefetch"]


@pytest.mark.slow
@pytest.mark.parametrize("batch,draft_depth", [(1, 0), (3, 2), (17, 0)])
def test_fused_path_triton_interpreter_against_fp64(batch, draft_depth):
    """The whole fused path under TRITON_INTERPRET=1 (MXFP4 experts), the step in bf16 against the fp64 oracle:
    decode at batch 1, verify (T = 3 positions a sequence) at batch 3, and decode at batch 17 (above
    PROLOGUE_MAX_TOKENS and SELECT_MAX_BATCH: the norms, SiTU and the router's top-k as launches of their own)."""
    view = _tiny(batch=batch, draft_depth=draft_depth, expert_dtype="mxfp4")
    st = S.DecodeStep(view, FUSED, device="cpu")
    oracle = S.DecodeStep(view, Switches(), device="cpu", dtype=torch.float64)
    x = torch.randn(tuple(st.x_in.shape), generator=torch.Generator().manual_seed(3))
    st.run(x.bfloat16())
    oracle.run(x.double())
    errs = [error_stats(L.buf["x_out"], R.buf["x_out"]).rel_norm for L, R in zip(st.layers, oracle.layers)]
    if draft_depth:  # verify: layers 0..3 hold every fused part (dense, KDA+MoE, MLA+MoE); from layer 4 on the bf16
        errs = errs[:4]  # reference step itself leaves fp64 by 0.15..0.38 at this tiny size (its routing drifts)
    if batch > 16:  # 17 tokens: the bf16 reference step too leaves fp64 from layer 2 (0.10..0.30: routing flips), so
        # layers 0 and 1 (dense, then KDA + MoE on the unfused glue path), layer 1 over the tokens routed alike
        same = (st.layers[1].buf["idx"].sort(-1).values == oracle.layers[1].buf["idx"].sort(-1).values).all(-1)
        assert same.sum() >= batch - 2
        errs = [errs[0], error_stats(st.layers[1].buf["x_out"][same], oracle.layers[1].buf["x_out"][same]).rel_norm]
    assert all(math.isfinite(e) and e < S.NUMERICS_TOL for e in errs), errs


# ---- switches and arguments -----------------------------------------------------------------------------

def test_auto_resolves_to_the_reference_without_a_gpu_and_says_why():
    st = S.DecodeStep(_tiny(), AUTO, device="cpu")
    assert set(st.backends.values()) == {"reference"}
    assert all("auto without a GPU" in w for w in st.why.values())
    assert st.requested.backend["kda"] == "auto"


def test_auto_mla_follows_the_decode_rule_not_the_first_fused_backend(monkeypatch):
    """On a GPU `auto` for the MLA group is the mla_decode rule's backend (data/mla_defaults.json) where the layers
    take it, not the first fused backend with a path (cute), which a layer taking both would otherwise get."""
    from types import SimpleNamespace

    from k3lab.components import dispatch

    monkeypatch.setattr(S, "_on_gpu", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dispatch, "can_run", lambda op, be: be in ("triton", "cute", "reference"))
    monkeypatch.setattr(S, "backend_status", lambda be: (True, "patched"))
    takes = {"triton", "cute"}
    monkeypatch.setattr(S, "_group_accepts", lambda layers, comp, be, sw: be in takes)
    layers = [SimpleNamespace(B=1, T=1)]
    sw = Switches(backend={c: ("auto" if c == "mla" else "reference") for c in Switches().backend})
    rule = dispatch.select("mla_decode", "auto", B=1, T=1)[0]
    res, why = S.resolve_switches(sw, layers, "cuda")
    assert res.backend["mla"] == rule and "mla_decode rule" in why["mla"]
    takes.discard(rule)  # the rule's backend refused by the layers: the first fused backend that takes the group
    res, why = S.resolve_switches(sw, layers, "cuda")
    assert res.backend["mla"] == next(b for b in S.FUSED if b in takes) and "first fused" in why["mla"]


def test_auto_proj_and_moe_groups_ask_the_rules_with_what_the_step_knows(monkeypatch):
    """The step picks one backend a component group: for the projections it asks the trunk rules with their weight
    format only (bf16), so the rules measured on some projection shapes (fp8 at batch 1 / 2, by output rows) never
    decide the whole group (they did: `auto` put every projection of the batch-1 step on the CuTe GEMV); for the
    experts it asks with the pool's format (data/moe_defaults.json rules per format: bf16 experts at batch 8 on
    triton, not the MXFP4 rule's cute)."""
    from types import SimpleNamespace

    from k3lab.components import dispatch

    monkeypatch.setattr(S, "_on_gpu", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dispatch, "can_run", lambda op, be: be in ("triton", "cute", "reference"))
    monkeypatch.setattr(S, "backend_status", lambda be: (True, "patched"))
    monkeypatch.setattr(S, "_group_accepts", lambda layers, comp, be, sw: True)
    monkeypatch.setattr(S, "_override_ok", lambda group, be, n: (True, "patched"))
    sw = Switches(backend={c: ("auto" if c in ("proj", "moe") else "reference") for c in Switches().backend})
    want = {("mxfp4", 1): "cute", ("mxfp4", 8): "cute", ("bf16", 1): "cute", ("bf16", 8): "triton",
            ("fp8", 8): "triton", ("fp8", 64): "cute"}
    for (fmt, B), moe in want.items():
        layers = [SimpleNamespace(B=B, T=1, view=SimpleNamespace(expert_dtype=fmt))]
        assert S._group_facts(layers, "moe") == {"fmt": fmt}
        res, why = S.resolve_switches(sw, layers, "cuda")
        assert res.backend["proj"] == "triton", (fmt, B, why["proj"])
        assert res.backend["moe"] == moe, (fmt, B, why["moe"])


def test_comparison_steps_leave_the_cute_launch_mode_off():
    """kda_pdl (CuTe only) with the comparison steps: the build pass and the reference / torch.compile steps run it
    off (the first H200 headline with kda_pdl failed in the build pass), a cute step keeps it."""
    sw = Switches(kda_pdl=True, pdl=True)
    for be in ("reference", "torch_compile", "triton"):
        o = S.on_one_backend(sw, be)
        assert set(o.backend.values()) == {be} and o.kda_pdl is False and o.pdl is True
    assert S.on_one_backend(sw, "cute").kda_pdl is True
    st = S.DecodeStep(_tiny(), Switches(kda_pdl=False), device="cpu")
    st.layers[0].switches = S.on_one_backend(sw, "reference")
    st.layers[0].prepare()  # the build pass's components with kda_pdl requested: no refusal


def test_out_of_memory_says_where_and_what_shrinks_it(monkeypatch):
    """A step that does not fit the GPU (K3's full pools at tp8 take ~45 GB) fails with where it stopped and the
    arguments that shrink it (n_experts, context, batch), not the allocator's bare message; the layers built before
    go with the failed step."""
    import k3lab.model as M

    real, calls = M.build_layer, []

    def build(view, kind, *a, **k):
        calls.append(kind)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 588.00 MiB.")
        return real(view, kind, *a, **k)

    monkeypatch.setattr(M, "build_layer", build)
    with pytest.raises(torch.OutOfMemoryError, match=r"building layer 2 \(2 of the block's layers built\).*"
                                                       r"'n_experts'.*'context'.*'batch'") as e:
        S.DecodeStep(_tiny(), device="cpu", n_experts=8)
    assert "with 8 routed experts" in str(e.value) and "Tried to allocate" in str(e.value.__cause__)


def test_bad_arguments_are_named():
    view = _tiny()
    with pytest.raises(S.StepError, match="'n_experts'"):
        S.DecodeStep(view, n_experts="many", device="cpu")
    with pytest.raises(S.StepError, match="'dtype'"):
        S.DecodeStep(view, device="cpu", dtype=torch.float16)
    with pytest.raises(TypeError, match="'view'"):
        S.DecodeStep("tiny", device="cpu")
    with pytest.raises(S.StepError, match="'view.dcp'"):
        S.DecodeStep(_tiny(dcp=2), device="cpu")
    st = S.DecodeStep(view, device="cpu")
    with pytest.raises(S.StepError, match="'x'"):
        st.run(torch.zeros(3, 3))
    with pytest.raises(S.StepError, match="'kda_state_dtype'"):
        st.set_switches(Switches(kda_state_dtype="bf16"))
    two = S.DecodeStep(_tiny(batch=2), device="cpu")
    with pytest.raises(BackendUnavailable, match="for 'moe'.*_PATH_RULES"):  # CuTe takes bf16 experts at one token
        two.set_switches(Switches(backend={"moe": "cute"}))
    st.set_switches(Switches(backend={"moe": "cute"}))  # bf16 at one token: a path (kernels/cute/moe_dense.py)
    st.set_switches(Switches())
    one = S.DecodeStep(_tiny(batch=1, expert_dtype="mxfp4"), device="cpu")
    one.set_switches(Switches(backend={"moe": "cute"}))  # a path at one token, refused where it runs:
    moe_layer = next(i for i, L in enumerate(one.layers) if L.w.mlp_kind == "moe")
    with pytest.raises(BackendUnavailable, match="'cute'"):  # no CuTe DSL here
        one.comps[moe_layer]["experts"][0]()
    with pytest.raises(BackendUnavailable, match="no 'mla' path"):
        st.set_switches(Switches(backend={"mla": "cute"}))
    with pytest.raises(SwitchError, match="not wired"):
        Switches(fused_allreduce=True)
    with pytest.raises(S.StepError, match="'compare'"):
        S.bench_step(view, compare=("cute",), step=st, log=lambda s: None)


def test_toggle_list_changes_one_switch_each():
    base = Switches(backend={"kda": "triton", "mla": "auto"})
    resolved = Switches(backend={"kda": "triton", "mla": "triton"})
    tl = dict(S.toggle_list(base, resolved))
    assert set(tl) == {"kda=triton->reference", "mla=triton->reference", "pad_heads=0->16", "kda_tile_v=auto->16",
                       "mla_partitions=auto->1"}
    tl2 = dict(S.toggle_list(base, Switches(backend={"proj": "triton", "moe": "triton"})))
    assert {"proj=triton->reference", "moe=triton->reference", "moe_tile_n=auto->32"} <= set(tl2)
    assert tl2["moe_tile_n=auto->32"].moe_tile_n == 32
    assert "moe_tile_n=32->auto" in dict(S.toggle_list(base.replace(moe_tile_n=32),
                                                       Switches(backend={"moe": "triton"})))
    for label, sw in tl.items():
        diff = {k for k, v in sw.to_dict().items() if v != base.to_dict()[k]}
        assert len(diff) == 1, (label, diff)
    assert "kda_pdl=False->True" in dict(S.toggle_list(base, Switches(backend={"kda": "cute"})))
    every = S.toggle_list(base, Switches(backend={c: "triton" for c in COMPONENTS}, kda_pdl=True))
    assert {label.split("=")[0] for label, _ in every} <= set(S.TOGGLE_NAMES)  # the names `toggles` accepts


# ---- timing, attribution, estimate ---------------------------------------------------------------------

def test_bench_step_tiny_cpu(tmp_path):
    """bench_step on the CPU tiny preset: every layer and component timed (cpu-smoke), the per-layer sum
    checked against the whole step, launches attributed to every component range, the trace saved, the
    93-layer estimate from the measured layer types with the all-reduce labelled assumed."""
    view = _tiny()
    trace = tmp_path / "t.json.gz"
    res = S.bench_step(view, AUTO, reps=2, warmup=1, compare=("reference",), toggles=False, trace_path=trace,
                       log=lambda s: None)
    b = res.bundle
    rows = {(r.name, r.backend): r for r in b.rows}
    whole = rows[("step", "fused")]
    layers = [r for r in b.rows if r.backend == "fused" and r.name.startswith("L") and r.name.count(".") == 1]
    comps = [r for r in b.rows if r.backend == "fused" and r.name.startswith("L") and r.name.count(".") == 2]
    assert len(layers) == 8 and len(comps) == len(res.components)
    assert all(r.kind == "cpu-smoke" for r in layers + comps + [whole])
    # the per-layer sum check, as recorded
    lsum = sum(r.median_us for r in layers)
    assert whole.extra["layer_sum_us"] == pytest.approx(lsum)
    assert whole.extra["layer_sum_ratio"] == pytest.approx(lsum / whole.median_us)
    assert whole.extra["layer_sum_ok"] == (abs(lsum / whole.median_us - 1) <= S.SUM_TOL)
    # floors add up: component -> layer -> step
    for lr in layers:
        mine = [c for c in comps if c.extra["layer"] == lr.extra["layer"]]
        assert lr.floor_us == pytest.approx(sum(c.floor_us for c in mine))
        assert lr.launches == sum(c.launches for c in mine)
    assert whole.floor_us == pytest.approx(sum(r.floor_us for r in layers))
    # every component's range was found in the profile and launched something
    assert all(c.launches > 0 for c in comps), [c.name for c in comps if not c.launches]
    assert whole.launches == sum(c.launches for c in comps)
    # comparison row and estimate
    assert ("step", "reference") in rows
    est = rows[("estimate:93_layers", "fused")].extra
    assert est["allreduce_label"] == "assumed" and est["allreduces"] == 0  # tp=1
    assert est["counts"] == {"kda": 69, "mla": 24, "moe": 92, "dense": 1}
    t = est["type_us"]
    assert est["compute_us"] == pytest.approx(69 * t["kda"] + 24 * t["mla"] + 92 * t["moe"] + t["dense"])
    assert est["tokens_per_s"] == pytest.approx(1 / (est["step_us"] * 1e-6))
    # trace: gzip Chrome trace JSON with every component range
    ev = json.loads(gzip.open(trace, "rt").read())["traceEvents"]
    names = {e["name"] for e in ev if e.get("cat") == "user_annotation"}
    assert {c.name for c in comps} <= names
    # the bundle saves and validates
    b.save(tmp_path)


def test_bench_step_toggles_by_name():
    """toggles may name the switches to toggle alone (the notebook's `toggles = "split_router,owned_output"`): only
    those run; a named switch this step cannot toggle (the TP switches without Triton projections) is noted; a name
    the step never toggles is refused by name."""
    from k3lab import dashboards as dash

    res = S.bench_step(_tiny(), AUTO, reps=1, warmup=1, compare=(), toggles=("pad_heads", "split_router"),
                       components=False, profile=False, log=lambda s: None)
    names = [r.name for r in res.bundle.rows if r.name.startswith("toggle:")]
    assert names == ["toggle:pad_heads=0->16"]
    assert any("['split_router']" in n and "not applicable" in n for n in res.bundle.notes)
    with pytest.raises(S.StepError, match="'toggles'"):
        S.bench_step(_tiny(), AUTO, reps=1, toggles=("kda_state_dtype",), log=lambda s: None)
    assert dash._toggles("split_router, owned_output") == ("split_router", "owned_output")
    assert dash._toggles("false") is False and dash._toggles(True) is True


def test_mla_attention_bytes_come_from_the_registry_at_k3_widths():
    """The MLA attention floor uses the registry's mla_decode formula where the latent widths are K3's (tp8);
    the tiny preset's widths differ, so the layer builder's count stands there."""
    from types import SimpleNamespace

    from k3lab import registry

    view = preset("tp8", batch=2, context=8192, draft_depth=1, kv_dtype="fp8")
    attn = SimpleNamespace(kv_lora=512, rope_dim=64, heads=12)
    fake = SimpleNamespace(kind="mla", w=SimpleNamespace(attn=attn), B=2, T=2, fp8_scale="tensor")
    op = registry.get("mla_decode")
    want = op.nbytes(op.case(heads=12, batch=2, context=8192, T=2, page_size=0, kv_dtype="fp8", fp8_scale="tensor",
                             ragged=False))
    assert S.registry_bytes(view, fake, "attn") == want > 2 * 8192 * 576  # the cache rows, fp8
    assert S.registry_bytes(view, fake, "q_proj") is None
    st = S.DecodeStep(_tiny(), device="cpu")
    recs = [c for c in st.component_table() if c["name"] in ("attn", "kda_core")]
    assert {c["bytes_from"] for c in recs} == {"layer builder", "registry: k3lab.ops.kda.kda_bytes"}


def test_estimate_93_with_tp_assumes_two_allreduces_a_layer():
    comp = [dict(layer=0, part="attn", median_us=10.0, floor_us=5.0, bytes=100),
            dict(layer=0, part="mlp", median_us=30.0, floor_us=10.0, bytes=300),
            dict(layer=1, part="attn", median_us=20.0, floor_us=5.0, bytes=100),
            dict(layer=1, part="mlp", median_us=20.0, floor_us=5.0, bytes=100)]
    from k3lab.harness.bundle import Row

    lr = [Row("L00.kda", "fused", "gpu-graph", 80.0, 80.0, 80.0, extra=dict(layer=0, kind_attn="kda", mlp="dense")),
          Row("L01.mla", "fused", "gpu-graph", 40.0, 40.0, 40.0, extra=dict(layer=1, kind_attn="mla", mlp="moe"))]
    view = preset("tp8", batch=4)
    e = S.estimate_93(comp, lr, view, allreduce_us=10.0)
    # layer 0 measured 80 us split 1:3 by its components; layer 1 40 us split 1:1
    assert e["type_us"] == {"kda": 20.0, "mla": 20.0, "moe": 20.0, "dense": 60.0}
    assert e["allreduces"] == 2 * 93 and e["allreduce_us_total"] == 1860.0
    assert e["step_us"] == pytest.approx(69 * 20 + 24 * 20 + 92 * 20 + 60 + 1860)
    assert e["tokens_per_s_per_gpu"] == pytest.approx(e["tokens_per_s"] / 8)
    assert e["floor_us"] == pytest.approx(69 * 5 + 24 * 5 + 92 * 5 + 10)
    assert e["allreduce_label"] == "assumed"
    m = S.estimate_93(comp, lr, view, allreduce_us=5.0, allreduce_label="measured: nccl_graph")
    assert m["allreduce_label"] == "measured: nccl_graph" and m["allreduce_us_total"] == 930.0


def test_attribute_a_gpu_trace():
    """Kernels go to the innermost range whose CPU span holds their launch (correlation ids), as on a GPU."""
    ev = [
        {"cat": "user_annotation", "name": "step", "ts": 0, "dur": 100, "tid": 1},
        {"cat": "user_annotation", "name": "L01.kda.kda_core", "ts": 10, "dur": 20, "tid": 1},
        {"cat": "user_annotation", "name": "L01.kda.out_proj", "ts": 40, "dur": 20, "tid": 1},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 12, "dur": 2, "tid": 1, "args": {"correlation": 7}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 15, "dur": 2, "tid": 1, "args": {"correlation": 8}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 45, "dur": 2, "tid": 1, "args": {"correlation": 9}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 45, "dur": 2, "tid": 2, "args": {"correlation": 10}},
        {"cat": "kernel", "name": "kda_decode_kernel", "ts": 20, "dur": 3.0, "args": {"correlation": 7}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 24, "dur": 1.0, "args": {"correlation": 8}},
        {"cat": "kernel", "name": "gemv", "ts": 50, "dur": 5.0, "args": {"correlation": 9}},
        {"cat": "kernel", "name": "other_thread", "ts": 50, "dur": 5.0, "args": {"correlation": 10}},
    ]
    a = S.attribute(ev)
    assert a["L01.kda.kda_core"]["launches"] == 2 and a["L01.kda.kda_core"]["kernel_us"] == 4.0
    assert a["L01.kda.kda_core"]["kernels"] == {"kda_decode_kernel": 1, "Memcpy DtoD": 1}
    assert a["L01.kda.out_proj"]["launches"] == 1 and a["L01.kda.out_proj"]["kind"] == "gpu"


def test_save_trace_keeps_ranges_and_caps_kernels(tmp_path):
    ev = [{"cat": "user_annotation", "name": f"L00.kda.c{i}", "ts": i, "dur": 1, "ph": "X"} for i in range(3)]
    ev += [{"cat": "kernel", "name": f"k{i}", "ts": i, "dur": 1, "ph": "X", "args": {"correlation": i}}
           for i in range(50)]
    p = S.save_trace(ev, tmp_path / "t.json", max_events=10)
    d = json.loads(p.read_text())["traceEvents"]
    assert sum(e.get("cat") == "kernel" for e in d) == 10
    assert sum(e.get("cat") == "user_annotation" for e in d) == 3
    assert next(e for e in d if e.get("name") == "k3lab")["args"]["events_left_out"] == 40


def test_timeline_figure_one_row_a_stream(tmp_path):
    """The saved trace drawn as bars by stream: two streams (the shared-expert side stream beside the main one), each
    kernel under its innermost GPU range's component; `layer` keeps one layer's kernels; a CPU trace says it has no
    GPU kernels; no trace, no figure."""
    from k3lab import dashboards as dash

    ev = [{"cat": "gpu_user_annotation", "name": "L01.kda.moe_in", "ts": 100, "dur": 30, "ph": "X", "tid": 7},
          {"cat": "gpu_user_annotation", "name": "L01.kda.experts", "ts": 131, "dur": 20, "ph": "X", "tid": 7},
          {"cat": "gpu_user_annotation", "name": "L02.kda.in_proj", "ts": 160, "dur": 20, "ph": "X", "tid": 7},
          {"cat": "kernel", "name": "gemv", "ts": 101, "dur": 20, "ph": "X", "tid": 7},
          {"cat": "kernel", "name": "shared_w13", "ts": 105, "dur": 10, "ph": "X", "tid": 9},
          {"cat": "kernel", "name": "experts_up", "ts": 132, "dur": 10, "ph": "X", "tid": 7},
          {"cat": "kernel", "name": "in_gemv", "ts": 161, "dur": 15, "ph": "X", "tid": 7}]
    p = S.save_trace(ev, tmp_path / "t.json.gz")
    f = dash.timeline_figure(p, layer=1)
    assert [t.name for t in f.data] == ["moe_in", "experts"]
    assert sorted(set(y for t in f.data for y in t.y)) == ["stream 7", "stream 9"]
    assert sum(len(t.x) for t in f.data) == 3 and list(f.data[0].base) == [0, 4]  # us from the first kernel
    assert sum(len(t.x) for t in dash.timeline_figure(p).data) == 4
    cpu = S.save_trace([{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3, "ph": "X"}], tmp_path / "c.json")
    assert "no GPU kernels" in dash.timeline_figure(cpu).layout.title.text
    assert dash.timeline_figure(None) is None and dash.timeline_figure(tmp_path / "missing.json") is None


def test_numerics_verify_path_commits_and_stays_finite():
    num = S.step_numerics(_tiny(batch=2, draft_depth=1), Switches(), n_steps=2, device="cpu")
    assert num["n_steps"] == 2 and len(num["rel_err"]) == 8
    assert all(len(e) == 2 and all(math.isfinite(x) for x in e) for e in num["rel_err"])
    assert num["rel_err"][0][0] < 0.05  # layer 0 (no router): bf16 rounding only
    rows = S.numerics_rows(num)
    assert [r.name for r in rows][:2] == ["numerics:L00.kda+dense", "numerics:L01.kda+moe"]


def test_numerics_align_a_near_tied_router_pick():
    """The tiny stack at batch 1, 64 positions, seed 0: at step 1 layer 7's bf16 router takes an expert the fp64
    oracle does not, the right one for its own input; the oracle follows it (k3lab.model.Layer.align_twin)
    and the layer's error is what the rounding gives (0.09) where the other expert's output made it 0.20. The
    alignment is recorded in the numerics and on its row."""
    calls = []
    num = S.step_numerics(_tiny(batch=1, context=64), Switches(), n_steps=2, device="cpu")
    assert [(a["step"], a["layer"]) for a in num["aligned"]] == [(1, 7)]
    assert num["rel_err"][7][1] < 0.12
    rows = {r.name: r for r in S.numerics_rows(num)}
    r7 = rows["numerics:L07.mla+moe"]
    assert "near-ties aligned at 1 step" in r7.error["note"] and "the fp64 twin did not" in r7.extra["aligned"][0]
    assert "note" not in rows["numerics:L06.kda+moe"].error
    from k3lab import dashboards
    from k3lab.harness.bundle import Bundle

    b = Bundle.new("n", view=_tiny(batch=1, context=64), switches=Switches())
    for r in rows.values():
        b.add(r)
    stars = [t for t in dashboards.error_figure(b).data if t.marker.symbol == "star"]
    assert len(stars) == 1 and list(stars[0].x) == [2] and "the fp64 twin did not" in stars[0].hovertext[0]
    st = S.DecodeStep(_tiny(), Switches(), device="cpu")
    st.run(after=lambda i, c: calls.append((i, c)))
    assert calls == [(i, c) for i in range(len(st.layers)) for c in st.comps[i]]


def test_nsight_says_clearly_when_it_cannot_run():
    ok, why = S.nsight_status()
    if not torch.cuda.is_available():
        assert not ok and "no GPU" in why
    res = S.nsight_metrics(_tiny(), Switches(), 1)
    assert res["ok"] is ok or not res["ok"]
    if not ok:
        assert res["message"] == why and res["rows"] == []


def test_panel_reruns_with_the_changed_control():
    """The ipywidgets panel: a control per parameter name (the unwired switches disabled); a change re-runs
    with the new value, a refused switch is shown in the panel instead of raising."""
    from k3lab import dashboards as dash

    params = {"preset": "tiny", "batch": 1, "context": 64, "draft_depth": 0, "backend": "auto"}
    seen = []
    box = dash.panel(params, seen.append)
    ctl = box.controls
    want = {"batch", "context", "draft_depth", "backend"} | set(dash.BACKEND_PARAMS) | set(dash.SWITCH_PARAMS)
    assert set(ctl) == want
    assert ctl["fused_allreduce"].disabled and not ctl["pad_heads"].disabled
    ctl["batch"].value = 4
    assert seen[-1]["batch"] == 4 and seen[-1]["context"] == 64
    ctl["draft_depth"].value = 3
    assert seen[-1]["draft_depth"] == 3 and seen[-1]["batch"] == 4
    sw = dash.switches_from_params({**seen[-1], "backend_mla": "torch_compile", "pad_heads": 16})
    assert sw.backend["mla"] == "torch_compile" and sw.backend["kda"] == "auto" and sw.pad_heads == 16


# ---- acceptance -----------------------------------------------------------------------------------------

def test_acceptance_curves_reproduce_their_targets():
    a = acceptance.load("agentx_fixed")
    assert a.committed(3) == pytest.approx(3.00, abs=1e-9) and a.committed(4) == pytest.approx(3.36, abs=1e-9)
    assert a.residual < 1e-9 and a.form == "geometric" and len(a.probs) == acceptance.MAX_DEPTH
    assert all(x >= y for x, y in zip(a.probs, a.probs[1:]))  # acceptance decays with depth
    b = acceptance.load("al6_at7")
    assert b.committed(7) == pytest.approx(6.0, abs=1e-9) and b.residual < 1e-9
    assert acceptance.expected_committed([0.5, 0.5], 2) == 1.75
    # the shipped files are what the fits give
    for c in acceptance.default_curves():
        assert acceptance.load(c.name).probs == pytest.approx(c.probs, abs=1e-12)
    assert acceptance.committed_per_s(a, 3, 2, 1000.0) == pytest.approx(2 * 3.0 / 1e-3)


def test_accepted_counts_follow_the_curve():
    """The distribution of committed counts sums to 1 and its mean is `committed`; a batch's counts are its
    quantiles (what the draft-depth study times the commit with); the step's commit timer refuses bad counts."""
    a = acceptance.load("agentx_fixed")
    for d in (1, 3, 7):
        dist = acceptance.accepted_distribution(a.probs, d)
        assert len(dist) == d + 1 and sum(dist) == pytest.approx(1.0, abs=1e-12)
        assert sum((n + 1) * p for n, p in enumerate(dist)) == pytest.approx(a.committed(d), abs=1e-12)
    assert acceptance.accepted_distribution([0.5, 0.5], 2) == [0.5, 0.25, 0.25]
    assert acceptance.accepted_counts(acceptance.Curve("h", "constant", {"p": 0.5}, [0.5, 0.5]), 2, 4) == [1, 1, 2, 3]
    c = acceptance.accepted_counts(a, 7, 64)
    assert len(c) == 64 and c == sorted(c) and 1 <= c[0] and c[-1] <= 8
    assert sum(c) / 64 == pytest.approx(a.committed(7), abs=0.15)
    with pytest.raises(acceptance.AcceptanceError, match="'batch'"):
        acceptance.accepted_counts(a, 3, 0)
    st = S.DecodeStep(_tiny(batch=2, draft_depth=2), Switches(), device="cpu")
    st.run()
    us, ran = st.kda_commit_us([1, 3], reps=2, warmup=1)
    assert us > 0 and ran["op"] == "kda_commit"
    with pytest.raises(S.StepError, match="'accepted'"):
        st.kda_commit_us([0, 3])
    with pytest.raises(S.StepError, match="no commit"):
        S.DecodeStep(_tiny(batch=1), Switches(), device="cpu").kda_commit_us([1])


def test_acceptance_bad_input_is_named():
    with pytest.raises(acceptance.AcceptanceError, match="'depth'"):
        acceptance.expected_committed([0.5], 2)
    with pytest.raises(acceptance.AcceptanceError, match="not found"):
        acceptance.load("nope")
    with pytest.raises(acceptance.AcceptanceError, match="'committed'"):
        acceptance.fit_constant(3, 5.0)
    with pytest.raises(acceptance.AcceptanceError, match="probs"):
        acceptance.Curve("x", "constant", {"p": 2.0}, [2.0])


# ---- GPU ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_step_tp8_small_pool(tmp_path):
    """The tp8 step on the GPU with a small expert pool: fused backends resolved, kernels counted per
    component from the profile, the trace saved with kernels, the whole step timed (one graph when every
    component is capturable; otherwise the capture note names the failure), memory reported."""
    view = preset("tp8", batch=1, context=1024, expert_dtype="mxfp4")
    res = S.bench_step(view, AUTO, n_experts=32, reps=3, warmup=1, compare=("reference",), toggles=False,
                       trace_path=tmp_path / "t.json.gz", log=print)
    b = res.bundle
    whole = next(r for r in b.rows if r.name == "step" and r.backend == "fused")
    assert whole.kind in ("gpu-graph", "gpu-eager")
    if whole.kind == "gpu-eager":
        assert "capture" in whole.extra["capture"] or whole.extra["capture"]
    assert whole.launches and whole.launches > 0
    assert whole.extra["memory"]["allocated_gb"] > 0 and whole.extra["memory"]["peak_gb"] > 0
    assert b.config["step"]["kda_layers"] == 9 and b.config["step"]["mla_layers"] == 3
    assert b.switches["backend"]["kda"] == "auto" and b.switches["backend"]["mla"] in ("triton", "cute")
    ev = json.loads(gzip.open(tmp_path / "t.json.gz", "rt").read())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in ev)
    # the AttnRes rows say the rule's options ran (the layer calls the component through auto: k3lab.model._mix)
    from k3lab import policy
    rule = policy.rule("trunk", "attnres_norm", 1)
    attn = [r for r in b.rows if str(r.extra.get("component", "")).startswith("attnres") and r.backend == "fused"]
    assert attn and all(r.extra.get("ran_kernel") for r in attn)
    for r in attn:
        if r.extra.get("ran") == rule["backend"]:
            assert r.extra["ran_options"] == policy.options_of(rule) and "rule" in r.extra["ran_why"], r.extra


_MOE_SWITCHES = ("split_router", "owned_output", "shared_expert_stream")


@pytest.mark.gpu
@pytest.mark.parametrize("names", [(n,) for n in _MOE_SWITCHES] + [_MOE_SWITCHES], ids="+".join)
def test_gpu_step_moe_switches_capture_and_match(names):
    """The MoE switches on the GPU, each alone and all three (tp8, a small pool, batch 2): the whole step still
    captures in one graph (the shared experts' side stream forks and joins inside the experts component), and
    with every rank's share (ranks "all"), from the same KDA states, the first MoE layer's output matches the
    plain fused step's."""
    from k3lab.harness.numerics import rel_norm_error

    view = preset("tp8", batch=2, context=1024, expert_dtype="mxfp4")
    on = FUSED.replace(**{n: True for n in names})
    st = S.DecodeStep(view, FUSED, n_experts=32, ranks="all")
    x = torch.randn(tuple(st.x_in.shape), device=st.device).to(st.dtype)
    kda = [L.state for L in st.layers if L.kind == "kda"]
    start = [(s.state.clone(), s.conv_state.clone()) for s in kda]  # a T = 1 step advances the KDA states in place
    outs = []
    for sw in (FUSED, on):
        for s, (s0, c0) in zip(kda, start):
            s.state.copy_(s0)
            s.conv_state.copy_(c0)
        st.set_switches(sw)
        outs.append([t.clone() for t in (st.run(x), st.layers[1].buf["x_out"])])
        torch.cuda.synchronize()
    # layer 1 (the first MoE layer, the same input both ways) agrees to bf16 rounding: owned_output rounds the
    # shared part once more, the side stream's shared w1/w3 launch sums in another split-K order. The step's output
    # after 12 layers is only checked finite: such roundings flip near-tie routing in later layers (H200: 10-26 %
    # apart at the end while layer 1 was 0.15-0.22 % apart).
    err1 = rel_norm_error(outs[1][1], outs[0][1])
    assert all(torch.isfinite(b).all() for b in outs[1]) and err1 < 2e-2, (names, err1)
    one = S.DecodeStep(view, on, n_experts=32)  # ranks "one": the timed form
    t = S.time_step(one, reps=3, warmup=1)
    assert t.kind == "gpu-graph", (names, t)


@pytest.mark.gpu
@pytest.mark.parametrize("fuse,proj_cute", [(True, False), (False, False), (False, True)])
def test_gpu_step_numerics_tiny(fuse, proj_cute):
    """The fused step on the GPU against the fp64 build over 2 steps at the tiny preset (the notebook's numerics
    section), with the prologues fused and not: every layer finite and within NUMERICS_TOL. (The ninth session's
    H200 bundle showed non-finite output from the first MoE layer on; the CPU interpreter of the same code does
    not: docs/NOTES_step.md.)"""
    if proj_cute:
        pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) not installed")
    view = preset("tiny", batch=1, context=64, expert_dtype="mxfp4")
    num = S.step_numerics(view, FUSED.replace(fuse_prologues=fuse, proj_cute=proj_cute), n_steps=2)
    errs = [e[-1] for e in num["rel_err"]]
    assert all(math.isfinite(e) and e < S.NUMERICS_TOL for e in errs), errs


def test_pdl_switch_same_output_and_recorded(monkeypatch):
    """The `pdl` switch: the step's components run inside a pdl_chain (every k3lab Triton kernel whose wrapper gets
    pdl=None launches with PDL on a GPU; the interpreter launches plainly), the output is the plain step's, the
    record says so, and toggle_list offers it. The chain itself: on inside, off outside, an explicit pdl wins."""
    from k3lab_kernels.triton import pdl

    st = S.DecodeStep(_tiny(batch=1, expert_dtype="mxfp4"), FUSED, device="cpu")
    x = torch.randn(tuple(st.x_in.shape), generator=torch.Generator().manual_seed(5)).to(st.dtype)
    kda = [L.state for L in st.layers if L.kind == "kda"]
    start = [(s.state.clone(), s.conv_state.clone()) for s in kda]
    outs = []
    for on in (False, True):
        for s, (s0, c0) in zip(kda, start):
            s.state.copy_(s0)
            s.conv_state.copy_(c0)
        st.set_switches(FUSED.replace(pdl=on))
        outs.append(st.run(x).clone())
    assert torch.equal(outs[0], outs[1])
    assert "programmatic dependent launch" in st.why["pdl"]
    assert "pdl=False->True" in dict(S.toggle_list(FUSED, st.switches))
    assert not pdl.chain_pdl(None)  # the interpreter: never PDL
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as on a GPU
    assert not pdl.chain_pdl(None) and pdl.chain_pdl(True)
    with pdl.pdl_chain(True):
        assert pdl.chain_pdl(None) and not pdl.chain_pdl(False)
        with pdl.pdl_chain(False):
            assert not pdl.chain_pdl(None)
    assert not pdl.chain_pdl(None)


def test_cute_attnres_and_router_run_in_the_builder_never_the_reference():
    """A backend the step does not run itself goes to the layer builder as asked: the CuTe AttnRes and router are
    the builder's (k3lab.model), never replaced by the torch reference behind a record that says cute (the H200
    step once ran the reference 60 us an AttnRes call that way), and so are the CuTe experts; a group nobody can run
    on the backend (the MLA on cute) is refused by name."""
    st = S.DecodeStep(_tiny(batch=1, expert_dtype="mxfp4"), FUSED, device="cpu")
    for g in ("attnres", "router"):
        assert S._group_accepts(st.layers, g, "cute", FUSED)
    st.set_switches(FUSED.replace(backend_attnres="cute", backend_router="cute"))
    assert st.switches.backend["attnres"] == st.switches.backend["router"] == "cute"
    for L in st.layers:
        assert L.switches.backend["attnres"] == "cute" and L.switches.backend["router"] == "cute"
    assert "attnres" not in st.overridden and "router" not in st.overridden
    assert S._group_accepts(st.layers, "moe", "cute", FUSED)  # the CuTe experts (one token) are the builder's too
    with pytest.raises(BackendUnavailable, match="no 'mla' path"):
        st.set_switches(FUSED.replace(backend_mla="cute"))


def test_verify_token_counts_keep_the_fused_projections():
    """A verify at batch 64 and draft depth 7 is 512 tokens: the fused step keeps the triton projections there (the
    kernels take 1..1024 rows; notebook 07 stopped at 256 before the fifteenth session), and past the limit the step
    names why it cannot."""
    from k3lab.components import trunk

    ok, why = S._override_ok("proj", "triton", 64 * 8)
    assert ok, why
    ok, why = S._override_ok("proj", "triton", trunk.MAX_BATCH + 1)
    assert not ok and str(trunk.MAX_BATCH) in why


def test_layer_attnres_takes_the_auto_rules_options(monkeypatch):
    """The step resolves the AttnRes group's `auto` to the rule's backend (cute); the layer then calls the component
    through `auto` when the rule for its rows names that backend, so the rule's options (cluster / vec / alpha by
    batch) reach the kernel (they once did not: the step ran the kernel's own choice under a record naming the
    rule); a backend the rule does not name runs as asked, and [B, T, D] rows are flattened for the kernels."""
    from k3lab import model
    from k3lab.components import dispatch

    calls = []
    monkeypatch.setattr(model, "mix_norm",
                        lambda blocks, x, *v, eps, backend, ran=None: calls.append((backend, x.shape)) or x)
    monkeypatch.setattr(dispatch, "select", lambda op, be, B, T=1, shape=None: (
        "cute", {"cluster": 2, "vec": 8}, "rule") if op == "attnres_norm" and be == "auto" else (be, {}, "asked"))
    x = torch.zeros(3, 1, 64)
    vecs = (torch.ones(64),) * 3
    model._mix([x], x, vecs, 1e-6, "cute")
    model._mix([x], x, vecs, 1e-6, "triton")
    model._mix([x], x[:, 0], vecs, 1e-6, "reference")
    assert calls == [("auto", (3, 64)), ("triton", (3, 64)), ("reference", (3, 64))]


def test_step_rows_carry_the_component_records():
    """The AttnRes, KDA core, MLA attention and experts rows say what the component API ran for them (kernel,
    options, the rule or request): the layer keeps each one's last record; a component the step composes itself
    (the fused projections) keeps none."""
    st = S.DecodeStep(_tiny(batch=1), FUSED.replace(backend_attnres="reference"), device="cpu")
    st.run()
    seen = set()
    for L in st.layers:
        for name in ("attnres_attn", "attnres_mlp"):
            r = S._ran_record(L, name)
            assert r["ran_kernel"] == "k3lab.ref.attnres:attnres_norm" and r["ran_options"] == {}, r
        for name in ("kda_core", "attn", "experts"):
            r = S._ran_record(L, name)
            if r:
                seen.add(name)
                assert r["ran_kernel"] and r["ran_why"], (name, r)
        assert S._ran_record(L, "in_proj") == {}
    assert seen == {"kda_core", "attn", "experts"}, seen


def test_kernels_table_shows_the_component_records():
    """The step notebook's kernels table: a row with a component record shows its kernel, the options set (None ones
    left out) and the rule; a row without one shows the backend alone; everything escaped."""
    from k3lab import dashboards as dash

    cell = dash._ran_cell({"ran": "cute", "ran_kernel": "k3lab_kernels.cute.attnres_norm:attnres_norm",
                           "ran_options": {"cluster": 8, "vec": 4, "alpha": "twopass", "pdl": None},
                           "ran_why": "measured rule of data/trunk_defaults.json: {'max_batch': 8} <x>"})
    assert cell.startswith("cute<br>") and "cluster=8, vec=4, alpha=twopass" in cell and "pdl" not in cell
    assert "&lt;x&gt;" in cell and "<x>" not in cell
    assert dash._ran_cell({"ran": "triton"}) == "triton"


def test_split_router_toggle_carries_its_untimed_exchange():
    """split_router's all-gathers (one a MoE layer) are not timed on one GPU: its toggle row carries them at the
    assumed latency, signed by the direction of the toggle, and the toggles figure draws the change with them beside
    the timed bar; other toggles carry nothing."""
    from k3lab import dashboards as dash
    from k3lab.harness.bundle import Bundle, Row

    st = S.DecodeStep(_tiny(batch=1), Switches(), device="cpu")
    n = sum(L.w.mlp_kind == "moe" for L in st.layers)
    assert n >= 1
    on = S.untimed_exchange("split_router=False->True", st, each_us=10.0)
    off = S.untimed_exchange("split_router=True->False", st, each_us=10.0)
    assert on["assumed_exchange_us"] == 10.0 * n == -off["assumed_exchange_us"] and "ASSUMED" in on["untimed"]
    assert S.untimed_exchange("owned_output=False->True", st) == {} == S.untimed_exchange("pdl=True->False", st)

    def row(name, us, **x):
        return Row(name=name, backend="fused", kind="gpu-graph", median_us=us, p10_us=us, p90_us=us, extra=x)
    b = Bundle(name="t", env={}, config={}, switches={},
               rows=[row("step", 100.0), row("toggle:split_router=False->True", 90.0, **on),
                     row("toggle:pdl=True->False", 110.0)])
    fig = dash.toggles_figure(b)
    assert list(fig.data[0].x) == [-10.0, 10.0]
    assert list(fig.data[1].x) == [-10.0 + 10.0 * n] and list(fig.data[1].y) == ["split_router=False->True"]


def test_toggles_figure_keeps_the_switches_on_their_own_scale():
    """The whole step on the reference / torch.compile joins the toggles figure only when it does not dwarf the
    switches' changes (a fused GPU step's reference is ~400x it): otherwise the title names the ratio."""
    from k3lab import dashboards as dash
    from k3lab.harness.bundle import Bundle, Row

    def row(name, us, be="fused"):
        return Row(name=name, backend=be, kind="gpu-graph", median_us=us, p10_us=us, p90_us=us, extra={})
    big = Bundle(name="t", env={}, config={}, switches={},
                 rows=[row("step", 1000.0), row("step", 400000.0, "reference"), row("toggle:pdl=True->False", 1100.0)])
    fig = dash.toggles_figure(big)
    assert list(fig.data[0].y) == ["pdl=True->False"] and "reference 400x" in fig.layout.title.text
    near = Bundle(name="t", env={}, config={}, switches={},
                  rows=[row("step", 1000.0), row("step", 1500.0, "reference"), row("toggle:pdl=True->False", 1100.0)])
    assert list(dash.toggles_figure(near).data[0].y) == ["every component on reference", "pdl=True->False"]


def test_shared_stream_launch_is_bounded():
    """The switch's bounded share: the shared experts' w1/w3 launch takes at most SHARED_STREAM_CTAS CTAs at K3's
    TP8 and TP16 shapes, every batch the step runs (the tiles x K ranges the Triton projection's config makes of the
    knobs), and the bound is stated where the switch says what it did."""
    from k3lab.config import preset as mk

    for tp in ("tp8", "tp16"):
        c = mk(tp).cfg
        sI = c.n_shared_experts * c.shared_intermediate_size // (8 if tp == "tp8" else 16)
        for batch in (1, 2, 8, 16, 64, 128, 512):
            knobs, n = S.shared_stream_knobs(batch, 2 * sI, c.hidden_size, "cpu")
            assert 1 <= n <= S.SHARED_STREAM_CTAS, (tp, batch, knobs, n)
            assert knobs["path"] in ("tma", "dot")
    assert S.shared_stream_knobs(1, 64, 64, "cpu", ctas=1)[1] == 1
    with pytest.raises(S.StepError, match="ctas"):
        S.shared_stream_knobs(1, 64, 64, "cpu", ctas=0)
    st = S.DecodeStep(_tiny(batch=2, expert_dtype="bf16"), FUSED.replace(shared_expert_stream=True), device="cpu")
    assert f"at most {S.SHARED_STREAM_CTAS} CTAs" in st.why["shared_expert_stream"]
    from k3lab.components import trunk

    seen, real = [], trunk.proj_group

    def spy(*a, **k):
        seen.append(k)
        return real(*a, **k)
    trunk.proj_group = spy
    try:
        c = st.comps[1]
        c["moe_in"][0]()
        c["experts"][0]()  # the shared w1/w3 launch beside the experts
    finally:
        trunk.proj_group = real
    assert any("split_k" in k and "block_n" in k for k in seen), seen
