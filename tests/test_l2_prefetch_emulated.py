"""The CuTe DSL L2 prefetch (kernels/cute/l2_prefetch.py, backend "cute" of the `prefetch` switch's op) on the CPU
emulator: its record mode against the plan's lines (k3lab.components.trunk.prefetch_lines, the Triton twin's order),
exact; its prefetches as the emulator records them (cp.async.bulk.prefetch.L2: 16-byte aligned, whole 16 bytes), one a
range, covering every line of the plan and nothing past the weight; and what it refuses, by name.
"""
import pytest
import torch

import cute_emulate as emulate
from k3lab.components import trunk

pytestmark = pytest.mark.cute_emu


def _run(w, ksplit, span, record=None):
    t = dict(w=w, w_words=w.reshape(-1).view(torch.int32))
    if record is not None:
        t.update(rec=record, rec_words=record.view(torch.int32))
    out = {}

    def call(m, **a):
        out["lines"] = m.mod["l2_prefetch"].prefetch(a["w"], ksplit, span, record=a.get("rec"))
    emulate.PREFETCHED.clear()
    emulate._run(call, t, 0)
    return out["lines"]


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("budget", [40 * 8 * 128, 2 * 40 * 8 * 128, 1 << 30])
def test_record_is_the_plans_lines(wdtype, budget):
    """The tests' weight of test_trunk.py (batch 2: the dot path, 8 K ranges of 128 columns, the last 4 wide): the
    record equals the plan's lines, -1 for a line that starts past the row's end."""
    w = torch.zeros(40, 900).to(wdtype)
    plan = trunk.prefetch_plan(w, 2, budget)
    rec = torch.full((plan["lines"],), -7, dtype=torch.int64)
    assert _run(w, plan["ksplit"], plan["span"], rec) == plan["lines"]
    assert torch.equal(rec, trunk.prefetch_lines(40, 900, plan["ksplit"], plan["span"], w.element_size()))


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("N,K,ksplit,span", [(40, 900, 128, 128), (40, 900, 128, 64), (6, 1536, 1536, 700),
                                             (3, 520, 256, 256)])
def test_prefetches_cover_the_lines(wdtype, N, K, ksplit, span):
    """One bulk prefetch a (row, split) range, each 16-byte aligned and a whole number of 16 bytes, inside the weight,
    and covering the first byte of every line the plan names (rows of 1800 bytes: ranges not 16-byte aligned) but the
    weight's last partial 16 bytes (fp8 3 x 520: its last range, 8 bytes, is not issued)."""
    w = torch.zeros(N, K).to(wdtype)
    e = w.element_size()
    lines = _run(w, ksplit, span)
    got = sorted(emulate.PREFETCHED)
    S = -(-K // ksplit)
    end = N * K * e // 16 * 16   # the weight's last whole 16 bytes end here
    base = w.data_ptr()
    want = []                     # (row, split): its bytes widened to 16-byte bounds, never past `end`
    for n in range(N):
        for sp in range(S):
            a = (n * K + sp * ksplit) * e
            b = a + min(span, ksplit, K - sp * ksplit) * e
            a16, b16 = a // 16 * 16, min(-(-b // 16) * 16, end)
            if b16 > a16:
                want.append((base + a16, b16 - a16))
    assert lines == N * S * -(-min(span, ksplit) // (128 // e)) and got == sorted(want)
    assert all(a % 16 == 0 and n % 16 == 0 and n > 0 and base <= a and a + n <= base + N * K * e for a, n in got)
    starts = [base + int(i) * e for i in trunk.prefetch_lines(N, K, ksplit, span, e) if 0 <= i * e < end]
    assert all(any(a <= s < a + n for a, n in got) for s in starts)


def test_refused_by_name():
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'w' must be a contiguous 16-byte aligned bf16 or fp8"):
        _run(w.float(), 64, 64)
    with pytest.raises(ValueError, match="'ksplit' must be an int >= 1"):
        _run(w, 0, 64)
    with pytest.raises(ValueError, match="'record' must be a contiguous int64 tensor"):
        _run(w, 64, 64, torch.zeros(1, dtype=torch.int64))
