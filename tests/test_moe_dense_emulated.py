"""The CuTe DSL routed experts of one token with bf16 and fp8 weights (kernels/cute/moe_dense.py) on the CPU emulator
(tests/cute_emulate.py): their logic without a GPU or nvidia-cutlass-dsl, through the shared checker (fresh inputs, y
poisoned, the fp64 reference on the dequantized weights, the registry's tolerance), at small pools whose chunk counts
leave idle threads in both launches and, with int32 and int64 ids, pdl, rows a CTA that do not divide; then what the
wrapper and the component refuse, by name."""
import pytest
import torch

import cute_emulate as emulate
from k3lab import registry
from k3lab.harness import checker

pytestmark = pytest.mark.cute_emu
OP = registry.get("moe_experts")
# latent 128: 16 bf16 / 8 fp8 chunks a row (a partial warp of the up kernel); I 128 x 3 pairs: 48 / 24 (pair, chunk)
# products (the down kernel's partial warps)
SMALL = dict(batch=1, tp=1, latent=128, inter=128, n_experts=6, top_k=3, routing="uniform")
# latent 1152: 144 bf16 chunks (five warps, the last partial); I 96: 12 / 6 chunks a W2 row, rows a CTA not dividing
WIDE = dict(SMALL, latent=1152, inter=96, n_experts=4)


def tensors(d, idx32, words=("idx",)) -> dict:
    """The kernels' arguments for the emulator: the stored weights (and fp8 row scales), the int32 views the wrappers
    make of `words`, registered so that the emulator finds them by address and dtype."""
    moe = d["moe"]
    t = dict(z=d["z"], idx=d["idx"].to(torch.int32) if idx32 else d["idx"], wk=d["weights_k"], y=d["y"],
             w1=moe.w1.data, w3=moe.w3.data, w2=moe.w2.data)
    if moe.w1.fmt == "fp8":
        t.update(s1=moe.w1.scale, s3=moe.w3.scale, s2=moe.w2.scale)
    t.update({f"{k}_words": t[k].reshape(-1).view(torch.int32) for k in words
              if t[k].dtype not in (torch.int32, torch.float8_e4m3fn)})
    emulate._PDL["early"] = frozenset()  # neither kernel reads anything before its wait
    return t


def run(d, pdl=False, idx32=False, rows=None, seed=0):
    moe = d["moe"]
    t = tensors(d, idx32)

    def call(m, **a):
        mod = m.mod["moe_dense"]
        saved = mod.UP_ROWS, mod.DOWN_ROWS
        if rows:
            mod.UP_ROWS, mod.DOWN_ROWS = rows
        try:
            mod.moe_experts_dense(a["z"], a["idx"], a["wk"], a["w1"], a["w3"], a["w2"], a.get("s1"), a.get("s3"),
                                  a.get("s2"), a["y"], b1=moe.b1, b2=moe.b2, pdl=pdl)
        finally:
            mod.UP_ROWS, mod.DOWN_ROWS = saved
    emulate._run(call, t, seed)


def impl(**kw):
    def f(d):
        run(d, **kw)
    f.__name__ = f"emulated cute moe_experts_dense({kw})"
    return f


@pytest.mark.parametrize("dtype,shape,kw", [
    ("bf16", SMALL, dict(pdl=True, idx32=True)), ("fp8", SMALL, dict(pdl=True, idx32=True)),
    ("bf16", SMALL, dict(rows=(3, 5))),   # rows a CTA that divide neither I nor L: 1 each
    ("bf16", WIDE, dict(pdl=True)),       # several warps in both launches (the cross-warp sums)
    pytest.param("fp8", WIDE, dict(idx32=False), marks=pytest.mark.slow)])  # ~30 s: the e4m3 PTX emulated
def test_one_token_dense(dtype, shape, kw):
    case = OP.case(dtype=dtype, **shape)
    checker.require(checker.check(OP, case, impl=impl(**kw), seed=1, device="cpu"))
    launches = emulate.LAST["launches"]
    assert [x["use_pdl"] for x in launches[-2:]] == [kw.get("pdl", False), True]
    from k3lab_kernels.cute import moe_dense as md

    cw = 16 if dtype == "fp8" else 8
    L, I, K = shape["latent"], shape["inter"], shape["top_k"]
    ru, rd = md.rows_of(I, L) if "rows" not in kw else ((3 if I % 3 == 0 else 1), (5 if L % 5 == 0 else 1))
    assert launches[-2]["block"] == -(-(L // cw) // 32) * 32 and launches[-2]["grid"][0] == K * I // ru
    assert launches[-1]["block"] == -(-(K * I // cw) // 32) * 32 and launches[-1]["grid"][0] == L // rd


def test_wrapper_refuses_by_name():
    from k3lab_kernels.cute import moe_dense as md

    case = OP.case(dtype="fp8", **SMALL)
    d = OP.make_inputs(case, 0, "cpu")
    m = d["moe"]
    with emulate.emulated() as em:
        mod = em.mod["moe_dense"]
        args = [emulate._dev(x) for x in (d["z"], d["idx"], d["weights_k"], m.w1.data, m.w3.data, m.w2.data,
                                          m.w1.scale, m.w3.scale, m.w2.scale, d["y"])]
        with pytest.raises(md.MoECuteError, match="'s2'"):  # fp8 without its row scales
            mod.moe_experts_dense(*args[:8], None, args[9])
        with pytest.raises(md.MoECuteError, match="'w3'"):  # a different format than w1
            mod.moe_experts_dense(args[0], args[1], args[2], args[3], emulate._dev(m.w3.data.to(torch.bfloat16)),
                                  *args[5:])
        with pytest.raises(md.MoECuteError, match="'z'"):  # two tokens
            mod.moe_experts_dense(emulate._dev(torch.zeros(2, 128, dtype=torch.bfloat16)), *args[1:])
        with pytest.raises(md.MoECuteError, match="'pdl'"):
            mod.moe_experts_dense(*args, pdl="yes")
        with pytest.raises(md.MoECuteError, match="latent a multiple of 256"):  # the grouped twins' sizes
            mod.moe_grouped_dense(*args)
    case = OP.case(dtype="bf16", batch=2, **GSMALL)
    d = OP.make_inputs(case, 0, "cpu")
    m = d["moe"]
    with emulate.emulated() as em:
        args = [emulate._dev(x) for x in (d["z"], d["idx"], d["weights_k"], m.w1.data, m.w3.data, m.w2.data)]
        with pytest.raises(md.MoECuteError, match="'s1'"):  # a row scale with bf16 weights
            em.mod["moe_dense"].moe_grouped_dense(*args, emulate._dev(torch.ones(4, 64)), None, None,
                                                  emulate._dev(d["y"]))


def test_component_routes_and_refuses(monkeypatch):
    """The op's `supports` lets cute take bf16 / fp8 at one token within a CTA's threads and at more where the grouped
    twins' sizes fit; the component refuses an unknown path and the glue for them, by name, before any kernel (CuTe
    DSL taken as present)."""
    from k3lab.components import dispatch, moe as c_moe

    monkeypatch.setattr(dispatch, "require_backend", lambda backend: None)
    from k3lab.ops.moe import experts_supports

    assert experts_supports("cute", dict(batch=1, dtype="fp8", top_k=16, inter=3072, tp=8, latent=3584)) is None
    assert experts_supports("cute", dict(batch=1, dtype="bf16", top_k=16, inter=3072, tp=8, latent=3584)) is None
    assert experts_supports("cute", dict(batch=64, dtype="fp8", top_k=16, inter=3072, tp=8, latent=3584)) is None
    assert "latent a multiple of 256" in experts_supports("cute", dict(batch=2, dtype="bf16", latent=128))
    assert "top-k x I/8" in experts_supports("cute", dict(batch=1, dtype="bf16", top_k=16, inter=3072, tp=1))
    d = OP.make_inputs(OP.case(dtype="bf16", **SMALL), 0, "cpu")
    with pytest.raises(c_moe.MoEArgumentError, match="'path'"):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="cute", path="fused")
    ssp = torch.zeros(1, 16)
    with pytest.raises(c_moe.MoEArgumentError, match="'glue'"):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="cute",
                      glue=(torch.ones(128, dtype=torch.bfloat16), torch.zeros(1, 128, dtype=torch.bfloat16), ssp))


# the grouped twins (several tokens, tensor cores): latent 256 (one down CTA of 4 tiles a warp), I 64 (two up CTAs of
# 32 rows; fp8: one 64-column chunk), 4 experts for 3 tokens x top 3 (groups of one, two and three pairs)
GSMALL = dict(tp=1, latent=256, inter=64, n_experts=4, top_k=3, routing="uniform")


def run_grouped(d, pdl=False, idx32=False, seed=0):
    moe = d["moe"]
    t = tensors(d, idx32, ("z", "idx", "w1", "w3", "w2"))

    def call(m, **a):
        m.mod["moe_dense"].moe_grouped_dense(a["z"], a["idx"], a["wk"], a["w1"], a["w3"], a["w2"], a.get("s1"),
                                             a.get("s3"), a.get("s2"), a["y"], b1=moe.b1, b2=moe.b2, pdl=pdl)
    emulate._run(call, t, seed)


@pytest.mark.parametrize("dtype,batch,routing,kw", [
    ("bf16", 3, "uniform", dict(pdl=True, idx32=True)), ("fp8", 3, "uniform", dict()),
    ("bf16", 9, "same16", dict()),   # every token the same experts: groups of 9 pairs, two member tiles
])
def test_grouped_dense(dtype, batch, routing, kw):
    case = OP.case(dtype=dtype, batch=batch, **dict(GSMALL, routing=routing))

    def f(d):
        run_grouped(d, **kw)
    f.__name__ = f"emulated cute moe_grouped_dense({kw})"
    checker.require(checker.check(OP, case, impl=f, seed=2, device="cpu"))
