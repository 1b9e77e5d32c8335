"""backend='auto' for KDA: the measured-winner table (data/kda_defaults.json) and the record of what ran."""
import json

import pytest
import torch

from k3lab.components import kda as comp
from k3lab.ref import kda as ref


def test_defaults_table_is_well_formed():
    d = json.loads(comp._DEFAULTS_PATH.read_text())
    for op in ("decode", "verify"):
        rules = d[op]
        assert rules and rules[-1]["max_batch"] is None, "the last rule must match any batch"
        for r in rules:
            assert r["backend"] in ("triton", "cute")
            assert r["tile_v"] in comp.TILE_V_ALLOWED
        fb = d["fallback"][op]
        assert fb and fb[-1]["max_batch"] is None, "the last fallback rule must match any batch"
        for r in fb:
            assert r["backend"] in ("triton", "reference")
            assert r["tile_v"] is None or r["tile_v"] in comp.TILE_V_ALLOWED


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_auto_on_cpu_runs_the_reference_and_says_so():
    inp, p, S, cs = ref.make_kda_inputs(2, 2, 16, seed=3)
    assert comp.auto_choice("decode", 2) == ("reference", None)
    comp.decode(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, S, cs, backend="auto")
    assert comp.last_run.backend == "reference" and comp.last_run.backend_requested == "auto"


def test_auto_follows_the_table_and_falls_back_without_cute(monkeypatch):
    monkeypatch.setattr(comp, "resolve_backend", lambda b="auto": "triton")
    monkeypatch.setattr(comp, "backend_status", lambda b: (False, "no cute here"))
    assert comp.auto_choice("decode", 1) == ("triton", 16)
    assert comp.auto_choice("decode", 64) == ("triton", 64)
    assert comp.auto_choice("verify", 1) == ("triton", 32)
    monkeypatch.setattr(comp, "backend_status", lambda b: (True, "pretend"))
    monkeypatch.setattr(comp, "_cute_module", lambda name: object())
    assert comp.auto_choice("decode", 1) == ("cute", 16)
    assert comp.auto_choice("decode", 2) == ("cute", 32)
    assert comp.auto_choice("decode", 4) == ("cute", 64)
    assert comp.auto_choice("decode", 64) == ("cute", 128)
    assert comp.auto_choice("verify", 8) == ("cute", 128)
