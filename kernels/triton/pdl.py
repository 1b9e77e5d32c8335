"""Programmatic dependent launch (PDL) for the k3lab Triton kernels: the launch option, the in-kernel entry, and
the chain the decode step's `pdl` switch opens.

A kernel launched with PDL may start while its predecessor on the stream still runs. Its contract: before
`pdl_enter` it reads only weights and other tensors no kernel of the step writes (the KDA state the kernel before
never touches, lengths, page indices); `pdl_enter` waits for the predecessor's results (griddepcontrol.wait) and
then lets the successor launch, so a kernel's pre-wait code runs only after the kernel two back has completed.
Under TRITON_INTERPRET=1 there is no griddepcontrol: launches are plain and the results the same.
"""
from __future__ import annotations

import contextlib
import contextvars
import os

import triton
import triton.language as tl


def pdl_on(pdl: bool) -> bool:
    """PDL runs on a GPU only (the interpreter has no griddepcontrol): elsewhere the launches are plain and
    the result is the same."""
    return bool(pdl) and os.environ.get("TRITON_INTERPRET") != "1"


_CHAIN = contextvars.ContextVar("k3lab_pdl_chain", default=False)


@contextlib.contextmanager
def pdl_chain(on: bool = True):
    """Inside: every k3lab kernel whose wrapper is called with pdl=None launches with PDL (the decode step's `pdl`
    switch). The waiting programs hold their SM slots, so the next kernel's launch and first weight loads
    overlap the tail of the current one."""
    tok = _CHAIN.set(bool(on))
    try:
        yield
    finally:
        _CHAIN.reset(tok)


def chain_pdl(pdl: bool | None) -> bool:
    """`pdl` as given, or the enclosing pdl_chain's setting when None; False off the GPU (pdl_on)."""
    return pdl_on(_CHAIN.get() if pdl is None else pdl)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel launched with PDL: wait for the predecessor's results, then let the successor launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def launch_kw(pdl: bool) -> dict:
    """The launch option of a kernel that waits on its predecessor with gdc_wait (PDL)."""
    return {"launch_pdl": True} if pdl_on(pdl) else {}
