"""The layer check's alignment of a router choice made at a near-tie (k3lab.model.Layer.align_twin, used by
k3lab.harness.checker.check_twin): a bf16 layer that picks the twin's 17th expert in place of its 16th, where the
two fp64 scores are closer than the input's rounding explains, is compared (and continued) under its own
selection; a pick the rounding cannot explain is left as it is and fails."""
import torch

from k3lab.config import preset
from k3lab.harness import checker
from k3lab.model import build_layer
from k3lab.ref import router as ref_router


def _layers():
    view = preset("tiny", batch=2, context=24)
    twin = build_layer(view, "kda", 0, backend="reference", dtype=torch.float64, n_experts=8)
    layer = build_layer(view, "kda", 0, n_experts=8)
    return layer, twin


def _run_to_router(layer, twin):
    lc, rc = layer.components(), twin.components()
    for n in lc:
        if n == "router":
            return lc, rc
        checker.check_twin(layer, twin, lc[n][0], rc[n][0], None, name=n)
    raise AssertionError("no router component")


def _swap(layer, twin, near: bool):
    """The layer's router call, then token 0's weakest pick replaced by the twin's best unpicked expert (near:
    the twin's bias moved so that expert trails the weakest pick by 1e-9) or by its worst expert."""
    r = twin.w.mlp.router
    h = twin._flat(twin.buf["h2"])
    biased = ref_router.router_scores(h, r) + r.e_bias
    order = torch.sort(-biased[0], stable=True).indices
    k = r.top_k
    weakest, other = int(order[k - 1]), int(order[k] if near else order[-1])
    if near:
        r.e_bias[other] += biased[0, weakest] - biased[0, other] - 1e-9
    fn = layer.components()["router"][0]

    def call():
        fn()
        idx, wk = layer.buf["idx"], layer.buf["wk"]
        idx[0][idx[0] == weakest] = other
        s = ref_router.router_scores(layer._flat(layer.buf["h2"]).float(), layer.w.mlp.router)[0, idx[0]]
        wk[0] = (s / s.sum() * r.scaling).to(wk.dtype)  # the weights the kernel gives its own picks
        return idx, wk
    return call, other


def test_near_tie_is_aligned_and_followed():
    layer, twin = _layers()
    _, rc = _run_to_router(layer, twin)
    call, other = _swap(layer, twin, near=True)
    st = checker.check_twin(layer, twin, call, rc["router"][0], 2e-2, name="router")
    assert st.ok and st.note and "1 of 2 tokens" in st.note, st
    assert other in twin.buf["idx"][0].tolist()  # the twin follows the layer's experts downstream
    lc = layer.components()
    st = checker.check_twin(layer, twin, lc["latent_down"][0], rc["latent_down"][0], 2e-2, name="latent_down")
    st = checker.check_twin(layer, twin, lc["experts"][0], rc["experts"][0], 2e-2, name="experts")
    assert st.ok and st.note is None, st


def test_unexplained_pick_still_fails():
    layer, twin = _layers()
    _, rc = _run_to_router(layer, twin)
    call, other = _swap(layer, twin, near=False)
    st = checker.check_twin(layer, twin, call, rc["router"][0], 2e-2, name="router")
    assert not st.ok and st.note is None, st
    assert other not in twin.buf["idx"][0].tolist()


def test_error_table_names_what_was_aligned():
    import types

    from k3lab.report import error_table_html
    row = dict(kind="gpu-graph", median_us=1.0, p10_us=1.0, p90_us=1.0, floor_us=1.0, floor_bw="read", distance=1.0,
               achieved_tbps=1.0, pct_of_bw=1.0, mode="rotated", launches=1)
    b = types.SimpleNamespace(rows=[
        types.SimpleNamespace(name="mla.router", backend="triton", **row,
                              error=dict(rel_norm=1e-3, max_abs=1e-3, ok=True, note="1 of 1 tokens took a near-tie")),
        types.SimpleNamespace(name="mla.experts", backend="triton", **row, error=dict(rel_norm=1e-3, max_abs=1e-3,
                                                                                      ok=True))])
    html = error_table_html(b)
    assert html.count(" *</td>") == 1 and "mla.router (triton): 1 of 1 tokens took a near-tie" in html
