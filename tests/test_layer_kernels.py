"""The layer builder (k3lab.model) runs the fused kernels where a component group's backend is triton: AttnRes +
RMSNorm, the router (trunk projection + top-k), the grouped experts, the MLA chain and the plain projections
(trunk.proj, the output projections' residual in its epilogue), each component against
its fp64 twin through the one checker (the layer notebook's check), under the Triton interpreter."""
import pytest
import torch

from k3lab.config import preset
from k3lab.harness import checker
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
        st = checker.check_twin(layer, ref_layer, lc[n][0], rc[n][0], None)
        assert st.rel_norm < 3e-2, (n, layer.ran[n], st)  # bf16 activations and weights against fp64
