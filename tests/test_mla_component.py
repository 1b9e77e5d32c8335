"""The MLA component API (k3lab.components.mla): dispatch and its records, argument errors by name, the
AITER refusal, the layer-level decode / verify on the triton backend against the reference, partials
(merge=False) and the layer builder's MLA attention on triton. Small shapes (the tiny preset: C = 32,
Dr = 8, Dv = 16, so the kernels' masked paths for widths other than 512/64/128 run too)."""
from __future__ import annotations

import pytest
import torch

from k3lab.components import mla
from k3lab.components.mla import MLAArgumentError
from k3lab.config import preset
from k3lab.ref import mla as ref
from k3lab.switches import BackendUnavailable, SwitchError
from k3lab.weights import make_mla_attn
from k3lab.harness.numerics import rel_norm_error

C, DR = 512, 64


def _attend_inputs(B=2, T=1, H=12, ctx=20, seed=0, paged=0, kv_dtype=None, fp8_scale="tensor"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, C, generator=g).bfloat16()
    qr = torch.randn(B, T, H, DR, generator=g).bfloat16()
    cache = ref.MLACache.empty(B, ctx + T, C + DR, kv_dtype=kv_dtype, fp8_scale=fp8_scale)
    cache.write(torch.zeros(B, dtype=torch.long), torch.randn(B, ctx + T, C + DR, generator=g))
    if paged:
        cache = ref.PagedMLACache.from_contiguous(cache, paged, spare_pages=1, seed=seed)
    lengths = torch.tensor([ctx - 3 * b for b in range(B)], dtype=torch.int32)
    return q, qr, cache, lengths


_rel = rel_norm_error  # the one relative-error helper (NaN never passes a tolerance)


# ---- dispatch ------------------------------------------------------------------------------------------

def test_attend_triton_matches_reference_and_records():
    q, qr, cache, lengths = _attend_inputs(T=2, paged=16)
    ran = []
    o, lse = mla.attend(q, qr, cache, lengths, scale=0.1, backend="triton", partitions=None, dcp=2, ran=ran)
    o_ref, lse_ref = mla.attend(q, qr, cache, lengths, scale=0.1, ran=ran)
    assert o.dtype == torch.float32 and _rel(o, o_ref) < 5e-3 and _rel(lse, lse_ref) < 1e-5
    tri, rf = ran
    assert tri.op == "mla_decode" and tri.backend == "triton" and tri.kernel.endswith("mla_decode:mla_decode")
    assert tri.options["dcp"] == 2 and tri.options["partitions"] >= 1 and "automatic" in tri.notes
    assert tri.shape["page_size"] == 16 and rf.backend == "reference" and rf.why == "requested"


def test_attend_partials_merge_to_the_result():
    q, qr, cache, lengths = _attend_inputs(T=1)
    o, lse = mla.attend(q, qr, cache, lengths, scale=0.1, backend="triton", partitions=3, dcp=2)
    op_, lp = mla.attend(q, qr, cache, lengths, scale=0.1, backend="triton", partitions=3, dcp=2, merge=False)
    assert op_.shape == (2, 6, 1, 12, C) and lp.shape == (2, 6, 1, 12)
    om, lm = ref.merge_stacked(op_.double(), lp.double())
    assert _rel(om, o) < 1e-6 and _rel(lm, lse) < 1e-6
    rp, rl = mla.attend(q, qr, cache, lengths, scale=0.1, partitions=3, dcp=2, merge=False)
    assert rp.shape == op_.shape  # the reference's partials have the same layout (its pieces may differ)


def test_auto_follows_the_table():
    """data/mla_defaults.json: triton for every op at batch 1; without a GPU nothing runs but the reference."""
    from k3lab import policy

    for key in ("decode", "combine", "cache_write"):
        assert policy.rule("mla", key, 1)["backend"] == "triton"
    q, qr, cache, lengths = _attend_inputs()
    ran = []
    mla.attend(q, qr, cache, lengths, scale=0.1, backend="auto", ran=ran)
    want = "triton" if torch.cuda.is_available() else "reference"
    assert ran[0].backend == want and ran[0].backend_requested == "auto"
    if want == "reference":
        assert "reference" in ran[0].why


def test_auto_decode_runs_cute_above_batch_32_where_it_takes_the_call(monkeypatch):
    """The decode rule (profiles/h200/mla_rule_sweep.json.gz): triton to batch 32, cute for one new position above
    it where the CuTe kernel takes the call (bf16 cache, no DCP), else triton (the next rule, or the fallback)."""
    from k3lab.components import dispatch

    monkeypatch.setattr(dispatch, "can_run", lambda op, be: be in ("triton", "cute", "reference"))
    shape = dict(H=12, C=C, Dr=DR, dcp=1, kv_dtype="bf16", pad_heads=0)
    for B, T, extra, want in [(1, 1, {}, "triton"), (32, 1, {}, "triton"), (33, 1, {}, "cute"), (64, 1, {}, "cute"),
                              (64, 4, {}, "triton"), (64, 1, {"kv_dtype": "fp8"}, "triton"),
                              (64, 1, {"dcp": 2}, "triton")]:
        be, _, why = dispatch.select("mla_decode", "auto", B=B, T=T, shape=dict(shape, B=B, T=T, **extra))
        assert be == want, (B, T, extra, why)
    monkeypatch.setattr(dispatch, "can_run", lambda op, be: be in ("triton", "reference"))  # no CuTe DSL here
    assert dispatch.select("mla_decode", "auto", B=64, T=1, shape=dict(shape, B=64, T=1))[0] == "triton"


def test_out_buffers_are_filled():
    q, qr, cache, lengths = _attend_inputs()
    out, lse = torch.full((2, 1, 12, C), float("nan")), torch.full((2, 1, 12), float("nan"))
    o, l = mla.attend(q, qr, cache, lengths, scale=0.1, backend="triton", out=out, lse=lse, partitions=2)
    assert o is out and l is lse and torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_combine_and_write_records():
    ran = []
    g = torch.Generator().manual_seed(1)
    o, l = torch.randn(1, 4, 1, 6, C, generator=g), torch.randn(1, 4, 1, 6, generator=g)
    w_uv = (torch.randn(6, C, 128, generator=g) * 0.05).bfloat16()
    gate = torch.randn(1, 1, 6 * 128, generator=g).bfloat16()
    y = mla.combine(o, l, w_uv, gate, backend="triton", block_v=64, ran=ran)
    y_ref = mla.combine(o, l, w_uv, gate, ran=ran)
    assert y.dtype == torch.bfloat16 and _rel(y, y_ref) < 1e-2
    merged = mla.combine(o[:, 0], None, w_uv, gate, backend="triton")  # K = 1: an o_lat
    assert _rel(merged, mla.combine(o[:, 0], None, w_uv, gate)) < 1e-2
    _, _, cache, lengths = _attend_inputs(kv_dtype="fp8", fp8_scale="token", paged=1)
    kv = torch.randn(2, 1, C + DR, generator=g).bfloat16()
    mla.write_cache(kv, torch.ones(C).bfloat16(), cache, lengths, backend="triton", ran=ran)
    assert [r.op for r in ran] == ["mla_combine", "mla_combine", "mla_cache_write"]
    assert ran[0].options["block_v"] == 64 and ran[2].shape["fp8_scale"] == "token"


# ---- the layer: decode / verify --------------------------------------------------------------------------

def _layer(batch=2, ctx=12, kv_dtype=None, seed=0):
    view = preset("tiny", batch=batch)
    w = make_mla_attn(view, 3, seed)  # bf16
    g = torch.Generator().manual_seed(seed)
    cache = ref.MLACache.empty(batch, ctx + 6, w.entry_width, kv_dtype=kv_dtype)
    cache.write(torch.zeros(batch, dtype=torch.long), torch.randn(batch, ctx, w.entry_width, generator=g))
    lengths = torch.tensor([ctx, ctx - 5][:batch])
    return view, w, cache, lengths, g


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
@pytest.mark.parametrize("T", [1, 3])
def test_layer_triton_matches_reference(kv_dtype, T):
    view, w, cache, lengths, g = _layer(kv_dtype=kv_dtype)
    h = torch.randn(2, T, view.cfg.hidden_size, generator=g).bfloat16()
    c_ref, c_tri = cache.clone(), cache.clone()
    ran = []
    if T == 1:
        y_ref = mla.decode(h[:, 0], w, c_ref, lengths)
        y = mla.decode(h[:, 0], w, c_tri, lengths, backend="triton", partitions=2, pad_heads=16, dcp=2, ran=ran)
    else:
        y_ref = mla.verify(h, w, c_ref, lengths)
        y = mla.verify(h, w, c_tri, lengths, backend="triton", partitions=None, ran=ran)
    assert [r.op for r in ran] == ["mla_cache_write", "mla_decode", "mla_combine"]
    assert all(r.backend == "triton" for r in ran)
    assert _rel(y, y_ref) < 3e-2  # bf16 activations both ways; the reference rounds o_lat to bf16 first
    written = (c_tri.data.float() - c_ref.data.float()).abs().max()
    assert written <= (0.07 if kv_dtype else 0.02) * c_ref.data.float().abs().max()


def test_layer_builder_runs_the_triton_attention():
    from k3lab.model import build_layer
    from k3lab.switches import Switches

    view = preset("tiny", batch=2, context=24, draft_depth=1)
    sw = Switches(mla_partitions=4, pad_heads=16)
    ref_layer = build_layer(view, "mla", 0, backend="reference", dtype=torch.float64, switches=sw, n_experts=4)
    layer = build_layer(view, "mla", 0, backend="triton", switches=sw, n_experts=4)
    assert layer.ran["attn"] == "triton"
    names = ("q_proj", "kv_proj", "attn", "gate_proj", "out_proj")
    rc, lc = ref_layer.components(), layer.components()
    for n in names:  # the cache write kernel, split + merge, then the combine (Wuv + gate) and Wo
        a, b = rc[n][0](), lc[n][0]()
    assert layer.buf["o_lat"].dtype == torch.float32
    assert _rel(b, a) < 3e-2  # bf16 activations and weights against the fp64 twin


# ---- argument errors, by name ------------------------------------------------------------------------------

def test_attend_argument_errors():
    q, qr, cache, lengths = _attend_inputs()
    kw = dict(scale=0.1, backend="triton")
    cases = [
        ("'q_lat'", lambda: mla.attend(q[0], qr, cache, lengths, **kw)),
        ("'q_rope'", lambda: mla.attend(q, qr[:, :, :6], cache, lengths, **kw)),
        ("'cache'", lambda: mla.attend(q, qr, cache.data, lengths, **kw)),
        ("'cache'", lambda: mla.attend(q, qr[..., :32], cache, lengths, **kw)),
        ("'cache'", lambda: mla.attend(q, qr, ref.MLACache(cache.data.float()), lengths, **kw)),
        ("'lengths'", lambda: mla.attend(q, qr, cache, lengths[:1], **kw)),
        ("'lengths'", lambda: mla.attend(q, qr, cache, lengths.float(), **kw)),
        ("'lengths'", lambda: mla.attend(q, qr, cache, lengths + 100, **kw)),
        ("'partitions'", lambda: mla.attend(q, qr, cache, lengths, partitions=0, **kw)),
        ("'partitions'", lambda: mla.attend(q, qr, cache, lengths, partitions=513, **kw)),
        ("'dcp'", lambda: mla.attend(q, qr, cache, lengths, dcp=0, **kw)),
        ("'pad_heads'", lambda: mla.attend(q, qr, cache, lengths, pad_heads=8, **kw)),
        ("'dcp_layout'", lambda: mla.attend(q, qr, cache, lengths, dcp_layout="rows", **kw)),
        ("'merge'", lambda: mla.attend(q, qr, cache, lengths, merge=1, **kw)),
        ("'out'", lambda: mla.attend(q, qr, cache, lengths, out=torch.empty(2, 1, 12, C).bfloat16(), **kw)),
        ("'lse'", lambda: mla.attend(q, qr, cache, lengths, lse=torch.empty(2, 12), **kw)),
        ("'n_positions'", lambda: mla.attend(q, qr, cache, lengths, n_positions=10_000, **kw)),
        ("'q_lat'", lambda: mla.attend(q.double(), qr.double(), cache, lengths, **kw)),
        ("'block_n'", lambda: mla.attend(q, qr, cache, lengths, block_n=24, **kw)),
        ("'num_warps'", lambda: mla.attend(q, qr, cache, lengths, num_warps=3, **kw)),
        ("'preload_pages'", lambda: mla.attend(q, qr, cache, lengths, preload_pages=8, **kw)),
        ("'host_chunk'", lambda: mla.attend(q, qr, cache, lengths, host_chunk=1, **kw)),
        ("'ksplit'", lambda: mla.attend(q, qr, cache, lengths, ksplit=2, **kw)),
        ("'ksplit'", lambda: mla.attend(q[..., :96], qr, ref.MLACache(cache.data[..., 416:].contiguous()), lengths,
                                        ksplit=4, **kw)),
    ]
    for name, fn in cases:
        with pytest.raises(MLAArgumentError, match=name):
            fn()


def test_combine_and_write_argument_errors():
    o, l = torch.randn(1, 2, 1, 4, C), torch.randn(1, 2, 1, 4)
    w_uv, gate = torch.zeros(4, C, 128).bfloat16(), torch.zeros(1, 1, 512).bfloat16()
    kw = dict(backend="triton")
    for name, fn in [
        ("'o_parts'", lambda: mla.combine(o[0, 0], l, w_uv, gate, **kw)),
        ("'lse_parts'", lambda: mla.combine(o, l[:, :1], w_uv, gate, **kw)),
        ("'lse_parts'", lambda: mla.combine(o[:, 0], l, w_uv, gate, **kw)),
        ("'w_uv'", lambda: mla.combine(o, l, w_uv[:2], gate, **kw)),
        ("'w_uv'", lambda: mla.combine(o, l, w_uv.float(), gate, **kw)),
        ("'gate'", lambda: mla.combine(o, l, w_uv, gate[..., :100], **kw)),
        ("'block_v'", lambda: mla.combine(o, l, w_uv, gate, block_v=48, **kw)),
        ("'block_r'", lambda: mla.combine(o, l, w_uv, gate, block_r=8, **kw)),
        ("'out'", lambda: mla.combine(o, l, w_uv, gate, torch.empty(1, 1, 512), **kw)),
    ]:
        with pytest.raises(MLAArgumentError, match=name):
            fn()
    _, _, cache, lengths = _attend_inputs()
    kv, nw = torch.zeros(2, 1, C + DR).bfloat16(), torch.ones(C).bfloat16()
    for name, fn in [
        ("'kv'", lambda: mla.write_cache(kv[0], nw, cache, lengths, **kw)),
        ("'kv_norm'", lambda: mla.write_cache(kv, torch.ones(C + DR), cache, lengths, **kw)),
        ("'cache'", lambda: mla.write_cache(kv[:1], nw, cache, lengths[:1], **kw)),
        ("'lengths'", lambda: mla.write_cache(kv, nw, cache, lengths + 1000, **kw)),
        ("'eps'", lambda: mla.write_cache(kv, nw, cache, lengths, eps=0, **kw)),
    ]:
        with pytest.raises(MLAArgumentError, match=name):
            fn()


def test_backends_refused_by_name():
    q, qr, cache, lengths = _attend_inputs()
    with pytest.raises(BackendUnavailable, match="ROCm") as e:
        mla.attend(q, qr, cache, lengths, scale=0.1, backend="aiter")
    assert "triton" in str(e.value)  # says what to use instead
    view, w, c, lens, _ = _layer()
    with pytest.raises(BackendUnavailable, match="aiter"):
        mla.decode(torch.zeros(2, view.cfg.hidden_size).bfloat16(), w, c, lens, backend="aiter")
    with pytest.raises(BackendUnavailable, match="aiter"):
        mla.write_cache(torch.zeros(2, 1, C + DR), torch.ones(C), cache, lengths, backend="aiter")
    with pytest.raises(SwitchError, match="'cuda'"):
        mla.attend(q, qr, cache, lengths, scale=0.1, backend="cuda")
    with pytest.raises(TypeError, match="ran must be a list"):
        mla.attend(q, qr, cache, lengths, scale=0.1, ran=())


def test_layer_path_rule_of_the_cute_decode():
    """The layer builder's mla group on `cute` (k3lab.model._PATH_RULES): K3's widths, one new position, a bf16 cache,
    pad_heads 0 or 16; anything else is refused with the rule's reason (no silent fallback)."""
    from types import SimpleNamespace as NS

    from k3lab import model

    takes, why = model._PATH_RULES[("mla", "cute")]

    def layer(T=1, heads=12, C=512, Dr=64, dtype=torch.bfloat16, pad=0):
        attn = NS(heads=heads, kv_lora=C, rope_dim=Dr)
        return NS(kind="mla", B=1, T=T, w=NS(attn=attn), state=NS(cache=NS(dtype=dtype)), switches=NS(pad_heads=pad))

    assert takes(layer()) and takes(layer(heads=6, pad=16))
    for bad in (dict(T=4), dict(heads=20), dict(C=32, Dr=8), dict(dtype=torch.float8_e4m3fn), dict(pad=32)):
        assert not takes(layer(**bad)), bad
    assert "one new position" in why
    assert not takes(NS(kind="kda"))


def test_auto_combine_runs_cute_over_many_partials_where_it_takes_the_call(monkeypatch):
    """The combine rule by query rows (B x T), T and partials k (data/mla_defaults.json: profiles/h200/
    mla_combine_b2t.json.gz and profiles/h100-80gb-hbm3/mla_combine_rowk57 / _t2big57 by rows, the H100's
    mla_combine_premerge55 at T = 1 above batch 8; those three in git history at 7e3e20a): plain triton up to 8 rows
    (its one-row kernel over partials); above batch 8 at T = 1 premerge over >= 64, cute over 8..63, plain triton below;
    at T > 1 cute over 4..33 at 9..16 rows, else premerge (K = 1, merged before: plain triton); cute only where the CuTe
    kernel takes the call (K3's C / Dv, fp32 partials, bf16 weights and gate, no Triton option), else the fallback;
    without CuTe DSL the fallback's triton. The bench's auto rows look the rule up with the case's partials
    (k3lab.ops.mla.combine_facts)."""
    from k3lab import policy, registry
    from k3lab.components import dispatch

    monkeypatch.setattr(dispatch, "can_run", lambda op, be: be in ("triton", "cute", "reference"))
    facts = dict(C=C, Dv=128, parts_dtype="float32", w_dtype="bfloat16", gate_dtype="bfloat16")
    pm = "premerge"
    for B, T, extra, want in [(1, 1, {"k": 33}, "triton"), (2, 1, {"k": 64}, "triton"), (1, 2, {"k": 16}, "triton"),
                              (4, 1, {"k": 4}, "triton"), (4, 1, {"k": 8}, "triton"), (2, 2, {"k": 16}, "triton"),
                              (1, 4, {"k": 1}, "triton"), (8, 1, {"k": 64}, "triton"), (16, 1, {"k": 4}, "triton"),
                              (2, 4, {"k": 33}, "triton"), (4, 4, {"k": 4}, "cute"), (4, 4, {"k": 33}, "cute"),
                              (4, 4, {"k": 64}, pm), (8, 2, {"k": 16}, "cute"), (8, 2, {"k": 64}, pm),
                              (4, 4, {"k": 2}, pm), (64, 2, {"k": 33}, pm), (64, 2, {"k": 1}, "triton"),
                              (16, 1, {"k": 64}, pm), (16, 1, {"k": 8}, "cute"), (64, 1, {"k": 33}, "cute"),
                              (64, 1, {"k": 33, "C": 256}, "triton"), (64, 1, {"k": 33, "gate_dtype": "float32"},
                                                                       "triton"),
                              (4, 4, {"k": 8, "block_v": 64}, pm),
                              (64, 1, {"k": 33, "block_v": 64}, "triton"), (64, 1, {"k": 33, "block_r": 16}, "triton"),
                              (64, 1, {"k": 33, "premerge": True}, "triton")]:
        be, opts, why = dispatch.select("mla_combine", "auto", B=B, T=T, shape=dict(facts, **extra))
        assert (pm if opts.get("premerge") else be) == want, (B, T, extra, why)
        assert opts.get("premerge") in (None, True) and (opts.get("premerge") is None or be == "triton")
    monkeypatch.setattr(dispatch, "can_run", lambda op, be: be in ("triton", "reference"))  # no CuTe DSL here
    assert dispatch.select("mla_combine", "auto", B=64, T=1, shape=dict(facts, k=33))[0] == "triton"
    op = registry.get("mla_combine")
    case = op.case(heads=12, batch=32, T=1, partitions=16, dcp=2)
    assert op.rule_facts(case) == {"k": 32}
    assert policy.rule("mla", "combine", 32, 1, op.rule_facts(case))["backend"] == "cute"
    # the component states its facts for auto: a call on the CPU runs the reference, with the rule's reason
    g = torch.Generator().manual_seed(2)
    o, lse = torch.randn(16, 8, 1, 2, C, generator=g), torch.randn(16, 8, 1, 2, generator=g)
    w_uv = (torch.randn(2, C, 128, generator=g) * 0.05).bfloat16()
    gate = torch.randn(16, 1, 2 * 128, generator=g).bfloat16()
    ran = []
    monkeypatch.setattr(dispatch, "can_run", lambda op, be: be == "reference")
    mla.combine(o, lse, w_uv, gate, backend="auto", ran=ran)
    assert ran[-1].backend == "reference" and ran[-1].backend_requested == "auto"


def test_auto_combine_passes_the_rules_premerge(monkeypatch):
    """Where auto's combine rule names premerge (above batch 8 at T = 1 over >= 64 partials), the Triton call runs
    with it, records it and matches the reference; an explicit premerge=False wins over the rule."""
    from k3lab.components import dispatch

    monkeypatch.setattr(dispatch, "can_run", lambda op, be: be in ("triton", "reference"))
    g = torch.Generator().manual_seed(3)
    B, K, H, Cs, Dv = 9, 64, 2, 32, 16
    o, lse = torch.randn(B, K, 1, H, Cs, generator=g), torch.randn(B, K, 1, H, generator=g)
    w_uv = (torch.randn(H, Cs, Dv, generator=g) * 0.2).bfloat16()
    gate = torch.randn(B, 1, H * Dv, generator=g).bfloat16()
    ref = mla.combine(o, lse, w_uv, gate, backend="reference").float()
    for given, want in ((None, True), (False, False)):
        ran = []
        y = mla.combine(o, lse, w_uv, gate, backend="auto", premerge=given, ran=ran)
        assert ran[-1].backend == "triton" and ran[-1].options["premerge"] is want
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-2


def test_policy_max_rows_bounds_batch_times_T():
    """A rule's max_rows bounds B x T (the query rows a call carries); absent or null: any."""
    from k3lab import policy

    assert "max_rows" in policy.RULE_KEYS
    r = {"max_rows": 8, "backend": "cute"}
    assert policy.matches(r, 8, 1) and policy.matches(r, 2, 4) and policy.matches(r, 1, 8)
    assert not policy.matches(r, 4, 4) and not policy.matches(r, 9, 1)
    assert policy.matches({"max_rows": None, "backend": "triton"}, 64, 8)
    assert policy.options_of({"max_rows": 4, "backend": "triton", "premerge": True}) == {"premerge": True}
