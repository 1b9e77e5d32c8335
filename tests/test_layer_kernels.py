"""The layer builder (k3lab.model) runs the fused kernels where a component group's backend is triton: AttnRes +
RMSNorm, the router (trunk projection + top-k), the grouped experts, the MLA chain and the plain projections
(trunk.proj, the output projections' residual in its epilogue), each component against
its fp64 twin through the one checker (the layer notebook's check), under the Triton interpreter."""
import pytest
import torch

from k3lab.config import preset
from k3lab.harness import checker
from k3lab import model
from k3lab.model import build_layer
from k3lab.switches import Switches

TRITON = {"attnres": "triton", "router": "triton", "moe": "triton", "mla": "triton", "proj": "triton"}


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_layer_components_on_the_kernels(kind):
    view = preset("tiny", batch=2, context=24)
    ref_layer = build_layer(view, kind, 0, backend="reference", dtype=torch.float64, n_experts=8)
    layer = build_layer(view, kind, 0, switches=Switches().replace(backend=TRITON), n_experts=8)
    on = {n for n, be in layer.ran.items() if be == "triton"}
    want = {"attnres_attn", "attnres_mlp", "router", "experts", "latent_down", "gate_proj", "out_proj"} | (
        {"attn", "kv_proj"} if kind == "mla" else {"qkv_proj", "decay_proj"})
    assert want <= on, layer.ran
    rc, lc = ref_layer.components(), layer.components()
    for n in lc:  # in layer order: each component reads what the ones before it wrote
        st = checker.check_twin(layer, ref_layer, lc[n][0], rc[n][0], None, name=n)
        assert st.rel_norm < 3e-2, (n, layer.ran[n], st)  # bf16 activations and weights against fp64


@pytest.mark.parametrize("batch", [2, 17])
def test_layer_glu_mlps_on_two_launches(batch, monkeypatch):
    """The shared experts (both in one weight pair) and layer 0's dense MLP on the trunk kernel: two projection
    launches each (w1 and w3 of every MLP as one weight, then every w2 with the residual in its epilogue: over the
    SiTU prologue up to PROLOGUE_MAX_TOKENS tokens, after the glue's SiTU launch above), checked against the fp64
    twin."""
    from k3lab.components import glue, trunk

    calls = []
    real_proj, real_situ = trunk.proj, glue.situ_glu
    monkeypatch.setattr(trunk, "proj", lambda *a, **k: calls.append(("proj", k.get("prologue"))) or real_proj(*a, **k))
    monkeypatch.setattr(glue, "situ_glu", lambda *a, **k: calls.append(("situ", None)) or real_situ(*a, **k))
    view = preset("tiny", batch=batch, context=24)
    sw = Switches().replace(backend=TRITON)
    for idx, name in ((0, "dense_mlp"), (1, "shared")):
        ref_layer = build_layer(view, "kda", 0, backend="reference", dtype=torch.float64, n_experts=8,
                                layer_index=idx)
        layer = build_layer(view, "kda", 0, switches=sw, n_experts=8, layer_index=idx)
        rc, lc = ref_layer.components(), layer.components()
        assert name in lc, list(lc)
        for n in lc:
            calls.clear()
            st = checker.check_twin(layer, ref_layer, lc[n][0], rc[n][0], None, name=n)
            assert st.rel_norm < 3e-2, (n, st)
            if n == name:
                want = ([("proj", None), ("proj", ("situ",))] if batch <= 16 else
                        [("proj", None), ("situ", None), ("proj", None)])
                assert [(c, p[:1] if p else None) for c, p in calls] == want, calls
        glu = [v for k, v in layer._cat.items() if k[0] == "glu"]
        assert len(glu) == 1
        (w13, w2), = glu
        mlps = layer.w.mlp.shared if name == "shared" else [layer.w.mlp]
        assert w13.shape[0] == 2 * w2.shape[1] == 2 * sum(g.w1.shape[0] for g in mlps)


def test_moe_tile_n_sets_the_triton_experts_tile(monkeypatch):
    """The `moe_tile_n` switch reaches the triton experts as their block_n (the record says what ran, the output
    still matches the fp64 twin); the reference has no tile (the step's reference twins keep its switches); with the
    experts on cute (fixed tiles) a tile other than auto is refused by name."""
    from k3lab.switches import SwitchError

    view = preset("tiny", batch=2, context=24)
    ref_layer = build_layer(view, "kda", 0, backend="reference", dtype=torch.float64, n_experts=8, layer_index=1)
    layer = build_layer(view, "kda", 0, switches=Switches(moe_tile_n=16).replace(backend=TRITON), n_experts=8,
                        layer_index=1)
    rc, lc = ref_layer.components(), layer.components()
    for n in lc:
        st = checker.check_twin(layer, ref_layer, lc[n][0], rc[n][0], None, name=n)
        assert st.rel_norm < 3e-2, (n, st)
    ran = layer.records["experts"]
    assert ran["options"].get("block_n") == 16, ran
    ref32 = build_layer(view, "kda", 0, switches=Switches(moe_tile_n=32), n_experts=8, layer_index=1)
    ref32.components()["experts"][0]()  # the reference has no tile: its twins keep the step's switches
    assert "block_n" not in ref32.records.get("experts", {}).get("options", {})
    cute = Switches(moe_tile_n=32).replace(backend={**TRITON, "moe": "cute"})
    monkeypatch.setattr(model, "_moe_cute_takes", lambda L: True)  # as on a GPU with CuTe DSL at K3's sizes
    with pytest.raises(SwitchError, match="'moe_tile_n' = 32 .* run on 'cute'"):
        build_layer(view, "kda", 0, switches=cute, n_experts=8, layer_index=1).components()
    with pytest.raises(SwitchError, match="'moe_tile_n' = 128 is not allowed"):
        Switches(moe_tile_n=128)
