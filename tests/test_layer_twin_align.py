"""The layer check's alignment of a router choice (k3lab.model.Layer.align_twin, used by
k3lab.harness.checker.check_twin): where the bf16 layer's router picks other experts than its fp64 twin and those
picks are the top-k of the layer's own input and weights (scored in fp64), the twin follows them and the row is
compared under one selection; a pick that is not (a dropped top expert, the worst expert, a repeated id) is left as
it is and fails."""
import pytest
import torch

from k3lab.config import preset
from k3lab.harness import checker
from k3lab.model import build_layer


def _layers():
    view = preset("tiny", batch=2, context=24)
    twin = build_layer(view, "kda", 0, backend="reference", dtype=torch.float64, n_experts=8)
    layer = build_layer(view, "kda", 0, n_experts=8)
    lc, rc = layer.components(), twin.components()
    for n in lc:  # every component before the router, in order
        if n == "router":
            return layer, twin, lc, rc
        checker.check_twin(layer, twin, lc[n][0], rc[n][0], None, name=n)
    raise AssertionError("no router component")


def _biased(L):
    r = L.w.mlp.router
    h = L._flat(L.buf["h2"]).double()
    return torch.sigmoid(h @ r.w.double().T)[0] + r.e_bias.double()


def test_a_near_tie_is_aligned_and_followed():
    """Token 0's twin-side k-th and (k+1)-th experts made a near-tie each way: the layer's own bias puts the
    (k+1)-th 1e-3 ahead, the twin's 1e-3 behind; the layer's real router call picks it, the twin follows."""
    layer, twin, lc, rc = _layers()
    k = twin.w.mlp.router.top_k
    order = torch.sort(-_biased(twin), stable=True).indices
    kth, nxt = int(order[k - 1]), int(order[k])
    for L, sign in ((layer, 1), (twin, -1)):
        b, r = _biased(L), L.w.mlp.router
        r.e_bias[nxt] += (b[kth] - b[nxt] + sign * 1e-3).to(r.e_bias.dtype)
    st = checker.check_twin(layer, twin, lc["router"][0], rc["router"][0], 2e-2, name="router")
    assert nxt in layer.buf["idx"][0].tolist() and kth not in layer.buf["idx"][0].tolist()
    assert st.ok and st.note and "of 2 tokens took experts the fp64 twin did not" in st.note, st
    assert nxt in twin.buf["idx"][0].tolist()  # the twin follows the layer's experts downstream
    lc = layer.components()
    for n in ("latent_down", "experts"):
        st = checker.check_twin(layer, twin, lc[n][0], rc[n][0], 2e-2, name=n)
        assert st.ok and st.note is None, (n, st)


@pytest.mark.parametrize("wrong", ["worst", "top1", "repeat"])
def test_a_wrong_pick_is_not_aligned_and_fails(wrong):
    """The router's call, then token 0's selection spoiled: the twin's k-th replaced by the worst expert, the top
    expert replaced by the (k+1)-th (a near-tie with the k-th, but the top one dropped), or the k-th by a repeat of
    the top expert."""
    layer, twin, lc, rc = _layers()
    k = twin.w.mlp.router.top_k
    fn = lc["router"][0]
    order = torch.sort(-_biased(twin), stable=True).indices

    def call():
        idx, wk = fn()
        row = idx[0].tolist()
        out_, in_ = {"worst": (int(order[k - 1]), int(order[-1])), "top1": (int(order[0]), int(order[k])),
                     "repeat": (int(order[k - 1]), int(order[0]))}[wrong]
        if out_ in row:
            row[row.index(out_)] = in_
        idx[0] = torch.tensor(row)
        return idx, wk
    st = checker.check_twin(layer, twin, call, rc["router"][0], 2e-2, name="router")
    assert st.note is None and not st.ok, st
    assert torch.equal(torch.sort(twin.buf["idx"][0]).values, torch.sort(order[:k]).values)  # the twin unchanged


def test_error_table_names_what_was_aligned():
    import types

    from k3lab.report import error_table_html
    row = dict(kind="gpu-graph", median_us=1.0, p10_us=1.0, p90_us=1.0, floor_us=1.0, floor_bw="read", distance=1.0,
               achieved_tbps=1.0, pct_of_bw=1.0, mode="rotated", launches=1)
    b = types.SimpleNamespace(rows=[
        types.SimpleNamespace(name="mla.router", backend="triton", **row,
                              error=dict(rel_norm=1e-3, max_abs=1e-3, ok=True, note="1 of 1 tokens took experts")),
        types.SimpleNamespace(name="mla.experts", backend="triton", **row, error=dict(rel_norm=1e-3, max_abs=1e-3,
                                                                                      ok=True))])
    html = error_table_html(b)
    assert html.count(" *</td>") == 1 and "mla.router (triton): 1 of 1 tokens took experts" in html
