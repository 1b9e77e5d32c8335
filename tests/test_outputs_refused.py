"""An output buffer the caller passes with an integer dtype is refused by name on every registered op's reference
backend (the reference writes any float dtype; an integer buffer would truncate the results silently), as are an
MLA cache of integer storage and expert ids that are not integers."""
from __future__ import annotations

import pytest
import torch

import k3lab.ops  # noqa: F401 - registers every op
from k3lab import registry


def _ops():
    return [o for c in registry.components() for o in registry.ops_of(c) if "reference" in o.backends]


def _smallest(op):
    return min(op.cases(), key=op.nbytes)


@pytest.mark.parametrize("op", _ops(), ids=lambda o: o.name)
def test_integer_outputs_are_refused(op):
    case = _smallest(op)
    base = op.make_inputs(case, 0, "cpu")
    tried = 0
    for k in op.written:
        v = base.get(k)
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            continue
        bad = torch.full(v.shape, 12345, dtype=torch.int32)
        try:
            op.call(dict(base, **{k: bad}), case, "reference", {}, None)
        except (ValueError, TypeError) as e:
            assert any(w in str(e) for w in ("floating", "dtype", "int32")), str(e)
            tried += 1
        else:  # a buffer this case does not use (proj's y1.. at one output) is fine, if left alone
            assert (bad == 12345).all(), f"{op.name}: an int32 {k!r} was written, not refused"
    if not tried:
        pytest.skip(f"{op.name}'s smallest case writes no floating buffer the caller passes")


def test_integer_cache_and_expert_ids_are_refused():
    from k3lab.ref.mla import MLACache, PagedMLACache

    with pytest.raises(ValueError, match="MLACache.data must be a floating tensor"):
        MLACache(torch.zeros(1, 4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="PagedMLACache.pool must be a floating tensor"):
        PagedMLACache(torch.zeros(2, 4, 8, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32))
    op = registry.get("moe_experts")
    case = _smallest(op)
    base = op.make_inputs(case, 0, "cpu")
    with pytest.raises(ValueError, match="'idx' must hold int32/int64"):
        op.call(dict(base, idx=base["idx"].float()), case, "reference", {}, None)
