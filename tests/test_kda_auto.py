"""backend='auto' for KDA: the measured-winner table (data/kda_defaults.json) through k3lab.policy and the
one dispatcher, and the record of what ran (returned to the caller, never a module global)."""
import json

import pytest
import torch

from k3lab import policy
from k3lab.components import dispatch
from k3lab.components import kda as comp
from k3lab.ref import kda as ref


def test_defaults_table_is_well_formed():
    d = json.loads(policy.path("kda").read_text())
    for op in ("decode", "verify"):
        rules = d[op]
        assert rules and rules[-1]["max_batch"] is None, "the last rule must match any batch"
        for r in rules:
            assert r["backend"] in ("triton", "cute")
            assert r["tile_v"] in comp.TILE_V_ALLOWED
            assert set(r) <= {"max_batch", "max_T", "backend", "tile_v"}
        fb = d["fallback"][op]
        assert fb and fb[-1]["max_batch"] is None, "the last fallback rule must match any batch"
        for r in fb:
            assert r["backend"] in ("triton", "reference")
            assert r["tile_v"] is None or r["tile_v"] in comp.TILE_V_ALLOWED


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_auto_on_cpu_runs_the_reference_and_says_so():
    inp, p, S, cs = ref.make_kda_inputs(2, 2, 16, seed=3)
    assert dispatch.select("kda_decode", "auto", B=2)[:2] == ("reference", {})
    ran = []
    comp.decode(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, S, cs, backend="auto", ran=ran)
    (r,) = ran
    assert r.backend == "reference" and r.backend_requested == "auto" and "reference" in r.why
    assert not hasattr(comp, "last_run"), "what ran is the caller's, not a module global"


def _choice(key, B, T, runs):
    be, opts, _ = policy.choose("kda", key, B, T, lambda b: b in runs)
    return be, opts.get("tile_v")


def test_auto_follows_the_table_and_falls_back_without_cute():
    no_cute = ("triton",)
    assert _choice("decode", 1, 1, no_cute) == ("triton", 16)
    assert _choice("decode", 64, 1, no_cute) == ("triton", 128)
    assert _choice("verify", 1, 2, no_cute) == ("triton", 16)
    both = ("triton", "cute")
    assert _choice("decode", 1, 1, both) == ("cute", 16)
    assert _choice("decode", 2, 1, both) == ("cute", 16)
    assert _choice("decode", 4, 1, both) == ("cute", 128)   # measured: tile 128 from B=4 (fold + early)
    assert _choice("decode", 64, 1, both) == ("cute", 128)
    assert _choice("verify", 1, 4, both) == ("cute", 16)
    assert _choice("verify", 8, 4, both) == ("cute", 64)    # measured: tile 64 wins at B=8 T=4 only
    assert _choice("verify", 8, 2, both) == ("cute", 128)
    assert _choice("verify", 3, 3, both) == ("cute", 32)    # unmeasured B, T: the next measured above
    assert _choice("verify", 256, 8, both) == ("cute", 64)  # beyond the sweep: its largest case
    assert _choice("decode", 1, 1, ()) == ("reference", None)  # nothing can run: the reference, said so


def test_every_rule_list_ends_with_a_catch_all():
    """For every op, any (B, T) matches some rule of the table and of its fallback."""
    d = policy.table("kda")
    for rules in (d["decode"], d["verify"], d["fallback"]["decode"], d["fallback"]["verify"]):
        for B in (1, 3, 7, 64, 1000):
            for T in (1, 2, 5, 8, 16):
                assert any(policy.matches(r, B, T) for r in rules), (rules, B, T)


def _row(impl, B, T, tv, us, ok=True, heads=12):
    return {"backend": impl, "median_us": us, "error": {"ok": ok},
            "extra": {"heads": heads, "batch": B, "T": T, "tile_v": tv, "op": "kda_decode" if T == 1 else "kda_verify"}}


def test_default_rules_follow_the_measurements():
    rows = [_row("cute", 1, 1, 16, 3.0), _row("cute", 1, 1, 32, 4.0),
            _row("cute", 8, 1, 64, 5.0), _row("cute", 8, 1, 128, 6.0),
            _row("cute", 64, 1, 64, 9.0), _row("cute", 64, 1, 128, 8.0, ok=False),  # a failed check never wins
            _row("cute", 64, 1, 16, 1.0, heads=6),                                   # other head count: ignored
            _row("triton", 1, 1, 16, 0.5),                                           # other impl: ignored
            _row("cute", 4, 2, 32, 5.0), _row("cute", 4, 2, 64, 6.0), _row("cute", 4, 8, 64, 9.0),
            _row("cute", 4, 8, 32, 9.5), _row("cute", 64, 2, 64, 20.0), _row("cute", 64, 8, 64, 90.0)]
    keys = {"kda_decode": "decode", "kda_verify": "verify"}
    r = policy.default_rules(rows, "cute", key_of=lambda row: keys[row["extra"]["op"]], heads=12)
    assert r["decode"] == [{"max_batch": 1, "backend": "cute", "tile_v": 16},
                           {"max_batch": None, "backend": "cute", "tile_v": 64}]
    assert r["verify"] == [{"max_batch": 4, "max_T": 2, "backend": "cute", "tile_v": 32},
                           {"max_batch": 4, "max_T": None, "backend": "cute", "tile_v": 64},
                           {"max_batch": None, "backend": "cute", "tile_v": 64}]


def test_default_rules_never_compare_options_across_runs():
    """A later bundle that measured a (batch, T) case rules it alone: an option only the earlier run timed (faster on
    that day's machine) does not beat the later run's options (k3lab defaults: rows tagged with their bundle)."""
    def row(tile, us, bundle, batch=1):
        return {"backend": "triton", "median_us": us, "error": {"ok": True}, "_bundle": bundle,
                "extra": {"op": "kda_decode", "batch": batch, "T": 1, "heads": 12, "tile_v": tile}}

    rows = [row(16, 4.9, 0), row(32, 5.0, 0), row(64, 9.0, 0, batch=8), row(16, 5.4, 1), row(128, 5.6, 1)]
    rules = policy.default_rules(rows, "triton", key_of=lambda r: "decode", heads=12)["decode"]
    assert [(r["max_batch"], r["tile_v"]) for r in rules] == [(1, 16), (None, 64)]
    rows[3]["median_us"] = 5.7  # the later run's 128 now the faster: it wins, the earlier run's 16 / 32 do not count
    rules = policy.default_rules(rows, "triton", key_of=lambda r: "decode", heads=12)["decode"]
    assert [(r["max_batch"], r["tile_v"]) for r in rules] == [(1, 128), (None, 64)]
