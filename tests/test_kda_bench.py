"""The generic bench (k3lab.bench.runner, `k3lab bench kda`, notebooks/02_kda.ipynb) on tiny KDA shapes.

On a CPU the Triton kernels run in the interpreter and timings are cpu-smoke: these tests prove the
sweep's plumbing (checks, rows, floors, bundle, report, winners), not speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3lab import policy, registry
from k3lab.bench import runner
from k3lab.harness.bundle import find_bundles, load
from k3lab.ops.kda import kda_bytes

ROOT = Path(__file__).resolve().parent.parent


def test_bytes_count_by_hand():
    HD = 12 * 128
    state = 64 * 12 * 128 * 128 * 4 * 2
    io = 64 * (3 * HD + HD + 12 + HD) * 2 + 64 * HD * 2
    conv = 64 * 3 * HD * 3 * 2 * 2
    params = 3 * HD * 4 * 2 + HD * 4 + 12 * 4 + 128 * 2
    assert kda_bytes(64, 12) == state + io + conv + params
    op = registry.get("kda_decode")
    assert op.nbytes(op.case(heads=12, batch=64)) == state + io + conv + params
    st = 12 * 128 * 128 * 4
    assert kda_bytes(1, 12, 4) - kda_bytes(1, 12, 4, hist=False) == st * 3 + 3 * HD * 3 * 2 * 4


def test_sweep_rows_bundle_and_winners(tmp_path):
    bd = runner.run("kda", grid=dict(heads=(2,), batch=(1,), T=(1, 3), tile_v=(8, 16), D=(16,)), reps=2,
                    device="cpu", kernels=False, log=lambda s: None)
    assert "cute" in bd.backends_skipped or torch.cuda.is_available()
    ours = [r for r in bd.rows if r.backend == "triton"]
    assert len(ours) == 2 * 2
    for r in ours:
        assert r.error["ok"], r.error  # checked against fp64 with poisoned outputs before timing
        assert r.kind == "cpu-smoke" and r.mode == "hot" and r.floor_bw == "copy"
    assert {r.backend for r in bd.rows} >= {"triton", "reference", "torch_compile"}
    path = bd.save(tmp_path)
    back = load(path)
    assert len(back.rows) == len(bd.rows) and back.copy_tbps == bd.copy_tbps and back.read_tbps == bd.read_tbps
    rows = json.loads(path.read_text())["rows"]
    w = policy.winners(rows, ("triton",))
    assert set(w) == {"heads2_batch1_T1", "heads2_batch1_T3"}
    assert all(v["options"]["tile_v"] in (8, 16) for v in w.values())


@pytest.mark.slow  # the default run executes 02_kda through the CPU plan (tests/test_report_sweep.py)
def test_kda_notebook_headless(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "k3lab.cli", "run", str(ROOT / "notebooks" / "02_kda.ipynb"),
           "-p", "heads", "2", "-p", "batches", "1", "-p", "Ts", "1,2", "-p", "tiles", "8", "-p", "D", "16",
           "-p", "reps", "2", "-p", "drift_steps", "10", "-p", "drift_every", "5", "--out", str(out), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "02_kda.html").exists()
    (bpath,) = find_bundles(out)
    b = load(bpath)
    assert any(n.startswith("drift: ") for n in b.notes) and any(n.startswith("winners: ") for n in b.notes)
    drift = json.loads(next(n for n in b.notes if n.startswith("drift: "))[len("drift: "):])
    # bf16 state drifts further from fp64 than fp32 state
    assert drift["state_err"]["bf16"] > drift["state_err"]["fp32"]


def test_bench_cli_refuses_unknown_component_and_grid_names():
    from typer.testing import CliRunner

    from k3lab import cli

    r = CliRunner().invoke(cli.app, ["bench", "nosuch"])  # in process: two interpreters' imports cost CI 8 s
    assert r.exit_code == 2 and "kda" in r.output
    r = CliRunner().invoke(cli.app, ["bench", "kda", "--grid", "tiles=8"])
    assert r.exit_code == 2 and "tiles" in r.output and "tile_v" in r.output


def test_flashinfer_multitoken_layouts_round_trip(monkeypatch):
    """The FlashInfer multi-token peer's layout conversions (k3lab.ops.kda.FlashInferKDAVerify), checked by the
    one checker with FlashInfer's kernel replaced by its semantics in torch (source slot idx[n, accepted - 1],
    conv columns accepted - 1..accepted + 1, a checkpoint per token into slot idx[n, t], the rolling conv
    window, value-major states): what the peer hands back must be our verify outputs."""
    import types

    from k3lab.bench import peers
    from k3lab.ops import kda as ok
    from k3lab.ref import kda as ref

    def fake_run(x, weight, conv, gate, beta, A_log, dt_bias, idx, qsl, acc, state, og, nw, lb, eps, out):
        N, T = idx.shape
        H, D = A_log.shape[0], 128
        HD = H * D
        p = ref.KDAParams(weight.permute(0, 2, 1).reshape(3 * HD, 4).double(), A_log.double(), dt_bias.double(),
                          nw.double(), eps, lb)
        for n in range(N):
            a = int(acc[n]) - 1
            cs, bos = int(idx[n, 0]), int(qsl[n])
            S = state[int(idx[n, a])].transpose(-1, -2).double()
            win = conv[cs, :, a:a + 3].double().clone()
            cols = [win[:, 1], win[:, 2]]
            for t in range(int(qsl[n + 1]) - bos):
                r = bos + t
                o, S, win = (v[0] for v in ref.kda_decode(
                    x[r:r + 1].double(), gate[0, r].reshape(1, HD).double(), beta[0, r].reshape(1, H).double(),
                    og[r].reshape(1, HD).double(), p, S[None], win[None], dtype=torch.float64,
                    out_dtype=torch.float64))
                state[int(idx[n, t])] = S.transpose(-1, -2).float()
                out[0, r] = o.view(H, D).to(out.dtype)
                cols.append(x[r].double())
            for j, col in enumerate(cols):
                conv[cs, :, j] = col.to(conv.dtype)

    monkeypatch.setattr(peers, "flashinfer_module", lambda name: types.SimpleNamespace(
        _run_fused_kda_decode_multitoken=fake_run))
    monkeypatch.setattr(peers, "flashinfer_available", lambda: (True, "torch stand-in"))
    op = registry.get("kda_verify")
    case = op.case(heads=12, batch=2, T=3)
    (peer,) = ok.flashinfer_mt_peer(case)
    res = peer.check(case, op.make_inputs(case, 0, "cpu"))
    assert res.ok, res.failures


def test_commit_rows_each_checked_on_the_inputs_as_made():
    """Two commit tiles on the same input sets: the second row's check must not see the state the first row's
    timing committed in place (state_hist was made from the start state), and `skip` leaves a peer out."""
    bd = runner.run("kda", ops=["kda_commit"], grid=dict(heads=(2,), batch=(2,), D=(16,), T=(4,), checkpoint=(2,),
                                                          accepted=("each",), tile_v=(8, 16)),
                    backends=("triton",), reps=2, device="cpu", kernels=False, skip=["torch_compile"],
                    log=lambda s: None)
    ours = [r for r in bd.rows if r.backend == "triton"]
    assert len(ours) == 2 and all(r.error["ok"] for r in ours), [r.error for r in ours]
    assert "torch_compile" not in {r.backend for r in bd.rows} and "reference" in {r.backend for r in bd.rows}
    assert bd.config["skip"] == ["torch_compile"]


def test_auto_passes_over_a_backend_that_cannot_take_the_shape(monkeypatch):
    """`auto` skips the CuTe rule for a head dim the CuTe kernels do not take (the numerics' tiny model on a GPU
    with CuTe DSL installed) and says so; the named backend is refused with the reason."""
    from k3lab.components import dispatch
    from k3lab.switches import BackendUnavailable

    monkeypatch.setattr(dispatch, "can_run", lambda op, b: b in ("cute", "triton", "reference"))
    be, _, why = dispatch.select("kda_decode", "auto", B=1, shape=dict(D=16, W=4, T=1))
    assert be == "triton" and "head_dim 128" in why
    be, _, _ = dispatch.select("kda_decode", "auto", B=1, shape=dict(D=128, W=4, T=1))
    assert be == "cute"
    be, _, _ = dispatch.select("kda_verify", "auto", B=1, T=4, shape=dict(D=128, W=3, T=4))
    assert be != "cute"
    monkeypatch.setattr(dispatch, "require_backend", lambda b: None)
    monkeypatch.setattr(dispatch, "_importable", lambda op, b: None)
    with pytest.raises(BackendUnavailable, match="head_dim 128"):
        dispatch.select("kda_decode", "cute", B=1, shape=dict(D=16, W=4, T=1))


def test_row_labels_tell_an_explicit_false_from_the_default():
    """An option value names its row unless it is None, or False where the option takes no None (KDA's pdl): proj's
    f16 takes None, False and True, so f16=False is a row of its own beside the default's."""
    proj, dec = registry.get("proj"), registry.get("kda_decode")
    assert runner._shown(proj, "f16", False) and runner._shown(proj, "f16", True)
    assert not runner._shown(proj, "f16", None) and not runner._shown(proj, "path", None)
    assert not runner._shown(dec, "pdl", False) and runner._shown(dec, "tile_v", 16)
