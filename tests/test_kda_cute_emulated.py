"""The CuTe DSL KDA kernels (kernels/cute/kda_*.py) on the CPU emulator (tests/cute_emulate.py): their logic
checked without a GPU or nvidia-cutlass-dsl, as TRITON_INTERPRET=1 checks the Triton kernels.

The checks are the shared checker's (k3lab.harness.checker: fresh inputs, outputs poisoned with NaN, the
fp64 reference; out < 1e-2, state < 1e-4, conv exact, ragged entries untouched, inputs unchanged), with the
emulator's entry points passed as the implementation (tests/kda_impls.py) and CPU tensors. Shapes
are small (D = 128 is fixed by the kernels). Then deliberate breakages (a missing barrier, a wrong mbarrier
parity, a missing arrive, a cluster wait without arrive, a DSMEM store before the cluster barrier,
out-of-bounds, misaligned and divergent code) must make the emulator raise.

The default run holds a representative subset: every kernel, every tile (cluster of 1, 2, 4, 8 CTAs), every
row_warps, ragged and uniform verify, both sides of the resident-grid choices, pdl and its order check, and
the breakages. The cases marked `slow` (python3 -m pytest -q -m slow) cover the rest of the matrix.
"""
import sys

import pytest
import torch

import cute_emulate as emulate
import kda_impls as K
from k3lab.harness import checker
from k3lab.ref import kda as ref
from k3lab_kernels.cute.kda_verify import ROW_WARPS_ALLOWED

pytestmark = pytest.mark.cute_emu
slow = pytest.mark.slow


@pytest.fixture
def large_grid(monkeypatch):
    """The kernels as on a grid larger than the GPU holds at once (the resident-grid rule's other side: decode
    with the accurate transcendentals, verify with the per-position prologue, two CTAs an SM), at the tiny
    shapes the emulator can run: the rule's threshold set to 0 CTAs."""
    with emulate.emulated() as m:
        monkeypatch.setattr(m.kd, "_RESIDENT", 0)
        monkeypatch.setattr(m.kv, "_RESIDENT", 0)
        yield


def check_decode(B, H, seed, tile_v, pdl=False):
    return checker.check(K.DEC, K.dcase(B, H), impl=K.decode(emulate.run_decode, tile_v=tile_v, pdl=pdl), seed=seed,
                         device="cpu")


def check_verify(B, H, T, ragged, seed, tile_v, row_warps=None, pdl=False):
    return checker.check(K.VER, K.vcase(B, H, T, ragged), seed=seed, device="cpu",
                         impl=K.verify(emulate.run_verify, tile_v=tile_v, row_warps=row_warps, pdl=pdl))


def _assert_ok(r):
    checker.require(r)


# ---- decode: every tile (clusters of 1, 2, 4, 8 CTAs); B, H tiny ---------------------------------------

@pytest.mark.parametrize("tile_v,B,H", [(128, 2, 1), (64, 1, 1), (32, 1, 1), (16, 1, 1),
                                        pytest.param(128, 2, 2, marks=slow), pytest.param(64, 1, 2, marks=slow),
                                        pytest.param(32, 2, 1, marks=slow)])
def test_decode(tile_v, B, H):
    _assert_ok(check_decode(B, H, seed=tile_v + B + H, tile_v=tile_v))


@pytest.mark.parametrize("tile_v", [128, pytest.param(64, marks=slow), pytest.param(32, marks=slow),
                                    pytest.param(16, marks=slow)])
def test_decode_large_grid(tile_v, large_grid):
    _assert_ok(check_decode(2, 1, seed=11, tile_v=tile_v))


# ---- verify: every allowed row_warps at tiles 128 / 32 / 16, ragged and uniform -------------------------

VERIFY = [  # (tile_v, row_warps, B, H, T, ragged); the default run takes one of each tile and row_warps
    (128, 1, 1, 1, 2, False), (64, 8, 2, 1, 2, True), (32, 4, 1, 1, 4, False), (16, 2, 1, 1, 2, False),
    pytest.param(128, 2, 2, 1, 3, True, marks=slow), pytest.param(128, 4, 1, 2, 2, False, marks=slow),
    pytest.param(128, 8, 2, 1, 4, True, marks=slow), pytest.param(64, 2, 2, 1, 3, True, marks=slow),
    pytest.param(32, 1, 1, 1, 3, False, marks=slow), pytest.param(32, 2, 2, 1, 2, True, marks=slow),
    pytest.param(32, 8, 2, 1, 2, True, marks=slow), pytest.param(16, 4, 2, 1, 2, True, marks=slow),
    pytest.param(16, 8, 1, 1, 4, False, marks=slow),
]


def _values(case):
    return case.values if hasattr(case, "values") else case


def test_verify_cases_cover_every_tile_and_row_warps():
    cases = [_values(c) for c in VERIFY]
    assert {c[0] for c in cases} == set(ROW_WARPS_ALLOWED)
    for tv in (128, 32, 16):
        assert {c[1] for c in cases if c[0] == tv} == set(ROW_WARPS_ALLOWED[tv])
    fast = [c for c in VERIFY if not hasattr(c, "marks")]
    assert {c[0] for c in fast} == set(ROW_WARPS_ALLOWED) and {c[1] for c in fast} == {1, 2, 4, 8}
    assert {c[5] for c in fast} == {True, False}


@pytest.mark.parametrize("tile_v,row_warps,B,H,T,ragged", VERIFY)
def test_verify(tile_v, row_warps, B, H, T, ragged):
    _assert_ok(check_verify(B, H, T, ragged=ragged, seed=B + H + T + tile_v, tile_v=tile_v, row_warps=row_warps))
    assert emulate.LAST["launches"][-1]["min_blocks_per_mp"] == 1  # a resident grid: no register cap


# ---- verify with a checkpoint: only the slot positions' states are stored (compile-time), with and without
# the delayed store, ragged (slots past lengths[b] untouched); then the Triton commit replays from the slots -----

VERIFY_CKPT = [  # (tile_v, row_warps, B, T, checkpoint, ragged)
    (128, 4, 1, 4, 2, False),   # delay: position t's slot store after t + 1's partial sums
    (64, 8, 2, 4, 4, True),     # c = T: the last position only; sequence 2 (length 1) writes no slot
    (16, 2, 2, 3, 2, True),     # T not a multiple of c: slots at positions 1 and 2
    pytest.param(32, 1, 1, 4, 3, False, marks=slow), pytest.param(128, 2, 2, 4, 2, True, marks=slow),
]


def check_verify_ckpt(B, T, c, ragged, seed, tile_v, row_warps):
    return checker.check(K.VER, K.VER.case(heads=1, batch=B, T=T, ragged=ragged, checkpoint=c), seed=seed,
                         device="cpu", impl=K.verify(emulate.run_verify_checkpoint, tile_v=tile_v,
                                                     row_warps=row_warps, checkpoint=c))


@pytest.mark.parametrize("tile_v,row_warps,B,T,c,ragged", VERIFY_CKPT)
def test_verify_checkpoint(tile_v, row_warps, B, T, c, ragged):
    r = checker.require(check_verify_ckpt(B, T, c, ragged, seed=B + T + c + tile_v, tile_v=tile_v,
                                          row_warps=row_warps))
    assert r.errors["state_hist"]["numel"] < B * T * 128 * 128  # fewer states than positions were compared


def test_verify_checkpoint_large_grid(large_grid):
    """The per-position prologue, no delayed store, two CTAs an SM."""
    _assert_ok(check_verify_ckpt(2, 4, 2, True, seed=3, tile_v=128, row_warps=4))
    assert emulate.LAST["launches"][-1]["min_blocks_per_mp"] == 2


def test_cute_verify_checkpoint_then_commit():
    """The CuTe verify's slots (c = 4, T = 4) feed the commit (the Triton replay, interpreted): sequences accepting
    3 positions (a replay of 3 from the start state) and 4 (the slot's copy) against the fp64 state at p."""
    from k3lab.components import kda

    B, H, T, c = 2, 1, 4, 4
    inp, p, st, cs = ref.make_kda_inputs(B, H, 128, T=T, seed=9)
    a = [inp[k] for k in ("qkv", "f", "b", "gate")]
    _, S64, c64 = ref.kda_verify(*[x.double() for x in a], p.to(torch.float64), st.double(), cs.double())
    out = torch.full((B, T, H * 128), float("nan"), dtype=torch.bfloat16)
    sh = torch.full((B, 1, H, 128, 128), float("nan"))
    chh = torch.full((B, T, 3 * H * 128, 3), float("nan"), dtype=torch.bfloat16)
    emulate.run_verify_checkpoint(*a, p, st, cs, out, sh, chh, tile_v=128, row_warps=4, checkpoint=c)
    n = torch.tensor([3, 4], dtype=torch.int32)
    S, cst = st.clone(), cs.clone()
    kda.commit(sh, chh, n, S, cst, checkpoint=c, qkv=a[0], f=a[1], b=a[2], params=p, tile_v=128, backend="triton")
    idx = torch.arange(B)
    assert float(((S.double() - S64[idx, n.long() - 1]).norm() / S64[idx, n.long() - 1].norm())) < 1e-4
    assert torch.equal(cst.double(), c64[idx, n.long() - 1])


@pytest.mark.parametrize("tile_v,row_warps,B,H,T,ragged", [
    (32, 4, 2, 1, 3, True),
    pytest.param(128, 2, 1, 1, 4, False, marks=slow), pytest.param(16, 8, 2, 1, 2, True, marks=slow),
    pytest.param(64, 1, 1, 1, 2, False, marks=slow)])
def test_verify_large_grid(tile_v, row_warps, B, H, T, ragged, large_grid):
    _assert_ok(check_verify(B, H, T, ragged=ragged, seed=T + tile_v, tile_v=tile_v, row_warps=row_warps))
    assert emulate.LAST["launches"][-1]["min_blocks_per_mp"] == 2


def test_resident_grid_rule():
    """The shape's choices at the real shapes (12 heads): decode fast and verify's batched prologue only while
    the whole grid is resident (B H NC <= 2 x 132 CTAs), verify preload / delay / register cap by CTAs an SM,
    decode fold at tiles 128 and 64, early and rs at 128."""
    with emulate.emulated() as m:
        dec, ver = m.kd._kernel_class(), m.kv._kernel_class()
        assert [(k.fast, k.fold, k.early, k.rs) for k in (dec(1, 12, 1e-6, -5.0, 16), dec(4, 12, 1e-6, -5.0, 64),
                                                         dec(16, 12, 1e-6, -5.0, 128), dec(64, 12, 1e-6, -5.0, 128))] \
            == [(True, False, False, False), (True, True, False, False), (True, True, True, True),
                (False, True, True, True)]
        v1, v16, v64 = (ver(B, 12, 4, False, 1e-6, -5.0, tv, 4) for B, tv in ((1, 16), (16, 128), (64, 128)))
        assert (v1.bpro, v1.min_ctas, v1.pre, v1.delay) == (True, 1, True, True)
        assert (v16.bpro, v16.min_ctas, v16.pre, v16.delay) == (True, 2, False, False)
        assert (v64.bpro, v64.min_ctas) == (False, 2)


# ---- programmatic dependent launch: results unchanged, and the order the emulator enforces for a use_pdl
# launch (nothing but state, conv_state and params read, nothing written, before griddepcontrol.wait;
# launch_dependents after it; every thread waits) holds ----------------------------------------------------

@pytest.mark.parametrize("tile_v,B,H", [(64, 1, 1), pytest.param(16, 1, 1, marks=slow),
                                        pytest.param(128, 2, 1, marks=slow)])
def test_decode_pdl(tile_v, B, H):
    _assert_ok(check_decode(B, H, seed=tile_v + 7, tile_v=tile_v, pdl=True))
    assert emulate.LAST["launches"][-1]["use_pdl"] is True


@pytest.mark.parametrize("tile_v,row_warps,B,T", [(64, 4, 2, 2), pytest.param(16, 4, 2, 3, marks=slow),
                                                  pytest.param(128, 2, 2, 4, marks=slow)])
def test_verify_pdl(tile_v, row_warps, B, T):
    _assert_ok(check_verify(B, 1, T, ragged=True, seed=T + tile_v, tile_v=tile_v, row_warps=row_warps, pdl=True))
    assert emulate.LAST["launches"][-1]["use_pdl"] is True


@slow
@pytest.mark.parametrize("tile_v", [128, 64, 32, 16])
def test_decode_batch_and_heads(tile_v):
    """Two sequences of two heads (and, at tile 128, with pdl)."""
    _assert_ok(check_decode(2, 2, seed=11, tile_v=tile_v, pdl=tile_v == 128))


def test_pdl_order_is_enforced(monkeypatch):
    """With no tensor declared readable before the wait, the kernels' early state loads must be caught."""
    monkeypatch.setattr(emulate, "_early", lambda *a: frozenset())
    with pytest.raises(emulate.EmulationError, match="before griddepcontrol.wait"):
        check_decode(1, 1, seed=1, tile_v=128, pdl=True)


def test_pdl_trigger_before_wait_is_caught():
    def bad(x):
        cute = sys.modules["cutlass.cute"]
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()

    with emulate.emulated():
        with pytest.raises(emulate.EmulationError, match="launch_dependents before"):
            emulate.kernel(bad)(0).launch(grid=[1, 1, 1], block=[32, 1, 1], use_pdl=True)


# ---- prefill: both forms, both inverses, two chunks with the state carried ----------------------------

@pytest.mark.parametrize("case", [
    dict(B=1, H=1, L=5, chunk=16, inverse="bf16", grouped=True, tile_v=64, state_dtype="bf16"),
    pytest.param(dict(B=1, H=1, L=20, chunk=16, inverse="fp32", grouped=False, tile_v=32), marks=slow),
])
def test_prefill(case):
    c = dict(case)
    tile_v = c.pop("tile_v")
    pc = K.pcase(**c)
    r = checker.check(K.PRE, pc, impl=K.prefill(emulate.run_prefill, pc, tile_v=tile_v), seed=5, device="cpu")
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
    inp, p, st, cs = ref.make_kda_inputs(B, H, 128, seed=3)
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


def _bulk_copy(parity=0, arrive=True):
    """Thread 0 copies floats 0..63 of the buffer into shared memory by a bulk copy completing on an mbarrier;
    every thread waits on the barrier's phase `parity`, then writes its float + 1 to float 64 + tid."""
    def body(p):
        tid = emulate.thread_idx()[0]
        smem = emulate.SmemAllocator()
        s = smem.allocate_tensor(emulate.Float32, emulate.make_layout(64))
        mbar = smem.allocate_array(emulate.Int64, 1)
        if tid == 0:
            emulate.mbarrier_init(mbar, 1)
        emulate.sync_threads()
        if tid == 0:
            (emulate.mbarrier_arrive_and_expect_tx if arrive else emulate.mbarrier_expect_tx)(mbar, 256)
            sys.modules["cutlass._mlir.dialects.nvvm"].cp_async_bulk_shared_cluster_global(s.iterator, p, mbar, 256)
        emulate.mbarrier_wait(mbar, parity)
        emulate.make_tensor(p, emulate.make_layout(128))[64 + tid] = s[tid] + 1.0
    return body


def test_bulk_copy_and_its_mbarrier_breakages():
    buf = torch.zeros(256)
    buf[:64] = torch.arange(64.0)
    emulate.launch(_bulk_copy(), buf, block=(64, 1, 1))
    assert torch.equal(buf[64:128], torch.arange(64.0) + 1)
    with pytest.raises(emulate.EmulationError, match="never-written shared memory"):  # a wait that does not wait
        _tiny_launch(_bulk_copy(parity=1))
    with pytest.raises(emulate.Deadlock, match="mbarrier_wait"):  # the count never reached
        _tiny_launch(_bulk_copy(arrive=False))


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
