"""The step's glue ops (k3lab.ops.glue): RMSNorm of rows and SiTU-GLU, through the one checker (fp64 oracle,
poisoned outputs) on the reference and on Triton (the interpreter on a CPU), and their argument errors."""
from __future__ import annotations

import pytest
import torch

from k3lab import registry
from k3lab.components import glue
from k3lab.components.glue import GlueArgumentError
from k3lab.harness import checker


def _check(op_name, backend, **shape):
    op = registry.get(op_name)
    return checker.require(checker.check(op, op.case(**shape), backend=backend, options={}, seed=3))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("batch,dim,xdtype", [(1, 1536, "bf16"), (3, 3584, "fp32"), (2, 100, "bf16")])
def test_rms_norm_checker(backend, batch, dim, xdtype):
    _check("rms_norm", backend, batch=batch, dim=dim, xdtype=xdtype)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("batch,inter", [(1, 768), (3, 1000)])
def test_situ_glu_checker(backend, batch, inter):
    _check("situ_glu", backend, batch=batch, inter=inter)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("batch,dim,inter,xdtype", [(1, 3584, 768, "fp32"), (3, 1000, 384, "bf16")])
def test_norm_glu_checker(backend, batch, dim, inter, xdtype):
    """The MoE output's two segments in one launch (a row of y not a power of two wide: 1000; the SiTU in more than
    one column block: block 256)."""
    _check("norm_glu", backend, batch=batch, dim=dim, inter=inter, xdtype=xdtype)
    if backend == "triton":
        op = registry.get("norm_glu")
        checker.require(checker.check(op, op.case(batch=batch, dim=dim, inter=inter, xdtype=xdtype),
                                      backend=backend, options=dict(block=256, num_warps=4), seed=4))


def test_norm_glu_into_a_wider_buffer():
    """Strided rows: y a column slice, out a slice of a wider buffer (the step writes the projection's input in
    place); the same values as rms_norm and situ_glu run one after the other, untouched columns left alone."""
    g = torch.Generator().manual_seed(7)
    y = torch.randn(2, 70, generator=g)
    gu = (torch.randn(2, 50, generator=g) * 3).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    wide = torch.zeros(2, 100, dtype=torch.bfloat16)
    ran = []
    glue.norm_glu(y[:, 6:], w, gu[:, 10:], wide[:, 3:87], eps=1e-6, backend="triton", ran=ran)
    a = glue.rms_norm(y[:, 6:], w, eps=1e-6, backend="triton")
    b = glue.situ_glu(gu[:, 10:], backend="triton")
    assert torch.equal(wide[:, 3:67], a) and torch.equal(wide[:, 67:87], b)
    assert wide[:, :3].abs().sum() == 0 and wide[:, 87:].abs().sum() == 0
    assert ran[0].op == "norm_glu" and ran[0].backend == "triton" and ran[0].shape["inter"] == 20


def test_glue_strided_rows_and_record():
    """Row strides: the input a column slice of a wider buffer, the output a slice of another; each against the
    fp64 oracle of the same inputs (one bf16 rounding: <= 2^-9 relative an entry; the bf16 reference rounds after
    every op and may sit ~1e-2 away, so it is no yardstick here)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 40, generator=g)
    gu = (torch.randn(3, 24, generator=g) * 3).to(torch.bfloat16)
    wide = torch.zeros(3, 20, dtype=torch.bfloat16)
    ran = []
    glue.situ_glu(gu[:, 4:], wide[:, 2:12], backend="triton", ran=ran)
    ref = glue.situ_glu(gu[:, 4:].double(), backend="reference")
    assert torch.allclose(wide[:, 2:12].double(), ref, rtol=1e-2, atol=1e-2)
    assert wide[:, :2].abs().sum() == 0 and wide[:, 12:].abs().sum() == 0
    w = torch.ones(32, dtype=torch.bfloat16)
    y = glue.rms_norm(x[:, 8:], w, eps=1e-6, backend="triton", ran=ran)
    want = glue.rms_norm(x[:, 8:].double(), w.double(), eps=1e-6)
    assert torch.allclose(y.double(), want, rtol=1e-2, atol=1e-2)
    assert [r.op for r in ran] == ["situ_glu", "rms_norm"] and ran[0].backend == "triton"


def test_glue_argument_errors():
    x = torch.randn(2, 8)
    with pytest.raises(GlueArgumentError, match="'weight'"):
        glue.rms_norm(x, torch.ones(7), eps=1e-6)
    with pytest.raises(GlueArgumentError, match="'eps'"):
        glue.rms_norm(x, torch.ones(8), eps=0)
    with pytest.raises(GlueArgumentError, match="'x'"):
        glue.rms_norm(x.t(), torch.ones(2), eps=1e-6)
    with pytest.raises(GlueArgumentError, match="'gu'"):
        glue.situ_glu(torch.zeros(2, 7, dtype=torch.bfloat16))
    with pytest.raises(GlueArgumentError, match="'out'"):
        glue.situ_glu(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(GlueArgumentError, match="'gu'"):
        glue.situ_glu(torch.zeros(2, 8, dtype=torch.float64), backend="triton")
    with pytest.raises(GlueArgumentError, match="'gu'"):
        glue.norm_glu(x, torch.ones(8), torch.zeros(3, 8, dtype=torch.bfloat16), eps=1e-6)
    with pytest.raises(GlueArgumentError, match="'weight'"):
        glue.norm_glu(x, torch.ones(7), torch.zeros(2, 8, dtype=torch.bfloat16), eps=1e-6)
    with pytest.raises(GlueArgumentError, match="'out'"):
        glue.norm_glu(x, torch.ones(8), torch.zeros(2, 8, dtype=torch.bfloat16),
                      torch.zeros(2, 11, dtype=torch.bfloat16), eps=1e-6)
    with pytest.raises(GlueArgumentError, match="'b2'"):
        glue.norm_glu(x, torch.ones(8), torch.zeros(2, 8, dtype=torch.bfloat16), eps=1e-6, b2=0)

