"""KDA component API: argument validation at the boundary, backend dispatch and the record of what
ran, backends agreeing with each other, and the drift study at a small step count."""
from __future__ import annotations

import pytest
import torch

from k3lab.components import dispatch, kda
from k3lab.ref.kda import make_kda_inputs
from k3lab.switches import BackendUnavailable, SwitchError
from k3lab.harness.numerics import rel_norm_error

DEV = "cuda" if torch.cuda.is_available() else "cpu"
B, H, D, T = 2, 2, 32, 3


def dec_inputs(seed=0):
    inp, p, st, cs = make_kda_inputs(B, H, D, seed=seed, device=DEV)
    return inp, p, st, cs


def ver_inputs(seed=0):
    inp, p, st, cs = make_kda_inputs(B, H, D, T=T, seed=seed, device=DEV)
    sh = torch.full((B, T, H, D, D), float("nan"), device=DEV)
    chh = torch.full((B, T, 3 * H * D, 3), float("nan"), dtype=torch.bfloat16, device=DEV)
    return inp, p, st, cs, sh, chh


def call_decode(inp, p, st, cs, **kw):
    return kda.decode(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs, **kw)


rel = rel_norm_error  # the one relative-error helper (NaN never passes a tolerance)


# ---- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("mutate,name", [
    (lambda i, p, s, c: i.__setitem__("qkv", i["qkv"][:, :-1]), "qkv"),
    (lambda i, p, s, c: i.__setitem__("f", i["f"].float()), "f"),
    (lambda i, p, s, c: i.__setitem__("b", i["b"][:1]), "b"),
    (lambda i, p, s, c: i.__setitem__("gate", i["gate"].reshape(B, H, D)), "gate"),
    (lambda i, p, s, c: i.__setitem__("qkv", i["qkv"].repeat(1, 2)[:, ::2]), "qkv"),
])
def test_decode_rejects_bad_inputs(mutate, name):
    inp, p, st, cs = dec_inputs()
    mutate(inp, p, st, cs)
    with pytest.raises(kda.KDAArgumentError, match=repr(name)):
        call_decode(inp, p, st, cs)


def test_decode_rejects_bad_state_and_tiles():
    inp, p, st, cs = dec_inputs()
    with pytest.raises(kda.KDAArgumentError, match="'state'.*dtype"):
        call_decode(inp, p, st.half(), cs)
    with pytest.raises(kda.KDAArgumentError, match="'state'.*shape"):
        call_decode(inp, p, st[:, :1].contiguous(), cs)
    with pytest.raises(kda.KDAArgumentError, match="'state'.*contiguous"):
        call_decode(inp, p, st.transpose(-1, -2), cs)
    with pytest.raises(kda.KDAArgumentError, match="'conv_state'"):
        call_decode(inp, p, st, cs.float())
    with pytest.raises(kda.KDAArgumentError, match="'tile_v'.*one of"):
        call_decode(inp, p, st, cs, tile_v=3)
    with pytest.raises(kda.KDAArgumentError, match="'tile_v'.*divisible"):
        call_decode(inp, p, st, cs, tile_v=64)
    with pytest.raises(kda.KDAArgumentError, match="'out'"):
        call_decode(inp, p, st, cs, out=torch.empty(B, H * D, device=DEV))
    with pytest.raises(kda.KDAArgumentError, match="'state'.*device"):
        call_decode(inp, p, st.to("meta"), cs)


@pytest.mark.parametrize("backend", ["reference", "torch_compile"])
def test_pdl_is_refused_off_the_cute_backend(backend):
    """The kda_pdl switch (programmatic dependent launch) exists in the CuTe kernels only: any other backend
    refuses it by name instead of silently launching without it."""
    inp, p, st, cs = dec_inputs()
    with pytest.raises(kda.KDAArgumentError, match="'pdl'.*cute"):
        call_decode(inp, p, st, cs, backend=backend, pdl=True)
    inp, p, st, cs, sh, chh = ver_inputs()
    with pytest.raises(kda.KDAArgumentError, match="'pdl'.*cute"):
        kda.verify(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs, state_hist=sh, conv_hist=chh,
                   backend=backend, pdl=True)
    inp, p, st, cs = dec_inputs()
    with pytest.raises(kda.KDAArgumentError, match="'pdl'.*bool"):
        call_decode(inp, p, st, cs, backend=backend, pdl="on")


def test_backend_refusals():
    inp, p, st, cs = dec_inputs()
    with pytest.raises(SwitchError, match="not allowed"):
        call_decode(inp, p, st, cs, backend="magic")
    with pytest.raises(BackendUnavailable, match="aiter"):
        call_decode(inp, p, st, cs, backend="aiter")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="cute"):
            call_decode(inp, p, st, cs, backend="cute")
        assert dispatch.select("kda_decode", "auto", B=2)[0] == "reference"
    else:
        assert dispatch.select("kda_decode", "auto", B=2)[0] in ("triton", "cute")


def test_verify_and_commit_validation():
    inp, p, st, cs, sh, chh = ver_inputs()
    a = (inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs)
    with pytest.raises(kda.KDAArgumentError, match="'lengths'.*1..T"):
        kda.verify(*a, state_hist=sh, conv_hist=chh, lengths=torch.tensor([0, 2], dtype=torch.int32, device=DEV))
    with pytest.raises(kda.KDAArgumentError, match="'lengths'.*1..T"):
        kda.verify(*a, state_hist=sh, conv_hist=chh, lengths=torch.tensor([4, 2], dtype=torch.int32, device=DEV))
    with pytest.raises(kda.KDAArgumentError, match="'lengths'.*dtype"):
        kda.verify(*a, state_hist=sh, conv_hist=chh, lengths=torch.tensor([1, 2], device=DEV))
    with pytest.raises(kda.KDAArgumentError, match="'state_hist'"):
        kda.verify(*a, state_hist=sh.bfloat16(), conv_hist=chh)
    with pytest.raises(kda.KDAArgumentError, match="'conv_hist'"):
        kda.verify(*a, state_hist=sh, conv_hist=chh[:, :2].contiguous())
    with pytest.raises(kda.KDAArgumentError, match="'num_accepted'.*1..T"):
        kda.commit(sh, chh, torch.tensor([1, 4], device=DEV), st, cs)
    with pytest.raises(kda.KDAArgumentError, match="'num_accepted'.*dtype"):
        kda.commit(sh, chh, torch.tensor([1.0, 2.0], device=DEV), st, cs)
    with pytest.raises(kda.KDAArgumentError, match="'inverse'"):
        kda.prefill(*a, inverse="fp16")
    with pytest.raises(kda.KDAArgumentError, match="'chunk'"):
        kda.prefill(*a, chunk=48)
    with pytest.raises(kda.KDAArgumentError, match="'grouped'"):
        kda.prefill(*a, grouped=1)


def test_checkpoint_validation():
    """`checkpoint` not an int >= 1, above T, and a state_hist of the wrong slot count are refused by name, in
    verify and in commit; commit with c >= 2 needs the verify's inputs."""
    inp, p, st, cs, sh, chh = ver_inputs()  # T = 3
    a = (inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs)
    sh2 = torch.full((B, 2, H, D, D), float("nan"), device=DEV)  # ceil(3 / 2) slots
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(kda.KDAArgumentError, match="'checkpoint'.*int >= 1"):
            kda.verify(*a, state_hist=sh2, conv_hist=chh, checkpoint=bad)
        with pytest.raises(kda.KDAArgumentError, match="'checkpoint'.*int >= 1"):
            kda.commit(sh2, chh, torch.tensor([1, 2], device=DEV), st, cs, checkpoint=bad)
    with pytest.raises(kda.KDAArgumentError, match="'checkpoint'.*at most T=3"):
        kda.verify(*a, state_hist=sh2, conv_hist=chh, checkpoint=4)
    with pytest.raises(kda.KDAArgumentError, match="'checkpoint'.*at most T=3"):
        kda.commit(sh2, chh, torch.tensor([1, 2], device=DEV), st, cs, checkpoint=4)
    with pytest.raises(kda.KDAArgumentError, match="'state_hist'.*shape"):
        kda.verify(*a, state_hist=sh, conv_hist=chh, checkpoint=2)  # 3 slots where c = 2 keeps 2
    with pytest.raises(kda.KDAArgumentError, match="'state_hist'.*shape"):
        kda.verify(*a, state_hist=sh2, conv_hist=chh)  # c = 1 keeps 3
    with pytest.raises(kda.KDAArgumentError, match="'state_hist'.*shape"):
        kda.commit(sh, chh, torch.tensor([1, 2], device=DEV), st, cs, checkpoint=2, qkv=inp["qkv"], f=inp["f"],
                   b=inp["b"], params=p)
    with pytest.raises(kda.KDAArgumentError, match="'qkv'.*checkpoint=2"):
        kda.commit(sh2, chh, torch.tensor([1, 2], device=DEV), st, cs, checkpoint=2)
    with pytest.raises(kda.KDAArgumentError, match="'params'.*checkpoint=2"):
        kda.commit(sh2, chh, torch.tensor([1, 2], device=DEV), st, cs, checkpoint=2, qkv=inp["qkv"], f=inp["f"],
                   b=inp["b"])
    with pytest.raises(kda.KDAArgumentError, match="'f'.*shape"):
        kda.commit(sh2, chh, torch.tensor([1, 2], device=DEV), st, cs, checkpoint=2, qkv=inp["qkv"],
                   f=inp["f"][:, :2].contiguous(), b=inp["b"], params=p)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_checkpoint_verify_and_commit_through_the_checker(backend):
    """verify with checkpoint 2 (ragged: untouched slots) and c = T, and commit of every n_b (c = 2, 3), on the
    reference (fp32 recurrence on the host) and the triton backends."""
    from k3lab import registry
    from k3lab.harness import checker

    ver, com = registry.get("kda_verify"), registry.get("kda_commit")
    opts = dict(tile_v=8) if backend == "triton" else {}
    for c, ragged in ((2, True), (4, False)):
        r = checker.require(checker.check(ver, ver.case(heads=2, batch=3, D=16, T=4, ragged=ragged, checkpoint=c),
                                          backend=backend, options=opts, seed=c))
        assert r.ran[-1].options["checkpoint"] == c
    for c in (2, 3):
        r = checker.require(checker.check(com, com.case(heads=2, batch=5, D=16, T=5, checkpoint=c, accepted="each"),
                                          backend=backend, options=opts, seed=c))
        assert r.ran[-1].options["checkpoint"] == c and r.ran[-1].backend == backend


def test_commit_cute_backend_replays_with_triton():
    """cute has no commit kernel: c = 1 the torch gather, c >= 2 the triton replay (the record says so)."""
    from k3lab import registry
    from k3lab.harness import checker

    if not dispatch.can_run("kda_verify", "cute"):
        pytest.skip("the cute backend cannot run here")
    com = registry.get("kda_commit")
    r = checker.require(checker.check(com, com.case(heads=2, batch=4, D=128, T=4, checkpoint=2, accepted="each"),
                                      backend="cute", seed=1))
    assert "_kda_replay_kernel" in r.ran[-1].kernel and "cute has no commit kernel" in r.ran[-1].notes


# ---- dispatch and agreement --------------------------------------------------------------------

@pytest.mark.parametrize("tile_v", [8, 32])
def test_decode_triton_matches_reference_and_records(tile_v):
    inp, p, st, cs = dec_inputs(seed=1)
    st_r, cs_r, st_t, cs_t = st.clone(), cs.clone(), st.clone(), cs.clone()
    ran = []
    o_r = call_decode(inp, p, st_r, cs_r, backend="reference", ran=ran)
    assert ran[-1].backend == "reference" and ran[-1].options["tile_v"] is None
    o_t = call_decode(inp, p, st_t, cs_t, backend="triton", tile_v=tile_v, ran=ran)
    run = ran[-1]
    assert (run.op, run.backend, run.options["tile_v"], run.options["state_dtype"]) == (
        "kda_decode", "triton", tile_v, "float32")
    assert run.kernel == "k3lab_kernels.triton.kda_decode:kda_decode" and len(ran) == 2
    assert rel(o_t, o_r) < 1e-2 and rel(st_t, st_r) < 1e-5 and torch.equal(cs_t, cs_r)


def test_decode_bf16_state_reference_and_triton():
    inp, p, st, cs = dec_inputs(seed=2)
    s1, s2 = st.bfloat16(), st.bfloat16()
    c1, c2 = cs.clone(), cs.clone()
    o1 = call_decode(inp, p, s1, c1, backend="reference")
    o2 = call_decode(inp, p, s2, c2, backend="triton", tile_v=16)
    assert s1.dtype == s2.dtype == torch.bfloat16
    assert rel(o2, o1) < 1e-2 and rel(s2, s1) < 1e-2 and torch.equal(c1, c2)


def test_verify_commit_prefill_triton_vs_reference():
    inp, p, st, cs, sh, chh = ver_inputs(seed=3)
    a = (inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs)
    lens = torch.tensor([3, 2], dtype=torch.int32, device=DEV)
    poison = lambda: torch.full((B, T, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
    o_r = kda.verify(*a, poison(), state_hist=sh, conv_hist=chh, lengths=lens, backend="reference")
    sh_r, chh_r = sh.clone(), chh.clone()
    sh2, chh2 = torch.full_like(sh, float("nan")), torch.full_like(chh, float("nan"))
    ran = []
    o_t = kda.verify(*a, poison(), state_hist=sh2, conv_hist=chh2, lengths=lens, backend="triton", tile_v=8, ran=ran)
    assert ran[-1].notes.endswith("ragged") and ran[-1].options["tile_v"] == 8
    assert rel(o_t[0], o_r[0]) < 1e-2 and rel(o_t[1, :2], o_r[1, :2]) < 1e-2
    assert torch.isnan(o_t[1, 2].float()).all() and torch.isnan(o_r[1, 2].float()).all()
    assert rel(sh2[0], sh_r[0]) < 1e-5 and torch.equal(chh2[0], chh_r[0])
    n = torch.tensor([2, 1], dtype=torch.int32, device=DEV)
    S1, c1, S2, c2 = st.clone(), cs.clone(), st.clone(), cs.clone()
    kda.commit(sh_r, chh_r, n, S1, c1, backend="reference")
    kda.commit(sh2, chh2, n, S2, c2, backend="triton", ran=ran)
    assert ran[-1].backend == "triton" and ran[-1].op == "kda_commit"
    assert rel(S2, S1) < 1e-5 and torch.equal(c1, c2)

    L = 70
    inp, p, st, cs = make_kda_inputs(1, H, D, T=L, seed=4, device=DEV)
    a = (inp["qkv"], inp["f"], inp["b"], inp["gate"], p)
    res = {}
    for be in ("reference", "triton"):
        S, c = st.clone(), cs.clone()
        o = kda.prefill(*a, S, c, backend=be, grouped=True, ran=ran)
        res[be] = (o, S, c)
        assert ran[-1].op == "kda_prefill" and ran[-1].backend == be
    assert rel(res["triton"][0], res["reference"][0]) < 1e-2
    assert rel(res["triton"][1], res["reference"][1]) < 1e-4
    assert torch.equal(res["triton"][2], res["reference"][2])


def test_torch_compile_backend():
    inp, p, st, cs = dec_inputs(seed=5)
    s1, c1, s2, c2 = st.clone(), cs.clone(), st.clone(), cs.clone()
    o1 = call_decode(inp, p, s1, c1, backend="reference")
    try:
        ran = []
        o2 = call_decode(inp, p, s2, c2, backend="torch_compile", ran=ran)
    except Exception as ex:  # no C++ toolchain for inductor on this machine
        pytest.skip(f"torch.compile unavailable here: {ex!r}"[:200])
    assert ran[-1].backend == "torch_compile"
    assert rel(o2, o1) < 1e-2 and rel(s2, s1) < 1e-5 and torch.equal(c1, c2)


def test_drift_study_small():
    from k3lab.studies.kda_drift import drift_study

    df = drift_study(steps=6, B=1, H=2, D=16, backend="triton", tile_v=8, every=2)
    assert set(df.state_dtype) == {"fp32", "bf16"}
    assert list(df.columns[:3]) == ["step", "state_dtype", "backend"]
    last = df[df.step == df.step.max()].set_index("state_dtype")
    assert last.loc["fp32", "state_err"] < 1e-4
    assert last.loc["fp32", "state_err"] < last.loc["bf16", "state_err"] < 5e-2
    assert (df.out_err < 2e-2).all()


def test_layer_with_kda_pdl_names_why_the_reference_kda_layer_cannot_run():
    """The kda_pdl switch through the model: a KDA layer on a backend without PDL is skipped by the layer
    bench with the component's reason (never run silently without the switch); MLA layers still run."""
    from k3lab.config import preset
    from k3lab.harness.layerbench import bench_layers
    from k3lab.switches import Switches

    b = bench_layers(preset("tiny", batch=1, context=64), backends="reference", switches=Switches(kda_pdl=True),
                     reps=1, warmup=1, name="t-pdl", log=lambda s: None)
    assert "'pdl'" in b.backends_skipped.get("reference:kda", "") and "cute" in b.backends_skipped["reference:kda"]
    assert any(r.name.startswith("mla.") for r in b.rows) and not any(r.name.startswith("kda.") for r in b.rows)


# ---- the one checker, through the registry, on the shapes the kernels claim ---------------------------

@pytest.mark.parametrize("op,shape,backend,opts", [
    ("kda_decode", dict(heads=2, batch=1, D=32), "triton", dict(tile_v=8)),
    ("kda_decode", dict(heads=3, batch=3, D=16, state_dtype="bf16"), "triton", dict(tile_v=16)),
    ("kda_decode", dict(heads=2, batch=2, D=16), "reference", {}),
    ("kda_verify", dict(heads=2, batch=3, D=16, T=3, ragged=True), "triton", dict(tile_v=8)),
    ("kda_verify", dict(heads=1, batch=1, D=32, T=2), "triton", dict(tile_v=32)),
    ("kda_verify", dict(heads=2, batch=3, D=16, T=4, ragged=True), "reference", {}),
    ("kda_prefill", dict(heads=2, batch=1, D=16, L=70, chunk=16, grouped=True), "triton", dict(tile_v=16)),
    ("kda_prefill", dict(heads=2, batch=2, D=16, L=33, chunk=32, inverse="bf16"), "reference", {}),
])
def test_checker_passes_the_kernels(op, shape, backend, opts):
    from k3lab import registry
    from k3lab.harness import checker

    o = registry.get(op)
    res = checker.check(o, o.case(**shape), backend=backend, options=opts, seed=7, device=DEV)
    checker.require(res)
    assert res.ran and res.ran[-1].backend == backend
    assert set(res.errors) >= set(o.written) | set(o.updated)


def test_checker_catches_what_it_claims():
    """A wrong output, a written entry that must stay untouched, a modified input and an inexact conv state
    each fail the check, named."""
    from k3lab import registry
    from k3lab.harness import checker

    op = registry.get("kda_verify")
    case = op.case(heads=2, batch=3, D=16, T=3, ragged=True)

    def right(d):
        op.call(d, case, "reference", {}, None)

    checker.require(checker.check(op, case, impl=right, seed=1))

    def writes_everything(d):  # ignores lengths: fills the positions it must leave untouched
        kda.verify(d["qkv"], d["f"], d["b"], d["gate"], d["params"], d["state"], d["conv_state"], d["out"],
                   state_hist=d["state_hist"], conv_hist=d["conv_hist"], backend="reference")

    r = checker.check(op, case, impl=writes_everything, seed=1)
    assert not r.ok and any("untouched" in f for f in r.failures)

    def scribbles_input(d):
        right(d)
        d["qkv"].add_(1)

    r = checker.check(op, case, impl=scribbles_input, seed=1)
    assert not r.ok and any("'qkv'" in f for f in r.failures)

    def off_by_a_bit(d):
        right(d)
        d["out"].mul_(1.05)
        d["conv_hist"][0, 0, 0, 0] += 1

    r = checker.check(op, case, impl=off_by_a_bit, seed=1)
    assert not r.ok and any(f.startswith("out:") for f in r.failures) and any("conv_hist" in f for f in r.failures)


def test_checker_compares_read_only_inputs_bit_for_bit_in_any_dtype():
    from k3lab.harness.checker import _same_bits

    for t in (torch.tensor(1.5), torch.randn(3, 4), torch.randn(5).to(torch.float8_e4m3fn), torch.tensor([True]),
              torch.tensor([float("nan"), 1.0])):
        assert _same_bits(t, t.clone())
    assert not _same_bits(torch.tensor(1.5), torch.tensor(2.5))
    x = torch.randn(6).to(torch.float8_e4m3fn)
    assert not _same_bits(x, (x.float() * 2).to(torch.float8_e4m3fn))


def test_checkpoint_auto_and_the_commit_tile_rule():
    """checkpoint="auto" resolves by (batch, T) the same way in verify, commit and history_slots (the measured
    rule: c = 4 at T = 8 from batch 8, else 1); the commit's replay tile follows default_commit_tile and the
    record says which ran."""
    from k3lab_kernels.triton.kda_verify import default_commit_tile

    assert kda.default_checkpoint(1, 8) == 1 and kda.default_checkpoint(7, 8) == 1
    assert kda.default_checkpoint(8, 8) == 4 and kda.default_checkpoint(64, 8) == 4
    assert kda.default_checkpoint(64, 4) == 1 and kda.default_checkpoint(64, 2) == 1
    assert kda.history_slots(8, "auto", B=8) == 2 and kda.history_slots(8, "auto", B=1) == 8
    assert kda.history_slots(8, 3) == 3 and kda.history_slots(5) == 5
    assert [default_commit_tile(b, c) for b, c in ((1, 8), (2, 2), (8, 4), (16, 8), (64, 2), (64, 4), (64, 8))] \
        == [16, 16, 32, 32, 64, 64, 128]
    Bq, Tq = 8, 8
    inp, p, st, cs = make_kda_inputs(Bq, H, 16, T=Tq, seed=3, device=DEV)
    a = (inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs)
    NS = kda.history_slots(Tq, "auto", B=Bq)
    sh = torch.full((Bq, NS, H, 16, 16), float("nan"), device=DEV)
    chh = torch.full((Bq, Tq, 3 * H * 16, 3), float("nan"), dtype=torch.bfloat16, device=DEV)
    ran = []
    kda.verify(*a, state_hist=sh, conv_hist=chh, checkpoint="auto", ran=ran)
    assert ran[-1].options["checkpoint"] == 4 and torch.isfinite(sh).all()
    with pytest.raises(kda.KDAArgumentError, match="'state_hist'.*shape"):  # "auto" means 2 slots here, not 8
        kda.verify(*a, state_hist=torch.zeros(Bq, Tq, H, 16, 16, device=DEV), conv_hist=chh, checkpoint="auto")
    n = torch.arange(1, Bq + 1, dtype=torch.int32, device=DEV)
    st2, cs2 = st.clone(), cs.clone()
    kda.commit(sh, chh, n, st2, cs2, checkpoint="auto", qkv=inp["qkv"], f=inp["f"], b=inp["b"], params=p,
               ran=ran)
    assert ran[-1].options["checkpoint"] == 4
    # the same commit with every state kept (c = 1): the states agree within the verify's fp32 tolerance
    sh1 = torch.full((Bq, Tq, H, 16, 16), float("nan"), device=DEV)
    kda.verify(*a, state_hist=sh1, conv_hist=chh, checkpoint=1)
    st1, cs1 = st.clone(), cs.clone()
    kda.commit(sh1, chh, n, st1, cs1)
    assert rel(st2, st1) < 1e-5 and torch.equal(cs2, cs1)
