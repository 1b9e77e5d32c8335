"""The CuTe DSL KDA kernels (kernels/cute/kda_*.py) on the CPU emulator (kernels/cute/emulate.py): their
logic checked without a GPU or nvidia-cutlass-dsl, as TRITON_INTERPRET=1 checks the Triton kernels.

The checks are kernels/cute/check_kda.py's own (check_decode / check_verify / check_prefill: fresh inputs,
outputs poisoned with NaN, the fp64 oracle; out < 1e-2, state < 1e-4, conv exact, ragged entries untouched,
inputs unchanged) with its tensors on the CPU and its kernel entry points swapped for the emulator's. Shapes
are small (D = 128 is fixed by the kernels): the whole file runs in well under 90 s on 2 CPU cores. Then a
few deliberate breakages (a missing barrier, a wrong mbarrier parity, a missing arrive, a cluster wait
without arrive, a DSMEM store before the cluster barrier, out-of-bounds, misaligned and divergent code) must
make the emulator raise.
"""
import functools
import sys
import types

import pytest
import torch

try:
    from k3lab_kernels.cute import check_kda as ck
    from k3lab_kernels.cute import emulate
    from k3lab_kernels.cute.kda_decode_persistent import CONFIGS
    from k3lab_kernels.cute.kda_verify import ROW_WARPS_ALLOWED
except ImportError:  # the checkout's kernels/ folder
    from kernels.cute import check_kda as ck
    from kernels.cute import emulate
    from kernels.cute.kda_decode_persistent import CONFIGS
    from kernels.cute.kda_verify import ROW_WARPS_ALLOWED

pytestmark = pytest.mark.cute_emu

SMS = 1  # the persistent decode's grid = min(B*H, ctas * SMS): every CTA loops over several items


def _launch_verify(qkv, f, b, gate, p, st, cs, out, sh, ch, lengths, tile_v, layout, row_warps, **knobs):
    """kda_verify's _launch (the knob path check_kda uses) on the emulator."""
    emulate.run_verify(qkv, f, b, gate, p, st, cs, out, sh, ch, lengths=lengths, tile_v=tile_v, layout=layout,
                       row_warps=row_warps, **knobs)


def _launch_decode(qkv, f, b, gate, p, st, cs, out, tile_v, pdl=False, **knobs):
    """kda_decode's _launch_decode (the knob path check_kda uses) on the emulator."""
    emulate.run_decode(qkv, f, b, gate, p, st, cs, out, tile_v=tile_v, pdl=pdl, **knobs)


@pytest.fixture(autouse=True)
def on_emulator(monkeypatch):
    """check_kda with CPU tensors and the emulator behind its kernel entry points."""
    monkeypatch.setattr(ck, "DEVICE", "cpu")
    monkeypatch.setattr(ck, "kda_decode", emulate.run_decode)
    monkeypatch.setattr(ck, "_kd", types.SimpleNamespace(_launch_decode=_launch_decode))
    monkeypatch.setattr(ck, "kda_decode_persistent", functools.partial(emulate.run_persistent, sms=SMS))
    monkeypatch.setattr(ck, "kda_verify", emulate.run_verify)
    monkeypatch.setattr(ck, "_kv", types.SimpleNamespace(_launch=_launch_verify, ROW_WARPS=ck._kv.ROW_WARPS))
    monkeypatch.setattr(ck, "_prefill_mod", lambda: types.SimpleNamespace(kda_prefill=emulate.run_prefill))


def _assert_ok(r):
    assert r["ok"], r


# ---- decode: every tile (clusters of 1, 2, 4, 8 CTAs); B, H tiny ---------------------------------------

@pytest.mark.parametrize("tile_v,B,H", [(128, 2, 2), (64, 1, 2), (32, 2, 1), (16, 1, 1)])
def test_decode(tile_v, B, H):
    _assert_ok(ck.check_decode(B, H, seed=tile_v + B + H, tile_v=tile_v))


# ---- verify, column layout: every allowed row_warps at tiles 128 / 32 / 16, ragged and uniform ---------

VERIFY = [  # (tile_v, row_warps, B, H, T, ragged)
    (128, 1, 1, 1, 2, False), (128, 2, 2, 1, 3, True), (128, 4, 1, 2, 2, False), (128, 8, 2, 1, 4, True),
    (32, 1, 1, 1, 3, False), (32, 2, 2, 1, 2, True), (32, 4, 1, 1, 4, False), (32, 8, 2, 1, 2, True),
    (16, 2, 1, 1, 2, False), (16, 4, 2, 1, 2, True), (16, 8, 1, 1, 4, False),
]


def test_verify_cases_cover_every_allowed_row_warps():
    for tv in (128, 32, 16):
        assert {c[1] for c in VERIFY if c[0] == tv} == set(ROW_WARPS_ALLOWED[tv])


@pytest.mark.parametrize("tile_v,row_warps,B,H,T,ragged", VERIFY)
def test_verify_columns(tile_v, row_warps, B, H, T, ragged):
    _assert_ok(ck.check_verify(B, H, T, ragged=ragged, seed=B + H + T + tile_v, tile_v=tile_v, row_warps=row_warps))


# each knob forced once against its default at that shape (preload: off by default at S*T > 16)
KNOBS = [
    (128, 2, 1, 1, 2, False, {"preload": True}),
    (32, 4, 2, 1, 2, True, {"scatter": False}),
    (32, 2, 2, 1, 3, True, {"delay": True}),
    (32, 4, 2, 1, 3, True, {"late_conv": True}),
    (32, 2, 1, 1, 2, False, {"group_bar": False}),
    (16, 4, 2, 1, 3, True, {"pdl": True}),
    (16, 4, 2, 1, 3, True, {"bpro": False}),       # on by default at these (small) grids
    (32, 2, 1, 1, 4, False, {"fast": False}),      # on by default
    (128, 4, 1, 2, 2, False, {"bpro": False, "fast": False}),
    (16, 4, 2, 1, 4, True, {"chunk": True}),       # measured, loses: a knob only
    (32, 2, 1, 1, 3, False, {"chunk": True, "preload": False}),
    (128, 1, 2, 1, 3, True, {"chunk": True}),
]


@pytest.mark.parametrize("tile_v,row_warps,B,H,T,ragged,knobs", KNOBS)
def test_verify_knobs(tile_v, row_warps, B, H, T, ragged, knobs):
    _assert_ok(ck.check_verify(B, H, T, ragged=ragged, seed=T + tile_v, tile_v=tile_v, row_warps=row_warps,
                               knobs=knobs))


def test_verify_rows_layout():
    _assert_ok(ck.check_verify(2, 1, 2, ragged=True, seed=5, tile_v=64, layout="rows"))


# ---- programmatic dependent launch: results unchanged, and the order the emulator enforces for a use_pdl
# launch (nothing but state, conv_state and params read, nothing written, before griddepcontrol.wait;
# launch_dependents after it; every thread waits) holds ----------------------------------------------------

@pytest.mark.parametrize("tile_v,B,H", [(128, 2, 1), (16, 1, 1)])
def test_decode_pdl(tile_v, B, H):
    _assert_ok(ck.check_decode(B, H, seed=tile_v + 7, tile_v=tile_v, pdl=True))
    assert emulate.LAST["launches"][-1]["use_pdl"] is True


@pytest.mark.parametrize("tile_v,knobs", [(128, {"fold": False}), (128, {"early": False}),
                                          (128, {"fold": False, "early": False, "pdl": True}), (64, {"fold": False}),
                                          (32, {"fold": True}), (16, {"fold": True, "pdl": True}),
                                          (128, {"rs": False}), (128, {"rs": True, "early": False, "pdl": True}),
                                          (16, {"fast": False}), (128, {"fast": True, "rs": False})])
def test_decode_fold_early_off_and_on(tile_v, knobs):
    """fold (the prologue hands the passes q d, k d, d, k; default at tiles 128 and 64), early (the
    output before the state update; default at tile 128), rs (the reduce-scatter combine; default at tile
    128) and fast (single-MUFU transcendentals; default on small grids), each forced against its default."""
    _assert_ok(ck.check_decode(2, 2, seed=11, steps=2, tile_v=tile_v, **knobs))


def test_verify_rows_layout_pdl():
    _assert_ok(ck.check_verify(2, 1, 2, ragged=True, seed=9, tile_v=64, layout="rows", knobs={"pdl": True}))
    assert emulate.LAST["launches"][-1]["use_pdl"] is True


def test_pdl_order_is_enforced(monkeypatch):
    """With no tensor declared readable before the wait, the kernels' early state loads must be caught."""
    monkeypatch.setattr(emulate, "_early", lambda *a: frozenset())
    with pytest.raises(emulate.EmulationError, match="before griddepcontrol.wait"):
        ck.check_decode(1, 1, seed=1, tile_v=128, pdl=True)


def test_pdl_trigger_before_wait_is_caught():
    def bad(x):
        cute = sys.modules["cutlass.cute"]
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()

    with emulate.emulated():
        with pytest.raises(emulate.EmulationError, match="launch_dependents before"):
            emulate.kernel(bad)(0).launch(grid=[1, 1, 1], block=[32, 1, 1], use_pdl=True)


# ---- persistent decode: every (ctas, stages), B*H > grid so each CTA loops --------------------------

PERSISTENT = [(1, 2, 2, 2), (1, 3, 2, 2), (2, 1, 2, 2), (3, 1, 3, 2)]  # (ctas, stages, B, H): 2+ items a CTA


def test_persistent_cases_cover_every_config():
    assert sorted(c[:2] for c in PERSISTENT) == sorted(CONFIGS)


@pytest.mark.parametrize("ctas,stages,B,H", PERSISTENT)
def test_persistent(ctas, stages, B, H):
    _assert_ok(ck.check_decode(B, H, seed=ctas * 10 + stages, stages=(ctas, stages)))
    grid = emulate.LAST["launches"][-1]["grid"][0]
    assert grid == ctas * SMS and B * H >= 2 * grid


# ---- prefill: both forms, both inverses, two chunks with the state carried ----------------------------

@pytest.mark.parametrize("case", [
    dict(B=1, H=1, L=20, chunk=16, inverse="fp32", grouped=False, tile_v=32),
    dict(B=1, H=1, L=5, chunk=16, inverse="bf16", grouped=True, tile_v=64, state_dtype="bf16"),
])
def test_prefill(case):
    r = ck.check_prefill(**case)
    _assert_ok(r)
    names = [x["kernel"].split(".")[-2] for x in emulate.LAST["launches"]]
    assert names == (["Prep", "Intra", "Summary", "Scan", "Chunks", "Norm"] if case["grouped"]
                     else ["Prep", "Intra", "Chunks", "Norm"])


# ---- the emulator itself: rounding, and broken synchronisation and addressing are caught -------------

def test_bf16_rounding_matches_torch():
    x = torch.randn(4000, dtype=torch.float64) * torch.logspace(-30, 30, 4000, dtype=torch.float64)
    x = torch.cat([x.float().double(), torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 3e38, -3.4e38, float("inf")])])
    ours = torch.tensor([emulate.BFloat16(v) for v in x.tolist()], dtype=torch.float64)
    assert torch.equal(ours, x.float().bfloat16().double())


def _decode_args(B=1, H=1):
    inp, p, st, cs = ck.ref.make_kda_inputs(B, H, 128, seed=3)
    out = torch.full((B, H * 128), float("nan"), dtype=torch.bfloat16)
    return (inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs, out)


def _break(monkeypatch, name, fn):
    """Inside emulated(): replace cute.arch.<name> by fn(real)."""
    arch = sys.modules["cutlass.cute"].arch
    monkeypatch.setattr(arch, name, fn(getattr(arch, name)))


def test_missing_barrier_is_caught(monkeypatch):
    with emulate.emulated():
        _break(monkeypatch, "sync_threads", lambda real: lambda: None)
        with pytest.raises(emulate.EmulationError, match="never-written shared memory"):
            emulate.run_decode(*_decode_args())


def test_wrong_mbarrier_parity_is_caught(monkeypatch):
    with emulate.emulated():
        _break(monkeypatch, "mbarrier_wait", lambda real: lambda ptr, phase: real(ptr, 1 - phase))
        with pytest.raises(emulate.EmulationError):
            emulate.run_persistent(*_decode_args(2, 1), ctas=1, stages=2, sms=1)


def test_missing_arrive_deadlocks(monkeypatch):
    with emulate.emulated():
        arch = sys.modules["cutlass.cute"].arch
        _break(monkeypatch, "mbarrier_arrive_and_expect_tx", lambda real: arch.mbarrier_expect_tx)
        with pytest.raises(emulate.Deadlock, match="mbarrier_wait"):
            emulate.run_persistent(*_decode_args(2, 1), ctas=2, stages=1, sms=1)


def test_cluster_wait_without_arrive_is_caught(monkeypatch):
    with emulate.emulated():
        _break(monkeypatch, "cluster_arrive_relaxed", lambda real: lambda: None)
        with pytest.raises(emulate.EmulationError, match="cluster_wait without a cluster_arrive"):
            emulate.run_decode(*_decode_args(), tile_v=64)


def _tiny_launch(body, threads=64, grid=(1, 1, 1), cluster=None, n=256):
    """Run body(pointer to a fresh n-float CPU buffer) on the emulator; returns the buffer."""
    buf = torch.zeros(n)
    emulate.launch(body, buf, grid=grid, block=(threads, 1, 1), cluster=cluster)
    return buf


def test_out_of_bounds_and_misalignment_are_caught():
    def oob(p):
        emulate.make_tensor(p, emulate.make_layout(300))[emulate.thread_idx()[0] * 5] = 1.0

    with pytest.raises(emulate.EmulationError, match="out-of-bounds write"):
        _tiny_launch(oob)

    def misaligned(p):
        t = emulate.make_tensor(p + emulate.assume(2 + emulate.thread_idx()[0] * 4, divby=2), emulate.make_layout(4))
        emulate.autovec_copy(emulate.make_rmem_tensor((4,), emulate.Float32), t)

    with pytest.raises(emulate.EmulationError, match="misaligned 16-byte"):
        _tiny_launch(misaligned)
    with pytest.raises(emulate.EmulationError, match="assume"):
        _tiny_launch(lambda p: emulate.assume(emulate.thread_idx()[0], divby=4))


def test_divergent_barrier_deadlocks_and_a_good_kernel_runs():
    def divergent(p):
        if emulate.thread_idx()[0] < 32:
            emulate.sync_threads()

    with pytest.raises(emulate.Deadlock, match="sync_threads"):
        _tiny_launch(divergent)

    def reverse(p):  # smem round trip + a warp shuffle + a named barrier per half
        tid = emulate.thread_idx()[0]
        s = emulate.SmemAllocator().allocate_tensor(emulate.Float32, emulate.make_layout(64))
        s[tid] = emulate.Float32(tid)
        emulate.sync_threads()
        v = s[63 - tid] + emulate.shuffle_sync_bfly(emulate.Float32(0.5), offset=1)
        emulate.barrier(barrier_id=1 + tid // 32, number_of_threads=32)
        emulate.make_tensor(p, emulate.make_layout(64))[tid] = v

    out = _tiny_launch(reverse)
    assert torch.equal(out[:64], torch.arange(63, -1, -1, dtype=torch.float32) + 0.5)


def _swap_ranks(early: bool):
    """Two CTAs of a cluster write their rank into the peer's shared memory (DSMEM), then read it back."""
    def body(p):
        tid, rank = emulate.thread_idx()[0], emulate.block_idx()[0]
        s = emulate.SmemAllocator().allocate_tensor(emulate.Float32, emulate.make_layout(32))
        if not early:
            emulate.cluster_arrive()
            emulate.cluster_wait()
        peer = sys.modules["cutlass._mlir.dialects.nvvm"].mapa(None, s.iterator + tid, 1 - rank)
        sys.modules["cutlass._mlir.dialects.llvm"].store(emulate.Float32(rank + 10), peer)
        emulate.cluster_arrive()
        emulate.cluster_wait()
        emulate.make_tensor(p, emulate.make_layout(64))[rank * 32 + tid] = s[tid]
    return body


def test_dsmem_exchange_and_a_store_before_the_cluster_barrier():
    out = _tiny_launch(_swap_ranks(early=False), threads=32, grid=(2, 1, 1), cluster=[2, 1, 1])
    assert torch.equal(out[:64], torch.tensor([11.0] * 32 + [10.0] * 32))
    with pytest.raises(emulate.EmulationError, match="before any completed cluster barrier"):
        _tiny_launch(_swap_ranks(early=True), threads=32, grid=(2, 1, 1), cluster=[2, 1, 1])


def test_latency_knob_defaults_follow_the_measurement():
    """The defaults kda_cute_exp_lat.json chose: verify fast always, bpro and decode fast only while the whole
    grid is resident (B H NC <= 2 x 132 CTAs), rs at decode tile 128; the row-layout verify (a baseline)
    keeps the accurate functions; chunk stays off."""
    with emulate.emulated() as m:
        col, row = m.kv._columns_class(), m.kd._kernel_class()
        v1 = col(1, 12, 4, True, False, 1e-6, -5.0, 16, row_warps=4)
        v16 = col(16, 12, 4, True, False, 1e-6, -5.0, 128, row_warps=4)
        v64 = col(64, 12, 4, True, False, 1e-6, -5.0, 128, row_warps=4)
        assert (v1.fast, v1.bpro, v1.chunk) == (True, True, False)
        assert (v16.fast, v16.bpro) == (True, True)
        assert (v64.fast, v64.bpro) == (True, False)
        d1 = row(1, 12, 1, False, False, 1e-6, -5.0, 16)
        d16 = row(16, 12, 1, False, False, 1e-6, -5.0, 128)
        d64 = row(64, 12, 1, False, False, 1e-6, -5.0, 128)
        assert (d1.fast, d1.rs) == (True, False)
        assert (d16.fast, d16.rs) == (True, True)
        assert (d64.fast, d64.rs) == (False, True)
        assert row(2, 12, 4, True, False, 1e-6, -5.0, 64).fast is False  # the rows baseline
