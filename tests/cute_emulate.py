"""CPU emulator of the CuTe DSL subset the KDA kernels use (kernels/cute/kda_decode.py, kda_verify.py,
kda_prefill.py): checks their LOGIC without a GPU or nvidia-cutlass-dsl, the way TRITON_INTERPRET=1 checks
the Triton kernels. Test tooling: the tests import it as a plain module (tests/ is on sys.path under pytest).

    import cute_emulate as emulate
    emulate.run_decode(qkv, f, b, gate, params, state, conv_state, out, tile_v=32)        # CPU tensors
    emulate.run_verify(..., state_hist, conv_hist, lengths=None, tile_v=16, row_warps=4, pdl=True)
    emulate.run_prefill(..., chunk=16, inverse="bf16", grouped=True, tile_v=64)
    emulate.launch(fn, tensor, ..., grid=(2, 1, 1), block=(64, 1, 1), cluster=(2, 1, 1))  # any device function

Each run_* takes the GPU wrapper's arguments as CPU tensors and runs the REAL host wrapper (validation,
compile cache keys, `_kernel_args`, the launch code) and the REAL kernel source inside `emulated()`: that
context puts fake `cutlass`, `cutlass.cute`, `cutlass._mlir.dialects.{llvm,nvvm}`, `cutlass.cutlass_dsl`,
`cutlass.cute.runtime` and `cuda.bindings.driver` modules into sys.modules and reloads the three kernel
modules (k3lab_kernels.cute.kda_*) so their lazily built classes bind the fakes (on exit the real modules come
back and the kernel modules are reloaded again). The tensors are handed to the wrapper as CPU tensors that
report device cuda:0, and the kernel modules see a `torch` whose
`cuda.device/current_stream/get_device_properties` are stand-ins and whose `empty` returns NaN-filled scratch.

How a launch runs. Every CUDA thread is a cooperative task (a greenlet when the `greenlet` package is there,
else an OS thread handing a baton); exactly one runs at a time, until it blocks in a barrier, a shuffle, a
cluster barrier or an mbarrier wait; the next runnable one is then drawn at random from a seeded generator.
All CTAs of a cluster run together (DSMEM stores through `mapa` land in the peer CTA's shared memory, cluster
barriers span the cluster); clusters (or CTAs) of a grid run one after another, in a seeded random order.
When no task can run and no bulk copy is in flight, the launch raises `Deadlock` naming what every thread
waits for: exact, at once; a launch still switching after TIMEOUT_S (a livelock) raises Deadlock too (a task
that loops without ever blocking is caught only by the thread backend's per-task guard).

What it checks (an `EmulationError` with the kernel, block and thread, or a wrong/NaN result):
  - every global, shared and register tensor access is in bounds of its layout AND of the memory behind it
    (the torch tensor a pointer was made from, the shared-memory allocation, the register array);
  - shared memory starts poisoned (NaN) and a read of a word no thread has written raises (STRICT_SMEM);
    register tensors start as NaN (ints: None), so an unset register that reaches an output shows as NaN;
  - `cute.assume(x, divby=k)` holds; vector copies (autovec_copy of contiguous runs) are aligned to their
    width (up to 16 B) at their real address; pointers made with `assumed_align` are that aligned; the
    bulk copy's addresses and size are 16-byte multiples; total shared memory per CTA <= 227 KiB;
  - barriers: `sync_threads`, named barriers (one object per id, sized by number_of_threads, a multiple
    of 32; a thread arriving with another size raises); warp shuffles need all 32 lanes of the warp with the
    same offset; cluster arrive/wait pairs (arrive twice or wait without arrive raises); DSMEM stores need a
    completed cluster barrier first and a live peer CTA (a store into a CTA that already exited raises);
  - mbarriers with phase parity, arrival count and transaction bytes; a bulk copy poisons its destination
    when issued and lands (bytes copied, then complete_tx) only when every thread is blocked, so reading the
    stage early, waiting on the wrong parity, or a missing arrive/expect_tx shows up (unwritten-read error,
    wrong data or Deadlock); a copy still in flight at kernel exit raises;
  - `cute.compile`d functions are called with pointers of the compiled dtype/alignment;
  - bf16/fp16 conversions round to nearest even; stores to fp32 memory round to fp32.
What it does NOT check:
  - the DSL's own compile semantics: its AST rewriting of dynamic if/for/while (the emulator runs the Python
    as written: a dynamic `if` that the DSL would reject, a variable whose type changes across branches, a
    `const_expr` on a runtime value, a helper that the DSL would not preprocess) - only a real
    `cute.compile` (kernels/cute/compile_offline.py) checks those; register pressure and spills;
  - the hardware memory model beyond barriers: relaxed vs release/acquire (cluster_arrive_relaxed orders
    nothing on the GPU, here it is a plain arrive), fences, async-proxy ordering, warps running in lockstep
    or independently (races are exposed only by the random interleaving and the poison, not proven absent);
    CTAs of different clusters never run concurrently; 32-bit index overflow is not modelled;
  - arithmetic precision: registers hold Python floats (float64), rounded only when stored to fp32 global or
    shared memory, or converted/stored to bf16/fp16; exp/exp2/rsqrt/rcp are exact, not the GPU's approximations
    (the approximate ones the kernels' `fast` choice selects included);
  - performance (time, bandwidth, occupancy, bank conflicts) and anything about the real launch limits
    beyond block size, cluster size <= 8 and shared memory.
"""
from __future__ import annotations

import builtins
import contextlib
import dataclasses
import importlib
import math
import os
import random
import struct
import sys
import threading
import time
import types

import numpy as np
import torch

try:
    import greenlet as _greenlet
except ImportError:  # pragma: no cover - depends on the machine
    _greenlet = None

__all__ = ["Deadlock", "EmulationError", "LAST", "STRICT_SMEM", "emulated", "launch", "run_decode", "run_prefill",
           "run_verify"]

STRICT_SMEM = True        # a read of never-written shared memory raises (else the NaN poison flows on)
SMEM_LIMIT = 227 * 1024   # bytes of shared memory one CTA may use on sm_90
MAX_CLUSTER = 8           # the portable cluster size
TIMEOUT_S = 600.0         # wall-clock limit of one cluster's (or CTA's) run, and of one task between yields
LAST: dict = {}           # what the last run launched: {"launches": [...], "max_smem": bytes, "switches": n}


class EmulationError(RuntimeError):
    """A kernel did something the hardware would fault on or that the emulator flags (see the module doc)."""


class Deadlock(EmulationError):
    """Every thread of a launch is blocked and nothing is in flight."""


class _Abort(BaseException):
    """Thrown into the tasks still blocked when a launch fails."""


# ---------------------------------------------------------------------------------------------
# Scalars: Float32 (a float that knows .to()), Int32, and the other dtype tags
# ---------------------------------------------------------------------------------------------

_PF = struct.Struct("<f")
_PI = struct.Struct("<I")
_PE = struct.Struct("<e")
_PH = struct.Struct("<H")


_BF16_MEMO: dict[float, float] = {}


def _bf16(x) -> float:
    """Round to bfloat16, nearest even (via the fp32 bit pattern). Memoized (the kernels round the same values
    over and over): zeros and NaN return themselves first, since -0.0 and 0.0 are one dict key and NaN none."""
    x = float(x)
    if x == 0.0 or x != x:
        return x
    r = _BF16_MEMO.get(x)
    if r is not None:
        return r
    try:
        b = _PI.unpack(_PF.pack(x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    r = _PF.unpack(_PI.pack(b))[0]
    if len(_BF16_MEMO) >= 1 << 20:
        _BF16_MEMO.clear()
    _BF16_MEMO[x] = r
    return r


def _f16(x) -> float:
    x = float(x)
    if x != x:
        return x
    try:
        return _PE.unpack(_PE.pack(x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _div(a: float, b: float) -> float:
    try:
        return a / b
    except ZeroDivisionError:
        if a != a or a == 0:
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)


_fadd, _fsub, _fmul = float.__add__, float.__sub__, float.__mul__


class Float32(float):
    """An fp32 register value (held as a Python float; see the module doc on precision)."""
    __slots__ = ()
    width = 32
    is_float = True

    def __add__(a, b):
        return Float32(_fadd(a, b))

    __radd__ = __add__

    def __sub__(a, b):
        return Float32(_fsub(a, b))

    def __rsub__(a, b):
        return Float32(-_fsub(a, b))

    def __mul__(a, b):
        return Float32(_fmul(a, b))

    __rmul__ = __mul__

    def __truediv__(a, b):
        return Float32(_div(float(a), float(b)))

    def __rtruediv__(a, b):
        return Float32(_div(float(b), float(a)))

    def __neg__(a):
        return Float32(-float(a))

    def __abs__(a):
        return Float32(abs(float(a)))

    def to(self, dtype):
        return _TO[dtype](self)

    def ir_value(self, loc=None, ip=None):
        return self

    def bitcast(self, dtype):
        """The value rounded to fp32, its bits read as a signed Int32 (the only bitcast the kernels use)."""
        if dtype is not Int32:
            raise EmulationError(f"Float32.bitcast to {getattr(dtype, '__name__', dtype)} is not emulated")
        return Int32(int(np.array([float(self)], dtype=np.float32).view(np.int32)[0]))


class Int32(int):
    """An Int32 value; arithmetic gives plain ints."""
    width = 32
    is_float = False

    def to(self, dtype):
        return _TO[dtype](self)

    def ir_value(self, loc=None, ip=None):
        return int(self)

    def bitcast(self, dtype):
        """The low 32 bits read as an fp32 (the only bitcast of an Int32 the kernels use)."""
        if dtype is not Float32:
            raise EmulationError(f"Int32.bitcast to {getattr(dtype, '__name__', dtype)} is not emulated")
        return Float32(_f32_of_bits(int(self) & 0xFFFFFFFF))


class BFloat16:
    width = 16
    is_float = True

    def __new__(cls, x):
        return Float32(_bf16(x))


class Float16:
    width = 16
    is_float = True

    def __new__(cls, x):
        return Float32(_f16(x))


class Int64:
    width = 64
    is_float = False

    def __new__(cls, x):
        return int(x)


class Boolean:
    width = 8
    is_float = False

    def __new__(cls, x):
        return bool(x)


_TO = {Float32: lambda v: Float32(float(v)), BFloat16: lambda v: Float32(_bf16(v)),
       Float16: lambda v: Float32(_f16(v)), Int32: lambda v: Int32(int(v)), Int64: lambda v: int(v)}


def _esize(dtype) -> int:
    return dtype.width // 8


def _as_index(c):
    if isinstance(c, int):
        return c
    raise EmulationError(f"tensor index {c!r} is not an integer")


# ---------------------------------------------------------------------------------------------
# Memory: buffers, pointers, layouts, tensors
# ---------------------------------------------------------------------------------------------

class _Buf:
    """The memory behind a global or shared pointer: a torch tensor's elements (gmem: a numpy view, or a float32
    shadow for bf16/fp16 written back after the run) or a shared-memory allocation of one CTA (smem: `written`
    marks the words stored since the launch; `objs`: an Int64 array holding mbarriers)."""
    __slots__ = ("arr", "n", "dtype", "space", "written", "base", "name", "cta", "dirty", "conv", "store", "objs")

    def __init__(self, arr, dtype, space, name, base=0, cta=None, written=None, objs=False):
        self.arr, self.n, self.dtype, self.space, self.name = arr, len(arr), dtype, space, name
        self.base, self.cta, self.written, self.dirty, self.objs = base, cta, written, False, objs
        self.conv = Float32 if dtype.is_float else int
        self.store = _STORE.get(dtype, _ident)

    def read(self, o):
        if o < 0 or o >= self.n:
            raise EmulationError(f"out-of-bounds read of {self.name}: element {o} of {self.n}")
        if _PDL["on"] and self.space == "g" and self.base not in _PDL["early"] and not _cur().waited:
            raise EmulationError(f"read of {self.name} before griddepcontrol.wait in a PDL launch (only "
                                 f"{len(_PDL['early'])} declared inputs may be read before the wait)")
        w = self.written
        if w is not None and not w[o] and STRICT_SMEM:
            raise EmulationError(f"read of never-written shared memory {self.name}[{o}]")
        return self.conv(self.arr[o])

    def write(self, o, v):
        if o < 0 or o >= self.n:
            raise EmulationError(f"out-of-bounds write of {self.name}: element {o} of {self.n}")
        if not isinstance(v, (float, int)):
            raise EmulationError(f"store of a non-scalar {type(v).__name__} into {self.name}")
        if _PDL["on"] and self.space == "g" and not _cur().waited:
            raise EmulationError(f"store into {self.name} before griddepcontrol.wait in a PDL launch")
        if self.cta is not None and self.cta.exited:
            raise EmulationError(f"store into the shared memory of CTA {self.cta.bidx}, which has exited")
        self.arr[o] = self.store(v)
        if self.written is not None:
            self.written[o] = 1
        self.dirty = True

    # read_run / write_run: `read` / `write` of several elements (a vector copy), each check made once for the run
    def read_run(self, offs):
        if min(offs) < 0 or max(offs) >= self.n:
            self.read(next(o for o in offs if o < 0 or o >= self.n))
        if _PDL["on"] and self.space == "g" and self.base not in _PDL["early"] and not _cur().waited:
            self.read(offs[0])
        w = self.written
        if w is not None and STRICT_SMEM:
            for o in offs:
                if not w[o]:
                    self.read(o)
        a, conv = self.arr, self.conv
        return [conv(a[o]) for o in offs]

    def write_run(self, offs, vals, exact=False):
        """exact: the values were read from a tensor of this dtype, so they are scalars its store keeps as they are."""
        if min(offs) < 0 or max(offs) >= self.n or (
                not exact and not all(isinstance(v, (float, int)) for v in vals)) or (
                _PDL["on"] and self.space == "g" and not _cur().waited) or (
                self.cta is not None and self.cta.exited):
            for o, v in zip(offs, vals):
                self.write(o, v)
            return
        _put_run(self.arr, offs, vals, None if exact else self.store)
        if self.written is not None:
            for o in offs:
                self.written[o] = 1
        self.dirty = True


def _ident(v):
    return v


# programmatic dependent launch: "on" while a use_pdl launch runs; "early": base addresses of the global
# tensors the caller declared safe to read before griddepcontrol.wait (not written by the previous kernel)
_PDL = {"on": False, "early": frozenset()}


def griddepcontrol_wait():
    _cur().waited = True


def griddepcontrol_launch_dependents():
    if _PDL["on"] and not _cur().waited:
        raise EmulationError("griddepcontrol.launch_dependents before griddepcontrol.wait: the next kernel "
                             "could then overlap more than one predecessor")


class _RBuf:
    """A thread's register array."""
    __slots__ = ("arr", "n", "name", "store")
    space = "r"
    written = cta = None

    def __init__(self, arr, dtype, name):
        self.arr, self.n, self.name = arr, len(arr), name
        self.store = _STORE.get(dtype, _ident)

    def read(self, o):
        if o < 0 or o >= self.n:
            raise EmulationError(f"out-of-bounds read of {self.name}: element {o} of {self.n}")
        return self.arr[o]

    def write(self, o, v):
        if o < 0 or o >= self.n:
            raise EmulationError(f"out-of-bounds write of {self.name}: element {o} of {self.n}")
        if not isinstance(v, (float, int)):
            raise EmulationError(f"store of a non-scalar {type(v).__name__} into {self.name}")
        self.arr[o] = self.store(v)

    def read_run(self, offs):
        if min(offs) < 0 or max(offs) >= self.n:
            self.read(next(o for o in offs if o < 0 or o >= self.n))
        a = self.arr
        return [a[o] for o in offs]

    def write_run(self, offs, vals, exact=False):
        if min(offs) < 0 or max(offs) >= self.n or (not exact and not all(isinstance(v, (float, int)) for v in vals)):
            for o, v in zip(offs, vals):
                self.write(o, v)
            return
        _put_run(self.arr, offs, vals, None if exact else self.store)


def _put_run(a, offs, vals, store):
    """a[o] = store(v) along a run (store None: the values as they are), the checks made by the caller."""
    if store is None:
        for o, v in zip(offs, vals):
            a[o] = v
    else:
        for o, v in zip(offs, vals):
            a[o] = store(v)


_STORE = {Float32: Float32, BFloat16: BFloat16, Float16: Float16, Int32: int, Int64: int}


class _Unmapped:
    """The memory of a pointer the emulator cannot resolve: any access raises."""

    def __init__(self, what):
        self.name = what

    def read(self, *_):
        raise EmulationError(f"access through a pointer that maps no tensor ({self.name})")

    write = read_run = write_run = read


class Pointer:
    __slots__ = ("buf", "off", "dtype", "align")

    def __init__(self, buf, off, dtype, align=None):
        self.buf, self.off, self.dtype = buf, off, dtype
        self.align = align or _esize(dtype)

    def __add__(self, k):
        return Pointer(self.buf, self.off + _as_index(k), self.dtype)

    __radd__ = __add__

    @property
    def memspace(self):
        return getattr(self.buf, "space", None)

    def to_llvm_ptr(self, loc=None, ip=None):
        return self

    def addr(self):
        return self.buf.base + self.off * _esize(self.dtype)

    def toint(self, loc=None, ip=None):
        """The address as an integer (shared memory: the CTA-local byte offset the allocator gave it, which the
        ldmatrix model maps back to its allocation)."""
        return Int32(self.addr())

    def __repr__(self):
        return f"Pointer({getattr(self.buf, 'name', '?')} + {self.off}, {self.dtype.__name__})"


class Layout:
    __slots__ = ("shape", "stride")

    def __init__(self, shape, stride):
        self.shape, self.stride = shape, stride

    def cosize(self):
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))

    def size(self):
        return math.prod(self.shape)


def _tuple(x):
    return tuple(_as_index(v) for v in x) if isinstance(x, (tuple, list)) else (_as_index(x),)


def _compact(shape):
    stride, s = [], 1
    for n in shape:
        stride.append(s)
        s *= n
    return tuple(stride)


_LAYOUTS: dict = {}


def make_layout(shape, stride=None):
    key = (shape, stride)
    try:
        return _LAYOUTS[key]
    except (KeyError, TypeError):
        pass
    lay = _make_layout(shape, stride)
    with contextlib.suppress(TypeError):
        _LAYOUTS[key] = lay
    return lay


def _make_layout(shape, stride):
    shape = _tuple(shape)
    stride = _compact(shape) if stride is None else _tuple(stride)
    if len(stride) != len(shape) or not shape:
        raise EmulationError(f"layout shape {shape} and stride {stride}: ranks differ or are 0")
    return Layout(shape, stride)


_REL: dict = {}


def _rel_offsets(shape, stride):
    """Element offsets of a layout in CuTe's (colexicographic) order."""
    key = (shape, stride)
    r = _REL.get(key)
    if r is None:
        r = [0]
        for n, s in zip(shape, stride):
            r = [o + i * s for i in range(n) for o in r]
        _REL[key] = r
    return r


class Tensor:
    __slots__ = ("buf", "off", "shape", "stride", "dtype", "rank", "n0", "s0", "n1", "s1", "reg")

    def __init__(self, buf, off, shape, stride, dtype):
        self.buf, self.off, self.shape, self.stride, self.dtype = buf, off, shape, stride, dtype
        self.rank, self.n0, self.s0 = len(shape), shape[0], stride[0]
        self.n1, self.s1 = (shape[1], stride[1]) if self.rank > 1 else (0, 0)
        # fp32 registers: the list holds Float32 values, read and written without conversion
        self.reg = buf.__class__ is _RBuf and dtype is Float32

    @property
    def iterator(self):
        return Pointer(self.buf, self.off, self.dtype)

    @property
    def element_type(self):
        return self.dtype

    @property
    def layout(self):
        return Layout(self.shape, self.stride)

    def _offset(self, idx):
        if idx.__class__ is tuple:
            if len(idx) != self.rank:
                raise EmulationError(f"index {idx} into a rank-{self.rank} tensor {self.shape}")
            o = self.off
            for c, n, s in zip(idx, self.shape, self.stride):
                c = _as_index(c)
                if c < 0 or c >= n:
                    raise EmulationError(f"index {idx} out of the tensor's shape {self.shape} ({self.buf.name})")
                o += c * s
            return o
        c = _as_index(idx)
        if self.rank == 1:
            if c < 0 or c >= self.n0:
                raise EmulationError(f"index {c} out of the tensor's shape {self.shape} ({self.buf.name})")
            return self.off + c * self.s0
        if c < 0 or c >= math.prod(self.shape):
            raise EmulationError(f"index {c} out of the tensor's shape {self.shape} ({self.buf.name})")
        return self.off + _rel_offsets(self.shape, self.stride)[c]

    # __getitem__/__setitem__ take in-range int (rank 1) and int pair (rank 2) indices inline: they are
    # most of the emulator's time; anything else goes through _offset, which checks and explains.
    def __getitem__(self, idx):
        cls = idx.__class__
        o = -1
        if cls is int:
            if self.rank == 1 and 0 <= idx < self.n0:
                o = self.off + idx * self.s0
        elif cls is tuple:
            if self.rank == 2 and len(idx) == 2:
                a, b = idx
                if a.__class__ is int and b.__class__ is int and 0 <= a < self.n0 and 0 <= b < self.n1:
                    o = self.off + a * self.s0 + b * self.s1
            if o < 0 and None in idx:
                return self._slice(idx)
        if o < 0:
            o = self._offset(idx)
        if self.reg:
            return self.buf.arr[o]
        return self.buf.read(o)

    def __setitem__(self, idx, v):
        cls = idx.__class__
        o = -1
        if cls is int:
            if self.rank == 1 and 0 <= idx < self.n0:
                o = self.off + idx * self.s0
        elif cls is tuple and self.rank == 2 and len(idx) == 2:
            a, b = idx
            if a.__class__ is int and b.__class__ is int and 0 <= a < self.n0 and 0 <= b < self.n1:
                o = self.off + a * self.s0 + b * self.s1
        if o < 0:
            o = self._offset(idx)
        if self.reg and v.__class__ is Float32:
            self.buf.arr[o] = v
        else:
            self.buf.write(o, v)

    def _slice(self, idx):
        if len(idx) != len(self.shape):
            raise EmulationError(f"slice {idx} of a rank-{len(self.shape)} tensor")
        off, shape, stride = self.off, [], []
        for c, n, s in zip(idx, self.shape, self.stride):
            if c is None:
                shape.append(n)
                stride.append(s)
            else:
                c = _as_index(c)
                if c < 0 or c >= n:
                    raise EmulationError(f"slice {idx} out of the tensor's shape {self.shape}")
                off += c * s
        return Tensor(self.buf, off, tuple(shape), tuple(stride), self.dtype)

    def offsets(self):
        return [self.off + r for r in _rel_offsets(self.shape, self.stride)]

    def fill(self, v):
        for o in self.offsets():
            self.buf.write(o, v)


def make_tensor(ptr, layout):
    if not isinstance(ptr, Pointer):
        raise EmulationError(f"make_tensor needs a pointer (got {type(ptr).__name__})")
    if not isinstance(layout, Layout):
        layout = make_layout(layout)
    return Tensor(ptr.buf, ptr.off, layout.shape, layout.stride, ptr.dtype)


def make_rmem_tensor(shape, dtype):
    lay = make_layout(shape)
    n = lay.size()
    fill = Float32(math.nan) if dtype.is_float else None
    return Tensor(_RBuf([fill] * n, dtype, "registers"), 0, lay.shape, lay.stride, dtype)


def _check_vector_alignment(t: Tensor):
    """A contiguous run of a global/shared tensor moves as vectors up to 16 B: their addresses must be aligned."""
    if t.buf.__class__ is not _Buf or t.s0 != 1:
        return
    es = _esize(t.dtype)
    width = min(t.n0 * es, 16)
    if width & (width - 1):
        return
    if t.rank == 1:
        if (t.buf.base + t.off * es) % width:
            raise EmulationError(f"misaligned {width}-byte vector access to {t.buf.name} at element {t.off}")
        return
    rel = _rel_offsets(t.shape, t.stride)
    for k in range(0, len(rel), t.n0):
        a = t.buf.base + (t.off + rel[k]) * es
        if a % width:
            raise EmulationError(f"misaligned {width}-byte vector access to {t.buf.name} at element {t.off + rel[k]} "
                                 f"(address 0x{a:x})")


def autovec_copy(src, dst):
    if not (isinstance(src, Tensor) and isinstance(dst, Tensor)):
        raise EmulationError("autovec_copy needs two tensors")
    if math.prod(src.shape) != math.prod(dst.shape):
        raise EmulationError(f"autovec_copy of shape {src.shape} into shape {dst.shape}")
    _check_vector_alignment(src)
    _check_vector_alignment(dst)
    sb, db = src.buf, dst.buf
    if src.rank == 1 and dst.rank == 1:  # the common case
        so, ss, do, ds = src.off, src.s0, dst.off, dst.s0
        soffs = [so + i * ss for i in range(src.n0)]
        doffs = [do + i * ds for i in range(dst.n0)]
    else:
        so, do = src.off, dst.off
        soffs = [so + r for r in _rel_offsets(src.shape, src.stride)]
        doffs = [do + r for r in _rel_offsets(dst.shape, dst.stride)]
    if not soffs:
        return
    db.write_run(doffs, sb.read_run(soffs), src.dtype is dst.dtype and src.dtype.is_float)


class _CopyOp:
    """cute.nvgpu.CopyG2ROp / CopyR2GOp / CopyUniversalOp: the cache and ordering options only change speed
    or the memory model, which the emulator does not model; they are recorded, not checked."""

    def __init__(self, *a, **kw):
        self.kw = kw


class _CopyAtom:
    def __init__(self, op, dtype, bits, kw):
        self.op, self.dtype, self.bits, self.kw = op, dtype, bits, kw


def make_copy_atom(op, dtype, num_bits_per_copy=0, **kw):
    if not isinstance(op, _CopyOp):
        raise EmulationError(f"make_copy_atom: unsupported operation {op!r}")
    return _CopyAtom(op, dtype, int(num_bits_per_copy), kw)


def copy(atom, src, dst, **kw):
    """cute.copy for the (V, Rest...) profile: V = the atom's bits / the element width, contiguous in both
    tensors; autovec_copy then checks each V-run's alignment (V elements = the atom's width) and copies."""
    if not isinstance(atom, _CopyAtom) or kw:
        raise EmulationError(f"copy: unsupported atom or options {sorted(kw)}")
    if not (isinstance(src, Tensor) and isinstance(dst, Tensor)):
        raise EmulationError("copy needs two tensors")
    if src.dtype.width != dst.dtype.width or src.dtype.width != atom.dtype.width:
        raise EmulationError("copy: element widths of the atom, source and destination differ")
    if src.shape != dst.shape:
        raise EmulationError(f"copy of shape {src.shape} into shape {dst.shape}")
    if atom.bits:
        v = atom.bits // atom.dtype.width
        if src.shape[0] != v or src.stride[0] != 1 or dst.stride[0] != 1:
            raise EmulationError(f"copy: mode 0 must be {v} contiguous elements for a {atom.bits}-bit atom, got "
                                 f"shape {src.shape} strides {src.stride} / {dst.stride}")
        if atom.bits > 128:
            raise EmulationError(f"copy: {atom.bits}-bit atoms are not supported (at most 128)")
    autovec_copy(src, dst)


def assume(x, divby=1):
    if _as_index(x) % divby:
        raise EmulationError(f"cute.assume({x}, divby={divby}) is false")
    return x


# ---------------------------------------------------------------------------------------------
# Threads, CTAs, clusters and the scheduler
# ---------------------------------------------------------------------------------------------

class _Thread:
    __slots__ = ("tid", "lane", "warp", "cta", "why", "done", "value", "carrived", "cwaits", "task", "abort",
                 "exc", "waited")

    def __init__(self, tid, cta):
        self.tid, self.lane, self.cta = tid, tid % 32, cta
        self.warp = cta.warps[tid // 32]
        self.why, self.done, self.value, self.carrived, self.cwaits = None, False, None, None, 0
        self.task, self.abort, self.exc = None, False, None
        self.waited = False  # griddepcontrol.wait done (programmatic dependent launch)


class _Warp:
    __slots__ = ("vals", "who", "offset")

    def __init__(self):
        self.vals, self.who, self.offset = [None] * 32, [], None


class _Bar:
    __slots__ = ("expected", "who")

    def __init__(self):
        self.expected, self.who = 0, []


class _CTA:
    def __init__(self, bidx, rank, nthreads, cluster):
        self.bidx, self.rank, self.nthreads, self.cluster = bidx, rank, nthreads, cluster
        self.warps = [_Warp() for _ in range((nthreads + 31) // 32)]
        self.smem, self.smem_top, self.bars, self.live, self.exited = [], 0, {}, nthreads, False

    def smem_alloc(self, k, dtype, n, align, objs=False):
        if k < len(self.smem):
            b = self.smem[k]
            if (b.dtype, b.n) != (dtype, n):
                raise EmulationError(f"threads of CTA {self.bidx} disagree on shared allocation #{k}")
            return b
        base = -(-self.smem_top // align) * align
        self.smem_top = base + n * _esize(dtype)
        if self.smem_top > SMEM_LIMIT:
            raise EmulationError(f"CTA uses {self.smem_top} bytes of shared memory (limit {SMEM_LIMIT})")
        if objs:
            arr, written = [None] * n, None
        else:
            arr = np.full(n, np.nan, dtype=np.float32) if dtype.is_float else np.zeros(n, dtype=np.int64)
            written = bytearray(n)
        b = _Buf(arr, dtype, "s", f"smem#{k}[{n}] of CTA {self.bidx}", base=base, cta=self, written=written,
                 objs=objs)
        self.smem.append(b)
        return b


class _Cluster:
    def __init__(self):
        self.ctas, self.phase, self.count, self.total, self.waiters = [], 0, 0, 0, []


class _GreenletBackend:
    def __init__(self):
        self.main = _greenlet.getcurrent()

    def start(self, th, body):
        th.task = _greenlet.greenlet(body, parent=self.main)

    def resume(self, th):
        th.task.switch()

    def suspend(self, th):
        self.main.switch()

    def kill(self, th):
        if th.task is not None and bool(th.task):  # started and not finished
            th.task.throw(_Abort)


class _ThreadBackend:
    """One OS thread per task, one running at a time (a baton), for machines without greenlet."""

    def __init__(self):
        self.back = threading.Semaphore(0)

    def start(self, th, body):
        go = threading.Semaphore(0)

        def run():
            go.acquire()
            try:
                if not th.abort:
                    body()
            except _Abort:
                pass
            except BaseException as e:  # noqa: B036 - handed to the scheduler thread
                th.exc = e
            th.done = True
            self.back.release()

        th.task = (threading.Thread(target=run, daemon=True), go)
        th.task[0].start()

    def resume(self, th):
        th.task[1].release()
        if not self.back.acquire(timeout=TIMEOUT_S):
            raise Deadlock(f"thread {th.tid} ran for more than {TIMEOUT_S} s without yielding")
        if th.exc is not None:
            e, th.exc = th.exc, None
            raise e

    def suspend(self, th):
        self.back.release()
        th.task[1].acquire()
        if th.abort:
            raise _Abort

    def kill(self, th):
        if th.task and not th.done:
            th.abort = True
            th.task[1].release()
            self.back.acquire(timeout=TIMEOUT_S)


class _Sched:
    def __init__(self, seed):
        self.reseed(seed)
        self.cur = None
        self.ready = []
        self.copies = []
        self.switches = 0

    def reseed(self, seed):
        self.rng = random.Random(seed)
        self.rnd = self.rng.random

    def block(self, why):
        t = self.cur
        t.why = why
        self.backend.suspend(t)

    def wake(self, t):
        t.why = None
        self.ready.append(t)

    def run(self, threads, fn, args, name):
        self.backend = _GreenletBackend() if _greenlet is not None else _ThreadBackend()
        for th in threads:
            self.backend.start(th, self._body(th, fn, args))
        self.ready = list(threads)
        alive = len(threads)
        deadline = time.perf_counter() + TIMEOUT_S
        try:
            while alive:
                if time.perf_counter() > deadline:
                    raise Deadlock(f"{name}: still running after {TIMEOUT_S} s (livelock?)\n" + _waiting(threads))
                if not self.ready:
                    if self.copies:
                        _deliver_copies()
                        continue
                    raise Deadlock(f"{name}: every thread is blocked\n" + _waiting(threads))
                i = int(self.rnd() * len(self.ready))
                t = self.ready[i]
                self.ready[i] = self.ready[-1]
                self.ready.pop()
                self.cur = t
                self.switches += 1
                try:
                    self.backend.resume(t)
                except _Spin:
                    raise
                except EmulationError as e:
                    raise type(e)(f"{name}, block {t.cta.bidx}, thread {t.tid}: {e}") from e
                except Exception as e:
                    raise EmulationError(f"{name}, block {t.cta.bidx}, thread {t.tid}: {type(e).__name__}: {e}") from e
                if t.done:
                    alive -= 1
            if self.copies:
                raise EmulationError(f"{name}: {len(self.copies)} bulk copies still in flight at kernel exit")
        finally:
            for th in threads:
                if not th.done:
                    self.backend.kill(th)
            self.cur = None
            self.copies = []

    def _body(self, th, fn, args):
        def body():
            try:
                fn(*args)
            except _Abort:
                return
            th.done = True
            cta = th.cta
            cta.live -= 1
            if cta.live == 0:
                cta.exited = True
        return body


def _waiting(threads) -> str:
    by = {}
    for t in threads:
        if not t.done:
            by.setdefault(t.why or "runnable", []).append(f"{t.cta.bidx}/{t.tid}")
    return "\n".join(f"  {len(v)} threads (block/thread {', '.join(v[:6])}{' ...' if len(v) > 6 else ''}) "
                     f"wait in {k}" for k, v in by.items())


_S = _Sched(0)


def _cur() -> _Thread:
    t = _S.cur
    if t is None:
        raise EmulationError("a device function was called outside a kernel launch")
    return t


# ---------------------------------------------------------------------------------------------
# cute.arch
# ---------------------------------------------------------------------------------------------

def thread_idx():
    return (_cur().tid, 0, 0)


def block_idx():
    return _cur().cta.bidx


def block_dim():
    return (_cur().cta.nthreads, 1, 1)


def warp_idx():
    return _cur().tid // 32


def lane_idx():
    return _cur().lane


def barrier(barrier_id=0, number_of_threads=None):
    t = _cur()
    cta = t.cta
    n = cta.nthreads if number_of_threads is None else _as_index(number_of_threads)
    bid = _as_index(barrier_id)
    if not 0 <= bid < 16:
        raise EmulationError(f"barrier id {bid} is not in 0..15")
    if n % 32 or not 0 < n <= cta.nthreads:
        raise EmulationError(f"barrier {bid}: number_of_threads={n} must be a multiple of 32 in 32..{cta.nthreads}")
    b = cta.bars.get(bid)
    if b is None:
        b = cta.bars[bid] = _Bar()
    if not b.who:
        b.expected = n
    elif b.expected != n:
        raise EmulationError(f"barrier {bid}: this thread arrives with number_of_threads={n} while "
                             f"{len(b.who)} threads wait for {b.expected}")
    b.who.append(t)
    if len(b.who) == b.expected:
        for u in b.who:
            if u is not t:
                _S.wake(u)
        b.who = []
        return
    _S.block(f"barrier {bid} ({n} threads)" if bid or n != cta.nthreads else "sync_threads")


def sync_threads():
    barrier(0, None)


def sync_warp(mask=-1):
    """bar.warp.sync: every lane of the warp arrives (a butterfly shuffle of nothing, offset 0)."""
    shuffle_sync_bfly(0.0, offset=0)


def shuffle_sync_bfly(value, offset=1, mask=-1, mask_and_clamp=31):
    """shfl.sync.bfly: lane l reads lane l ^ offset's value (every lane with the same offset)."""
    off = _as_index(offset)
    return _warp_collective(value, f"shuffle_sync_bfly(offset={off})", lambda vals, lane: vals[lane ^ off])


def _warp_collective(value, tag, result):
    """Every lane of the warp arrives with `value` under the same `tag`; each gets result(values, lane)."""
    t = _cur()
    w = t.warp
    if not w.who:
        w.offset = tag
    elif w.offset != tag:
        raise EmulationError(f"{tag}: lane {t.lane} arrives while its warp is in {w.offset}")
    w.vals[t.lane] = value
    w.who.append(t)
    if len(w.who) < 32:
        _S.block(str(tag))
        return t.value
    vals = w.vals
    for u in w.who:
        u.value = result(vals, u.lane)
        if u is not t:
            _S.wake(u)
    w.who, w.vals = [], [None] * 32
    return t.value


def vote_ballot_sync(pred, mask=-1):
    """vote.sync.ballot: bit l set when lane l's predicate holds (all 32 lanes take part), as a signed Int32."""
    def bits(vals, lane):
        m = sum(1 << i for i, v in enumerate(vals) if v)
        return Int32(m - (1 << 32) if m >> 31 else m)
    return _warp_collective(bool(pred), "vote_ballot_sync", bits)


def shuffle_sync(value, offset=0, mask=-1, mask_and_clamp=31):
    """shfl.sync.idx: every lane reads lane `offset`'s value (the same source lane in every lane)."""
    src = _as_index(offset)
    if not 0 <= src < 32:
        raise EmulationError(f"shuffle_sync from lane {src}")
    return _warp_collective(value, ("shuffle_sync", src), lambda vals, lane: vals[src])


def popc(x):
    return Int32(bin(int(x) & 0xFFFFFFFF).count("1"))


def clz(x):
    return Int32(32 - (int(x) & 0xFFFFFFFF).bit_length())


def atomic_add(ptr, val, *, sem=None, scope=None):
    """atom.add on one word of shared or global memory; returns the old value (tasks never interleave inside)."""
    if not isinstance(ptr, Pointer):
        raise EmulationError("atomic_add on a non-pointer")
    old = ptr.buf.read(ptr.off)
    ptr.buf.write(ptr.off, old + val)
    return old


class _Spin(Exception):
    """A thread re-read one word through acquire loads SPIN_LOADS times without seeing it change: its cluster waits
    for another (the launch loop reruns it after the others)."""


SPIN_LOADS = 64
_SPIN = {"key": None, "n": 0}


def load(ptr, dtype, *, sem=None, scope=None):
    """ld (relaxed / acquire) of one word of global or shared memory. A spin (an acquire load of a word returning
    the same value SPIN_LOADS times in a row in one thread) raises _Spin: the launch reruns the cluster from its
    start after the other clusters, as the GPU would run the CTA it waits for. So a kernel that spins must write
    nothing before its spin (a rerun repeats it): proj_gemv's chain CTAs hold."""
    if not isinstance(ptr, Pointer):
        raise EmulationError("load from a non-pointer")
    v = ptr.buf.read(ptr.off)
    if sem == "acquire":
        key = (id(_S.cur), id(ptr.buf), ptr.off, v)
        _SPIN["n"] = _SPIN["n"] + 1 if _SPIN["key"] == key else 1
        _SPIN["key"] = key
        if _SPIN["n"] >= SPIN_LOADS:
            _SPIN["key"], _SPIN["n"] = None, 0
            raise _Spin()
    return v


def fence_acq_rel_gpu():
    """fence.acq_rel.gpu: orders nothing here (one task runs at a time; the module doc's memory-model limits)."""


def _math_div(x, y, fastmath=False, approx=False, ftz=False, full=False, rounding=None):
    """cute.math.div: the quotient (div.full.f32 and the approximate forms held exact, as exp2 and rcp are)."""
    return Float32(_div(float(x), float(y)))


def fmin(a, b):
    if a != a:
        return Float32(b)
    if b != b:
        return Float32(a)
    return Float32(min(float(a), float(b)))


# ---- for the MLA cache write (kernels/cute/mla_cache_write.py): fmax, the inline PTX it emits (one fp32
# instruction each, emulated in fp32 exactly: mul/add/fma/div/sqrt rounded once to fp32, div.full and
# sqrt.approx held correctly rounded as the other approximations are; the e4m3 packing) and fp8 tensors,
# which the kernels reach as 32-bit words of four codes (_Mem.register) --------------------------------------

def fmax(a, b):
    if a != a:
        return Float32(b)
    if b != b:
        return Float32(a)
    return Float32(max(float(a), float(b)))


Float32.mlir_type = "f32"  # the result types a kernel hands to llvm.inline_asm
Int32.mlir_type = "i32"
_ASM_DIALECT = types.SimpleNamespace(AD_ATT=0, AD_Intel=1)


def _f32(x) -> float:
    """x rounded to fp32 (nearest even, overflow to inf). struct's rounding is the C cast's; it refuses only a result
    that overflows, which numpy makes inf."""
    try:
        return _PF.unpack(_PF.pack(x))[0]
    except OverflowError:
        with np.errstate(over="ignore"):
            return float(np.float32(x))


def _fma32(a: float, b: float, c: float) -> float:
    """fma.rn.f32: a * b + c rounded once to fp32 (fp32 operands). The product is exact in fp64; the sum
    rounded to fp64 then fp32 differs from one rounding only where the fp64 sum falls exactly halfway between
    two fp32 values, where the exact sum decides."""
    from fractions import Fraction

    if not all(math.isfinite(v) for v in (a, b, c)):
        return _f32(a * b + c)
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    d = float(exact)  # correctly rounded to fp64
    r = _f32(d)
    if r == d or Fraction(d) == exact or not math.isfinite(r):
        return r
    other = float(np.nextafter(np.float32(r), np.float32(math.inf if d > r else -math.inf)))
    if r + other == 2 * d:  # halfway: the exact value is on one side
        return max(r, other) if exact > d else min(r, other)
    return r


def _sqrt_approx_ftz(a: float) -> float:
    if a != a or a < 0:
        return math.nan
    if a < 2.0 ** -126:  # ftz: a subnormal input is zero
        return 0.0
    return _f32(math.sqrt(a))


_PTX_F32 = {"mul.rn.f32": lambda a, b: _f32(a * b), "add.rn.f32": lambda a, b: _f32(a + b), "fma.rn.f32": _fma32,
            "div.full.f32": lambda a, b: _f32(_div(a, b)), "sqrt.approx.ftz.f32": _sqrt_approx_ftz}


_E4M3_VALUES: list = []


def _e4m3_value(code: int) -> float:
    """The value of a float8_e4m3fn code (NaN for 0x7F / 0xFF), from torch's table of the 256 codes."""
    if not _E4M3_VALUES:
        _E4M3_VALUES.extend(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist())
    return _E4M3_VALUES[code & 0xFF]


def _e4m3(x: float) -> int:
    """cvt.rn.satfinite.e4m3: the float8_e4m3fn code of x (nearest even, saturated to +-448; NaN 0x7F)."""
    if x != x:
        return 0x7F
    x = min(max(x, -448.0), 448.0)
    return int(torch.tensor(x, dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).item())


# The scalar conversions through struct (_PF, _PI, _PE, _PH above: IEEE formats, round to nearest even; several times
# faster than a numpy array a value); a result that overflows the format goes through numpy, which makes it inf.


def _bits_of_f32(x: float) -> int:
    try:
        return _PI.unpack(_PF.pack(x))[0]
    except OverflowError:
        with np.errstate(over="ignore"):
            return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


def _f32_of_bits(b: int) -> float:
    return _PF.unpack(_PI.pack(b & 0xFFFFFFFF))[0]


def _f16_of_bits(h: int) -> float:
    return _PE.unpack(_PH.pack(h & 0xFFFF))[0]


def _bits_of_f16(x: float) -> int:
    """Round to fp16, nearest even (from float64, once), and return the bits."""
    try:
        return _PH.unpack(_PE.pack(x))[0]
    except OverflowError:
        with np.errstate(over="ignore"):
            return int(np.array([x], dtype=np.float64).astype(np.float16).view(np.uint16)[0])


_B32_OPS = ("fma.rn.f16x2", "cvt.rn.f16x2.f32", "mad.lo.u32", "prmt.b32", "cvt.rn.bf16x2.f32", "shl.b32",
            "cvt.rn.f16x2.e4m3x2")


def _bits_of_bf16(x: float) -> int:
    """Round to bf16 as torch does from fp32 (x rounded to fp32 first; nearest even), and return the bits; a NaN
    through torch itself (its CPU conversion's NaN pattern)."""
    if x != x:
        return int(torch.tensor([x], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF
    u = _bits_of_f32(x)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 (default mode): byte i of the result is byte (sel >> 4 i) & 7 of the pair {b (bytes 4..7), a};
    a selector nibble with bit 3 set replicates that byte's sign bit."""
    pair = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (pair >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


# ---- the MLA decode's tensor-core product (kernels/cute/mla_decode.py): mma.sync m16n8k16 bf16 -> fp32 -------------

_MMA_BF16 = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
_MMA_F16 = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"


def _bf16_of_bits(h: int) -> float:
    return _f32_of_bits((h & 0xFFFF) << 16)


_LANE_G, _LANE_T = np.arange(32) // 4, np.arange(32) % 4  # a lane's (group, thread in group) in an MMA fragment


def _mma_m16n8k16(operands, tag=_MMA_BF16):
    """The warp-collective MMA: lane (g = lane / 4, t = lane % 4) holds A's (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..),
    (g+8, 2t+8..) as four bf16 (tag _MMA_F16: f16, subnormals included) pairs, B's (k = 2t..2t+1, n = g),
    (k = 2t+8.., n = g) as two, C's (g, 2t..2t+1), (g+8, 2t..) as four fp32; every lane gets its four D values. The
    products are exact in fp64 and summed with C in fp64, then rounded to fp32 once (the hardware's accumulation order
    and intermediate widths are not modelled)."""
    vals = []
    for i, v in enumerate(operands):
        if v is None:
            raise EmulationError(f"mma operand ${i + 4} is an unset register")
        vals.append(v)

    memo: dict = {}

    def compute(all_vals, lane):
        if "d" not in memo:
            memo["d"] = product(all_vals)
        Dm = memo["d"]
        g, t = lane // 4, lane % 4
        return (Float32(_f32(Dm[g, 2 * t])), Float32(_f32(Dm[g, 2 * t + 1])), Float32(_f32(Dm[g + 8, 2 * t])),
                Float32(_f32(Dm[g + 8, 2 * t + 1])))

    def product(all_vals):
        # the 32 lanes' registers as arrays, the halves decoded at once (the same IEEE values as `half`)
        words = np.array([[int(x) & 0xFFFFFFFF for x in ops[:6]] for ops in all_vals], dtype=np.uint32)  # [32, 6]
        halves = np.stack([words & 0xFFFF, words >> 16], axis=-1)  # [32, 6, 2]: (lo, hi) of each register
        if tag == _MMA_BF16:
            vals = (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        else:
            vals = halves.astype(np.uint16).view(np.float16).astype(np.float64)
        C = np.array([[float(x) for x in ops[6:10]] for ops in all_vals], dtype=np.float64)  # [32, 4]
        A, Bm, Cm = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
        g, t = _LANE_G, _LANE_T
        for r, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
            A[g + dr, 2 * t + dc], A[g + dr, 2 * t + dc + 1] = vals[:, r, 0], vals[:, r, 1]
        for r, dk in enumerate((0, 8)):
            Bm[2 * t + dk, g], Bm[2 * t + dk + 1, g] = vals[:, 4 + r, 0], vals[:, 4 + r, 1]
        Cm[g, 2 * t], Cm[g, 2 * t + 1], Cm[g + 8, 2 * t], Cm[g + 8, 2 * t + 1] = C[:, 0], C[:, 1], C[:, 2], C[:, 3]
        return A @ Bm + Cm

    return _warp_collective(tuple(vals), tag, compute)


_LDSM_T = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"


def _smem_word(cta, addr):
    """The 32-bit word of this CTA's shared memory at byte address addr (an Int32 allocation, 4-aligned)."""
    for b in cta.smem:
        if b.arr is not None and b.base <= addr < b.base + b.n * _esize(b.dtype):
            if b.dtype is not Int32 or (addr - b.base) % 4:
                raise EmulationError(f"ldmatrix reads {b.name} at byte {addr - b.base}: the model needs an aligned "
                                     f"Int32 allocation")
            return int(b.read((addr - b.base) // 4)) & 0xFFFFFFFF
    raise EmulationError(f"ldmatrix address 0x{addr:x} is in no shared allocation of this CTA")


def _ldmatrix_x4_trans(operands):
    """Warp-collective ldmatrix .x4 .trans of b16: lane L gives the 16-byte-aligned row address of row L % 8 of matrix
    L // 8; lane (g, t) gets, in word i, matrix i's (row 2t, col g) in the low half and (row 2t + 1, col g) in the high
    half."""
    addr = int(operands[0])
    if addr % 16:
        raise EmulationError(f"ldmatrix row address 0x{addr:x} is not 16-byte aligned")
    cta = _cur().cta

    def result(addrs, lane):
        g, t = lane // 4, lane % 4
        out = []
        for i in range(4):
            half = []
            for r in (2 * t, 2 * t + 1):
                w = _smem_word(cta, addrs[8 * i + r] + 4 * (g // 2))
                half.append((w >> (16 * (g % 2))) & 0xFFFF)
            v = half[0] | (half[1] << 16)
            out.append(Int32(v - (1 << 32) if v >> 31 else v))
        return tuple(out)

    return _warp_collective(addr, _LDSM_T, result)


def _extractvalue(ty, container, position, **kw):
    return container[position[0]]


_B32_PROGRAMS: dict = {}  # (asm, constraints) -> the parsed statements: each PTX block is parsed once


def _b32_program(asm_string, constraints):
    """The statements of an integer / f16x2 PTX block, parsed once: (op, destinations, sources), each source a
    register name (str) or an immediate (int)."""
    import re

    key = (asm_string, constraints)
    prog = _B32_PROGRAMS.get(key)
    if prog is not None:
        return prog

    def src(a):
        a = a.strip()
        if a.startswith("$") or not re.fullmatch(r"-?(0x[0-9A-Fa-f]+|\d+)", a):
            return a
        return int(a, 0) & 0xFFFFFFFF

    prog = []
    for stmt in asm_string.split(";"):
        s = " ".join(stmt.split()).strip("{} ")
        if not s or s.startswith(".reg "):
            continue
        m = re.fullmatch(r"mov\.b32 \{ ?(\w+), (\w+) ?\}, ([\w$]+)", s)
        if m:
            prog.append(("split", (m[1], m[2]), (src(m[3]),)))
            continue
        op, rest = s.split(" ", 1)
        a = [x.strip() for x in rest.split(",")]
        if op not in _B32_EXEC:
            raise EmulationError(f"inline PTX the emulator does not model: {s!r}")
        prog.append((op, (a[0],), tuple(src(x) for x in a[1:])))
    _B32_PROGRAMS[key] = prog
    return prog


def _fma16(a, b, c):
    return _bits_of_f16(_f16_of_bits(a) * _f16_of_bits(b) + _f16_of_bits(c))


_B32_EXEC = {
    "mov.b32": lambda x: x,
    "and.b32": lambda x, y: x & y,
    "or.b32": lambda x, y: x | y,
    "shl.b32": lambda x, y: (x << y) & 0xFFFFFFFF,
    "shr.u32": lambda x, y: x >> y,
    "brev.b32": lambda x: int(f"{x:032b}"[::-1], 2),
    "add.u32": lambda x, y: (x + y) & 0xFFFFFFFF,
    "mad.lo.u32": lambda x, y, z: (x * y + z) & 0xFFFFFFFF,
    "fma.rn.f16x2": lambda x, y, z: (_fma16(x & 0xFFFF, y & 0xFFFF, z & 0xFFFF)
                                     | (_fma16(x >> 16, y >> 16, z >> 16) << 16)),
    # a .b16 pair of codes: the upper byte to the upper half (exact)
    "cvt.rn.f16x2.e4m3x2": lambda v: (_bits_of_f16(_e4m3_value(v & 0xFF))
                                      | (_bits_of_f16(_e4m3_value((v >> 8) & 0xFF)) << 16)),
    "cvt.f32.f16": lambda x: _bits_of_f32(_f16_of_bits(x)),
    "add.f32": lambda x, y: _bits_of_f32(_f32(_f32_of_bits(x) + _f32_of_bits(y))),
    "fma.rn.f32": lambda x, y, z: _bits_of_f32(_fma32(_f32_of_bits(x), _f32_of_bits(y), _f32_of_bits(z))),
    "cvt.rn.f16x2.f32": lambda x, y: (_bits_of_f16(_f32_of_bits(x)) << 16) | _bits_of_f16(_f32_of_bits(y)),
    "cvt.rn.bf16x2.f32": lambda x, y: (_bits_of_bf16(_f32_of_bits(x)) << 16) | _bits_of_bf16(_f32_of_bits(y)),
    "prmt.b32": lambda x, y, z: _prmt(x, y, z),
}


def _ptx_b32(operands, asm_string, constraints):
    """The MoE kernels' integer / f16x2 PTX (kernels/cute/moe_experts.py): every register a 32-bit (or, for .b16,
    16-bit) pattern; "r" operands enter as their bits, "f" ones as fp32 bits. Ops (_B32_EXEC): mov, and, or, shl,
    shr.u32, brev.b32, add.u32, mad.lo.u32, fma.rn.f16x2 (each half an fp16 fused multiply-add, rounded once, nearest
    even), mov.b32 {lo, hi} (split), cvt.f32.f16, add.f32, fma.rn.f32, cvt.rn.f16x2.f32 (d.hi from the first source).
    The block is parsed once (_b32_program); a register read before it is written raises when it runs."""
    cons = constraints.split(",")
    n_out = sum(1 for c in cons if c.startswith("="))
    regs: dict = {}
    for i, (c, v) in enumerate(zip(cons[n_out:], operands)):
        if v is None:
            raise EmulationError(f"inline PTX operand ${i + n_out} is an unset register")
        regs[f"${i + n_out}"] = _bits_of_f32(float(v)) if c == "f" else int(v) & 0xFFFFFFFF

    for op, dst, srcs in _b32_program(asm_string, constraints):
        try:
            vals = [x if type(x) is int else regs[x] for x in srcs]
        except KeyError as e:
            raise EmulationError(f"inline PTX reads {e.args[0]!r} before writing it") from None
        if op == "split":
            v = vals[0]
            regs[dst[0]], regs[dst[1]] = v & 0xFFFF, v >> 16
        else:
            regs[dst[0]] = _B32_EXEC[op](*vals)

    def result(i):
        out = regs[f"${i}"]
        if cons[i] == "=f":
            return Float32(_f32_of_bits(out))
        return Int32(out - (1 << 32) if out >> 31 else out)

    return result(0) if n_out == 1 else tuple(result(i) for i in range(n_out))


_ASM_KIND: dict = {}  # asm string -> which model runs it (_inline_asm)
_PREFETCH_L2 = "cp.async.bulk.prefetch.L2.global [$0], $1;"
PREFETCHED: list = []  # (address, bytes) of every emulated L2 bulk prefetch; tests clear it and read it


def _prefetch_l2(operands):
    """cp.async.bulk.prefetch.L2: no data moves; the PTX rules are checked (a 16-byte aligned address, a size that
    is a positive multiple of 16) and the range recorded in PREFETCHED."""
    addr, n = int(operands[0]), int(operands[1])
    if addr % 16 or n <= 0 or n % 16:
        raise EmulationError(f"cp.async.bulk.prefetch.L2 of {n} bytes at {addr:#x}: the address must be 16-byte "
                             f"aligned and the size a positive multiple of 16")
    PREFETCHED.append((addr, n))
    return None


def _inline_asm(res, operands, asm_string, constraints, **kw):
    """llvm.inline_asm of the PTX forms the kernels emit: `OP $0, $1, ...;` for OP in _PTX_F32 ("f" operands),
    a `{ .reg .b16 ...; cvt.rn.satfinite.e4m3x2.f32 d, $a, $b; ...; mov.b32 $0, {lo, hi}; }` packing of
    e4m3 codes (cvt puts $a's code in the upper byte), and the MoE kernels' integer / f16x2 blocks (`_ptx_b32`).
    Anything else raises."""
    import re

    kind = _ASM_KIND.get(asm_string)
    if kind is None:
        kind = _ASM_KIND[asm_string] = (
            "prefetch" if asm_string.startswith(_PREFETCH_L2) else "mma_bf16" if asm_string.startswith(_MMA_BF16)
            else "mma_f16" if asm_string.startswith(_MMA_F16) else "ldsm_t" if asm_string.startswith(_LDSM_T)
            else "b32" if any(op in asm_string for op in _B32_OPS) else "f32")
    if kind == "b32":
        return _ptx_b32(operands, asm_string, constraints)
    if kind == "mma_bf16":
        return _mma_m16n8k16(operands)
    if kind == "mma_f16":
        return _mma_m16n8k16(operands, _MMA_F16)
    if kind == "ldsm_t":
        return _ldmatrix_x4_trans(operands)
    if kind == "prefetch":
        return _prefetch_l2(operands)

    vals = [_f32(v) for v in operands]
    regs: dict = {}

    def get(name):
        name = name.strip()
        return vals[int(name[1:]) - 1] if name.startswith("$") else regs[name]

    for stmt in asm_string.split(";"):
        s = " ".join(stmt.split()).strip("{} ")
        if not s or s.startswith(".reg "):
            continue
        m = re.fullmatch(r"cvt\.rn\.satfinite\.e4m3x2\.f32 (\w+), (\$\d+), (\$\d+)", s)
        if m:
            regs[m[1]] = (_e4m3(get(m[2])) << 8) | _e4m3(get(m[3]))
            continue
        m = re.fullmatch(r"mov\.b32 \$0, \{ ?(\w+), (\w+) ?\}?", s)
        if m:
            regs["$0"] = regs[m[1]] | (regs[m[2]] << 16)
            continue
        m = re.fullmatch(r"([a-z0-9.]+) \$0, (.*)", s)
        if m and m[1] in _PTX_F32:
            regs["$0"] = _PTX_F32[m[1]](*[get(a) for a in m[2].split(",")])
            continue
        raise EmulationError(f"inline PTX the emulator does not model: {s!r}")
    out = regs["$0"]
    if constraints.startswith("=f"):
        return Float32(out)
    out &= 0xFFFFFFFF
    return Int32(out - (1 << 32) if out >> 31 else out)


def cluster_arrive(aligned=None):
    t = _cur()
    cl = t.cta.cluster
    if t.carrived is not None:
        raise EmulationError("cluster_arrive twice without a cluster_wait in between")
    t.carrived = cl.phase
    cl.count += 1
    if cl.count == cl.total:
        cl.phase += 1
        cl.count = 0
        for u in cl.waiters:
            _S.wake(u)
        cl.waiters = []


def cluster_wait():
    t = _cur()
    cl = t.cta.cluster
    if t.carrived is None:
        raise EmulationError("cluster_wait without a cluster_arrive")
    if cl.phase <= t.carrived:
        cl.waiters.append(t)
        _S.block("cluster_wait")
    t.carrived = None
    t.cwaits += 1


def _peer(ptr, rank):
    """`mapa`: the same shared-memory address in CTA `rank` of this cluster."""
    t = _cur()
    rank = _as_index(rank)
    if ptr.buf.__class__ is not _Buf or ptr.buf.space != "s" or ptr.buf.cta is not t.cta:
        raise EmulationError("mapa of a pointer that is not this CTA's shared memory")
    ctas = t.cta.cluster.ctas
    if not 0 <= rank < len(ctas):
        raise EmulationError(f"mapa to CTA rank {rank} of a cluster of {len(ctas)}")
    if rank != t.cta.rank and t.cwaits == 0:
        raise EmulationError("distributed shared memory access before any completed cluster barrier (the peer "
                             "CTA may not have started)")
    k = t.cta.smem.index(ptr.buf)
    return Pointer(ctas[rank].smem_by_index(k), ptr.off, ptr.dtype)


def _smem_by_index(self, k):
    if k >= len(self.smem):
        raise EmulationError(f"peer CTA {self.bidx} has not allocated shared buffer #{k} yet")
    return self.smem[k]


_CTA.smem_by_index = _smem_by_index


def _llvm_store(value, ptr, **kw):
    if not isinstance(ptr, Pointer):
        raise EmulationError("llvm.store to a non-pointer")
    ptr.buf.write(ptr.off, value)


# ---- mbarriers and the bulk copy --------------------------------------------------------------

class _MBar:
    __slots__ = ("count", "pending", "tx", "phase", "waiters")

    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase, self.waiters = count, count, 0, 0, []

    def check(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count
            for u in self.waiters:
                _S.wake(u)
            self.waiters = []


def _mbar(ptr, init=False):
    if not isinstance(ptr, Pointer) or ptr.buf.__class__ is not _Buf or not ptr.buf.objs:
        raise EmulationError("mbarrier operation on a pointer that is not a shared Int64 array")
    if ptr.buf.cta is not _cur().cta:
        raise EmulationError("mbarrier of another CTA")
    if not 0 <= ptr.off < ptr.buf.n:
        raise EmulationError(f"mbarrier {ptr.off} out of the array of {ptr.buf.n}")
    mb = ptr.buf.arr[ptr.off]
    if not init and mb is None:
        raise EmulationError(f"mbarrier {ptr.off} used before mbarrier_init")
    return mb


def mbarrier_init(ptr, cnt):
    _mbar(ptr, init=True)
    cnt = _as_index(cnt)
    if cnt < 1:
        raise EmulationError(f"mbarrier_init with count {cnt}")
    ptr.buf.arr[ptr.off] = _MBar(cnt)


def mbarrier_init_fence():
    return None


def _mb_arrive(mb):
    mb.pending -= 1
    if mb.pending < 0:
        raise EmulationError("mbarrier: more arrivals than its count in one phase")
    mb.check()


def mbarrier_arrive(ptr, peer_cta_rank_in_cluster=None):
    _mb_arrive(_mbar(ptr))


def mbarrier_arrive_and_expect_tx(ptr, bytes, peer_cta_rank_in_cluster=None):  # noqa: A002 - the DSL's name
    mb = _mbar(ptr)
    mb.tx += _as_index(bytes)
    _mb_arrive(mb)


def mbarrier_expect_tx(ptr, bytes, peer_cta_rank_in_cluster=None):  # noqa: A002
    _mbar(ptr).tx += _as_index(bytes)


def mbarrier_wait(ptr, phase):
    mb = _mbar(ptr)
    p = _as_index(phase)
    if p not in (0, 1):
        raise EmulationError(f"mbarrier_wait parity {p} is not 0 or 1")
    while mb.phase % 2 == p:
        mb.waiters.append(_cur())
        _S.block(f"mbarrier_wait(parity {p}) on mbarrier {ptr.off}")


def mbarrier_test_wait(ptr, phase):
    """mbarrier.test_wait.parity: whether the phase of parity `phase` has completed. False blocks this task until the
    barrier moves (a kernel's spin loop would otherwise never let the copies land), then returns False: the loop tests
    again."""
    mb = _mbar(ptr)
    p = _as_index(phase)
    if p not in (0, 1):
        raise EmulationError(f"mbarrier_test_wait parity {p} is not 0 or 1")
    if mb.phase % 2 != p:
        return True
    mb.waiters.append(_cur())
    _S.block(f"mbarrier_test_wait(parity {p}) on mbarrier {ptr.off}")
    return False


def _bulk_g2s(dst, src, mbar, size, **kw):
    """cp.async.bulk global -> shared completing on an mbarrier: poison the destination now, land later."""
    nbytes = _as_index(size)
    mb = _mbar(mbar)
    if dst.buf.__class__ is not _Buf or dst.buf.space != "s" or src.buf.__class__ is not _Buf \
            or src.buf.space != "g":
        raise EmulationError("bulk copy must go from global to shared memory")
    if dst.dtype.width != src.dtype.width:
        raise EmulationError("bulk copy between pointers of different element sizes")
    if nbytes <= 0 or nbytes % 16 or dst.addr() % 16 or src.addr() % 16:
        raise EmulationError(f"bulk copy of {nbytes} bytes from 0x{src.addr():x} to 0x{dst.addr():x}: sizes and "
                             f"addresses must be multiples of 16")
    n = nbytes // _esize(dst.dtype)
    for p in (dst, src):
        if p.off < 0 or p.off + n > p.buf.n:
            raise EmulationError(f"bulk copy of {n} elements at {p.off} out of {p.buf.name} ({p.buf.n})")
    dst.buf.arr[dst.off:dst.off + n] = np.nan if dst.buf.arr.dtype.kind == "f" else -0x5A5A5A5A  # int: poison
    dst.buf.written[dst.off:dst.off + n] = bytes(n)
    _S.copies.append((dst, src, n, mb, nbytes))


def _deliver_copies():
    copies, _S.copies = _S.copies, []
    for dst, src, n, mb, nbytes in copies:
        dst.buf.arr[dst.off:dst.off + n] = src.buf.arr[src.off:src.off + n]
        dst.buf.written[dst.off:dst.off + n] = b"\x01" * n
        mb.tx -= nbytes
        mb.check()


# ---------------------------------------------------------------------------------------------
# Kernels, launches, compile; shared-memory allocator
# ---------------------------------------------------------------------------------------------

class SmemAllocator:
    def __init__(self):
        self.k = 0

    def _next(self, dtype, n, align, objs=False):
        b = _cur().cta.smem_alloc(self.k, dtype, n, align, objs)
        self.k += 1
        return b

    def allocate_tensor(self, element_type, layout, byte_alignment=16, swizzle=None):
        if not isinstance(layout, Layout):
            layout = make_layout(layout)
        b = self._next(element_type, layout.cosize(), byte_alignment)
        return Tensor(b, 0, layout.shape, layout.stride, element_type)

    def allocate_array(self, element_type, num_elems=1, byte_alignment=8):
        b = self._next(element_type, _as_index(num_elems), byte_alignment, objs=element_type is Int64)
        return Pointer(b, 0, element_type, byte_alignment)


def _dims(v, what):
    v = [int(x) for x in (v or [1, 1, 1])] + [1] * 3
    if min(v[:3]) < 1:
        raise EmulationError(f"{what} {v[:3]} has an empty dimension")
    return v[:3]


class _Launch:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def launch(self, grid=None, block=None, cluster=None, stream=None, smem=None, max_number_threads=None,
               min_blocks_per_mp=None, **kw):
        g, bl, cl = _dims(grid, "grid"), _dims(block, "block"), _dims(cluster, "cluster")
        if bl[1] != 1 or bl[2] != 1:
            raise EmulationError("the emulator supports 1-D blocks only")
        nt = bl[0]
        if nt > 1024:
            raise EmulationError(f"block of {nt} threads")
        if max_number_threads is not None and nt > math.prod(_dims(max_number_threads, "max_number_threads")):
            raise EmulationError(f"block of {nt} threads > max_number_threads {max_number_threads}")
        ncl = math.prod(cl)
        if ncl > MAX_CLUSTER:
            raise EmulationError(f"cluster of {ncl} CTAs (portable limit {MAX_CLUSTER})")
        if any(a % c for a, c in zip(g, cl)):
            raise EmulationError(f"grid {g} is not a multiple of the cluster {cl}")
        name = getattr(self.fn, "__qualname__", "kernel")
        pdl = bool(kw.pop("use_pdl", False))
        if kw:
            raise EmulationError(f"launch options the emulator does not know: {sorted(kw)}")
        rec = {"kernel": name, "grid": tuple(g), "block": nt, "cluster": tuple(cl), "use_pdl": pdl,
               "min_blocks_per_mp": min_blocks_per_mp}
        LAST.setdefault("launches", []).append(rec)
        t0 = time.perf_counter()
        origins = [(x, y, z) for z in range(0, g[2], cl[2]) for y in range(0, g[1], cl[1])
                   for x in range(0, g[0], cl[0])]
        _S.rng.shuffle(origins)
        _PDL["on"] = pdl
        try:
            waiting = []  # clusters that spun (see `load`): rerun once another cluster has run to completion
            for o in origins:
                try:
                    self._cluster(o, cl, nt, name, pdl)
                except _Spin:
                    waiting.append(o)
                    continue
                while waiting:  # a completed cluster may be what the spinning ones wait for
                    again = []
                    for w in waiting:
                        try:
                            self._cluster(w, cl, nt, name, pdl)
                        except _Spin:
                            again.append(w)
                    if len(again) == len(waiting):
                        break
                    waiting = again
            if waiting:
                raise Deadlock(f"{name}: clusters at {waiting} spin on a word no other cluster changes")
        finally:
            _PDL["on"] = False
        rec["seconds"] = round(time.perf_counter() - t0, 3)

    def _cluster(self, origin, cl, nt, name, pdl=False):
        clus = _Cluster()
        threads = []
        for dz in range(cl[2]):
            for dy in range(cl[1]):
                for dx in range(cl[0]):
                    rank = dx + cl[0] * (dy + cl[1] * dz)
                    cta = _CTA((origin[0] + dx, origin[1] + dy, origin[2] + dz), rank, nt, clus)
                    clus.ctas.append(cta)
                    threads += [_Thread(i, cta) for i in range(nt)]
        clus.total = len(threads)
        _S.run(threads, self.fn, self.args, name)
        if pdl and not all(t.waited for t in threads):
            raise EmulationError(f"{name}: a PDL launch whose threads exit without griddepcontrol.wait")
        LAST["max_smem"] = max(LAST.get("max_smem", 0), max(c.smem_top for c in clus.ctas))


def kernel(fn):
    def bound(*args):
        return _Launch(fn, args)
    bound.__name__, bound.__qualname__ = fn.__name__, fn.__qualname__
    return bound


def jit(fn=None, **kw):
    return fn if fn is not None else (lambda f: f)


def _sig(a):
    if isinstance(a, Pointer):
        return ("ptr", a.dtype, a.align)
    return ("arg", type(a).__name__)


class _Compiled:
    def __init__(self, obj, args):
        self.obj, self.sig = obj, [_sig(a) for a in args]

    def __call__(self, *args):
        sig = [_sig(a) for a in args]
        if sig != self.sig:
            raise EmulationError(f"compiled function called with {sig}, compiled for {self.sig}")
        return self.obj(*args)


def compile(obj, *args, **kw):  # noqa: A001 - the DSL's name
    return _Compiled(obj, args)


def _exp(x):
    try:
        return Float32(math.exp(float(x)))
    except OverflowError:
        return Float32(math.inf)


def _exp2(x, fastmath=False, approx=False, ftz=False):
    try:
        return Float32(2.0 ** float(x))
    except OverflowError:
        return Float32(math.inf)


def _log2(x, fastmath=False, approx=False, ftz=False):
    x = float(x)
    if x != x or x < 0:
        return Float32(math.nan)
    return Float32(-math.inf if x == 0 else math.log2(x))


def _rcp_approx(x):
    x = float(x)
    if x == 0:
        return Float32(math.copysign(math.inf, x))
    return Float32(1.0 / x)


def _rsqrt(x, fastmath=False, approx=False, ftz=False):
    x = float(x)
    if x != x or x < 0:
        return Float32(math.nan)
    if x == 0:
        return Float32(math.inf)
    return Float32(1.0 / math.sqrt(x))


def _const_expr(x):
    return x


def _select(pred, a, b):
    return a if pred else b


def _range(*args, unroll=None, unroll_full=None, **kw):
    return range(*(_as_index(a) for a in args))


def dsl_user_op(fn):
    return fn


# ---------------------------------------------------------------------------------------------
# Host side: gmem registry, make_ptr, torch stand-ins, the fake modules
# ---------------------------------------------------------------------------------------------

class _Mem:
    """The CPU tensors a run may hand to the kernels, found again by address by make_ptr."""

    def __init__(self):
        self.entries = []   # (start, nbytes, torch tensor, cutlass dtype, _Buf)

    def register(self, t: torch.Tensor):
        t = t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t
        if t.dtype == torch.float8_e4m3fn and t.is_contiguous() and t.numel() % 4 == 0:
            t = t.reshape(-1).view(torch.int32)  # fp8 data: 32-bit words of four codes (a view)
        if not t.is_contiguous():
            return
        start, nbytes = t.data_ptr(), t.numel() * t.element_size()
        for e in self.entries:
            if e[0] == start and e[1] == nbytes and e[2].dtype == t.dtype:
                return
        dt = _TORCH_DT.get(t.dtype)
        if dt is None:
            return
        flat = t.detach().reshape(-1)
        arr = flat.numpy() if t.dtype in _VIEWED else flat.float().numpy().copy()
        name = f"gmem {t.dtype} [{', '.join(str(s) for s in t.shape)}] at 0x{start:x}"
        self.entries.append((start, nbytes, t, dt, _Buf(arr, dt, "g", name, base=start)))

    def find(self, dtype, addr):
        for start, nbytes, _, dt, buf in self.entries:
            if start <= addr < start + nbytes and dt is dtype:
                off, rem = divmod(addr - start, _esize(dt))
                if rem:
                    break
                return buf, off
        return _Unmapped(f"{dtype.__name__} at 0x{addr:x}"), 0

    def refresh(self):
        """Copy the host's current values into the shadows of the bf16/fp16 tensors (fp32/int32 are views)."""
        for _, _, t, _, buf in self.entries:
            if t.dtype not in _VIEWED:
                buf.arr[:] = t.detach().reshape(-1).float().numpy()

    def write_back(self):
        for _, _, t, _, buf in self.entries:
            if buf.dirty and t.dtype not in _VIEWED:
                t.copy_(torch.from_numpy(buf.arr).view(t.shape).to(t.dtype))
            buf.dirty = False


_TORCH_DT = {torch.float32: Float32, torch.bfloat16: BFloat16, torch.float16: Float16, torch.int32: Int32,
             torch.int64: Int64}
_VIEWED = (torch.float32, torch.int32, torch.int64)  # the kernels read and write these through a numpy view


class _Emu:
    """The state of one emulated() context."""

    def __init__(self, seed, sms):
        self.mem, self.sms = _Mem(), sms
        _S.reseed(seed)

    def make_ptr(self, dtype, addr, mem_space=None, assumed_align=None):
        al = assumed_align or _esize(dtype)
        if addr % al:
            raise EmulationError(f"make_ptr: address 0x{addr:x} is not {al}-byte aligned")
        buf, off = self.mem.find(dtype, addr)
        return Pointer(buf, off, dtype, al)


_EMU: _Emu | None = None
_CUDA0 = torch.device("cuda", 0)


class _OnDevice(torch.Tensor):
    """A CPU tensor that reports device cuda:0, so the wrappers' device checks pass."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return _CUDA0


def _dev(t):
    if not isinstance(t, torch.Tensor):
        return t
    if t.device.type != "cpu":
        raise ValueError(f"emulate: tensors must be on the CPU (got {t.device})")
    _EMU.mem.register(t)
    return t.as_subclass(_OnDevice)


class _CudaStandIn:
    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def device(dev):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(dev=None):
        return types.SimpleNamespace(cuda_stream=0)

    @staticmethod
    def get_device_properties(dev=None):
        return types.SimpleNamespace(multi_processor_count=_EMU.sms, name="CuTe DSL emulator")


class _TorchStandIn:
    """What the kernel modules see as `torch`: scratch from `empty` is NaN-filled CPU memory the kernels can
    reach; torch.cuda is a stand-in; everything else is torch."""
    cuda = _CudaStandIn()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, dtype=None, device=None, **kw):
        dt = dtype or torch.float32
        t = torch.full(size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size,
                       math.nan if dt.is_floating_point else -0x5A5A5A5A, dtype=dt)  # ints: a poison pattern
        _EMU.mem.register(t)
        return t


class _CUstream:
    def __init__(self, handle=0):
        self.handle = handle


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def _fake_modules(emu: _Emu) -> dict:
    arch = types.SimpleNamespace(
        thread_idx=thread_idx, block_idx=block_idx, block_dim=block_dim, warp_idx=warp_idx, lane_idx=lane_idx,
        make_warp_uniform=lambda x: x, sync_threads=sync_threads, barrier=barrier,
        shuffle_sync_bfly=shuffle_sync_bfly, sync_warp=sync_warp, fmin=fmin, cluster_arrive=cluster_arrive,
        cluster_arrive_relaxed=cluster_arrive, cluster_wait=cluster_wait, mbarrier_init=mbarrier_init,
        griddepcontrol_wait=griddepcontrol_wait, griddepcontrol_launch_dependents=griddepcontrol_launch_dependents,
        mbarrier_init_fence=mbarrier_init_fence, mbarrier_arrive=mbarrier_arrive,
        mbarrier_arrive_and_expect_tx=mbarrier_arrive_and_expect_tx, mbarrier_expect_tx=mbarrier_expect_tx,
        mbarrier_wait=mbarrier_wait, mbarrier_test_wait=mbarrier_test_wait, rcp_approx=_rcp_approx,
        vote_ballot_sync=vote_ballot_sync,
        shuffle_sync=shuffle_sync, popc=popc, clz=clz, atomic_add=atomic_add, load=load,
        fence_acq_rel_gpu=fence_acq_rel_gpu)
    runtime = _module("cutlass.cute.runtime", make_ptr=emu.make_ptr)
    nvgpu = _module("cutlass.cute.nvgpu", CopyG2ROp=_CopyOp, CopyR2GOp=_CopyOp, CopyUniversalOp=_CopyOp,
                    LoadCacheMode=types.SimpleNamespace(ALWAYS="ca", GLOBAL="cg", STREAMING="cs", LAST_USE="lu",
                                                        NONE="none"),
                    StoreCacheMode=types.SimpleNamespace(WRITE_BACK="wb", GLOBAL="cg", STREAMING="cs",
                                                         WRITE_THROUGH="wt", NONE="none"))
    cute = _module("cutlass.cute", jit=jit, kernel=kernel, compile=compile, Pointer=Pointer, Tensor=Tensor,
                   Layout=Layout, make_layout=make_layout, make_tensor=make_tensor, make_rmem_tensor=make_rmem_tensor,
                   autovec_copy=autovec_copy, assume=assume, arch=arch, runtime=runtime, nvgpu=nvgpu,
                   make_copy_atom=make_copy_atom, copy=copy,
                   math=types.SimpleNamespace(exp=_exp, exp2=_exp2, log2=_log2, rsqrt=_rsqrt, div=_math_div),
                   AddressSpace=types.SimpleNamespace(gmem="gmem", smem="smem", rmem="rmem"))
    llvm = _module("cutlass._mlir.dialects.llvm", store=_llvm_store,
                   PointerType=types.SimpleNamespace(get=lambda space: ("ptr", space)),
                   StructType=types.SimpleNamespace(get_literal=lambda fields: ("struct", tuple(fields))),
                   extractvalue=_extractvalue)
    arch.fmax, llvm.inline_asm, llvm.AsmDialect = fmax, _inline_asm, _ASM_DIALECT  # the MLA cache write's
    nvvm = _module("cutlass._mlir.dialects.nvvm", mapa=lambda ty, ptr, rank, **kw: _peer(ptr, rank),
                   cp_async_bulk_shared_cluster_global=_bulk_g2s)
    dialects = _module("cutlass._mlir.dialects", llvm=llvm, nvvm=nvvm)
    mlir = _module("cutlass._mlir", dialects=dialects)
    dsl = _module("cutlass.cutlass_dsl", dsl_user_op=dsl_user_op)
    alloc = types.SimpleNamespace(SmemAllocator=SmemAllocator)
    cutlass = _module("cutlass", Float32=Float32, Int32=Int32, BFloat16=BFloat16, Float16=Float16, Int64=Int64,
                      Boolean=Boolean, Constexpr=object, cute=cute, range=_range, range_constexpr=range,
                      const_expr=_const_expr, select_=_select, memory=alloc, cutlass_dsl=dsl,
                      _mlir=mlir)
    driver = _module("cuda.bindings.driver", CUstream=_CUstream)
    bindings = _module("cuda.bindings", driver=driver)
    cuda = _module("cuda", bindings=bindings)
    mods = [cutlass, cute, runtime, dsl, mlir, dialects, llvm, nvvm, cuda, bindings, driver]
    return {m.__name__: m for m in mods}


# the CuTe DSL kernel modules the emulator rebinds (k3lab_kernels.cute.<name>); the first three are also
# reachable as m.kd / m.kv / m.kp, every one as m.mod[<name>]
_KERNEL_MODULES = ("kda_decode", "kda_verify", "kda_prefill", "attnres_norm", "router_topk", "mla_cache_write",
                   "mla_combine", "proj_gemv", "moe_experts", "mla_query", "mla_decode", "moe_grouped", "moe_dense",
                   "proj_mma", "l2_prefetch")


def _kernel_modules():
    return [importlib.import_module(f"k3lab_kernels.cute.{n}") for n in _KERNEL_MODULES]


def _namespace(mods):
    return types.SimpleNamespace(**dict(zip(("kd", "kv", "kp"), mods)), mod=dict(zip(_KERNEL_MODULES, mods)))


def _is_fake_name(k: str) -> bool:
    return k.split(".")[0] in ("cutlass", "cuda")


_CODE: dict[str, tuple[int, types.CodeType]] = {}


def _reload(m: types.ModuleType) -> None:
    """importlib.reload without compiling the source again: the module's code object is kept (by path and
    modification time) and run in the module's namespace, as reload does. Each `emulated()` runs every kernel
    module twice (on the fake DSL, then back); compiling them took ~0.3 s a context where no bytecode is cached
    (PYTHONDONTWRITEBYTECODE)."""
    path = m.__spec__.origin
    mtime = os.stat(path).st_mtime_ns
    hit = _CODE.get(path)
    if hit is None or hit[0] != mtime:
        with open(path, "rb") as f:
            hit = _CODE[path] = (mtime, builtins.compile(f.read(), path, "exec", dont_inherit=True))
    exec(hit[1], m.__dict__)


@contextlib.contextmanager
def emulated(seed: int = 0, sms: int = 2):
    """Inside: the kernel modules are built on the fake DSL (see the module doc); `sms` is what
    torch.cuda.get_device_properties reports. Re-entrant: an inner call reuses the outer context."""
    global _EMU
    if _EMU is not None:
        _EMU.sms = sms
        yield _namespace(_kernel_modules())
        return
    saved = {k: v for k, v in sys.modules.items() if _is_fake_name(k)}
    for k in saved:
        del sys.modules[k]
    _EMU = _Emu(seed, sms)
    sys.modules.update(_fake_modules(_EMU))
    mods = _kernel_modules()
    try:
        for m in mods:
            _reload(m)
            m.torch = _TorchStandIn()
        LAST.clear()
        yield _namespace(mods)
    finally:
        _EMU = None
        for k in [k for k in sys.modules if _is_fake_name(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
        for m in mods:
            _reload(m)


def _run(call, tensors, seed):
    """Register and wrap `tensors` (a dict of argument name -> tensor / KDAParams), call `call(**wrapped)` in
    the emulated kernel modules, then write the bf16 results back into the caller's tensors."""
    with emulated(seed=seed) as m:
        LAST["launches"], LAST["max_smem"], _S.switches = [], 0, 0
        wrapped = {}
        for k, v in tensors.items():
            if dataclasses.is_dataclass(v):
                v = dataclasses.replace(v, **{f.name: _dev(getattr(v, f.name)) for f in dataclasses.fields(v)
                                              if isinstance(getattr(v, f.name), torch.Tensor)})
            wrapped[k] = _dev(v)
        _EMU.mem.refresh()
        try:
            call(m, **wrapped)
        finally:
            _EMU.mem.write_back()
            LAST["switches"] = _S.switches


def _early(params, state, conv_state):
    """The tensors a PDL launch may read before griddepcontrol.wait: the recurrent and conv state (not
    written by the previous kernel, the wrappers' precondition) and the layer's parameters."""
    ts = [state, conv_state] + [getattr(params, f.name) for f in dataclasses.fields(params)
                                if isinstance(getattr(params, f.name), torch.Tensor)]
    return frozenset(t.data_ptr() for t in ts)


def moe_tensors(z, idx, wk, moe, y, quad_up: bool = False, quad_down: bool = False) -> dict:
    """The CuTe experts' arguments for `_run`: the MXFP4 weights in the kernel layout (w1 and w3 quad-transposed with
    quad_up, as the grouped up kernel reads them; w2 with quad_down, the down kernel's w2_quad), their scales, and the
    int32 views the wrappers make (z's bf16 pairs, idx's words, the scales' bytes four at a time), registered so
    that the emulator finds them by address and dtype (the kernels never see these names)."""
    from k3lab import mxfp4

    kl = {n: mxfp4.to_kernel_layout(getattr(moe, n).data) for n in ("w1", "w3", "w2")}
    if quad_up:
        kl["w1"], kl["w3"] = mxfp4.quad_transpose(kl["w1"]), mxfp4.quad_transpose(kl["w3"])
    if quad_down:
        kl["w2"] = mxfp4.quad_transpose(kl["w2"])
    t = dict(z=z, idx=idx, wk=wk, y=y, **kl, s1=moe.w1.scale, s3=moe.w3.scale, s2=moe.w2.scale)
    t.update({f"{k}_words": v.reshape(-1).view(torch.int32) for k, v in t.items()
              if k in ("z", "idx", "s1", "s3", "s2") and v.dtype != torch.int32})
    return t


def run_decode(qkv, f, b, gate, params, state, conv_state, out, tile_v: int = 128, pdl: bool = False,
               seed: int = 0):
    """kda_decode on the emulator (same arguments; CPU tensors). Returns `out`. pdl=True also checks the
    launch's order: nothing but state, conv_state and params read, nothing written, before the wait."""
    _PDL["early"] = _early(params, state, conv_state)
    _run(lambda m, **a: m.kd.kda_decode(**a, tile_v=tile_v, pdl=pdl),
         dict(qkv=qkv, f=f, b=b, gate=gate, params=params, state=state, conv_state=conv_state, out=out), seed)
    return out


def run_verify(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist, lengths=None,
               tile_v: int = 128, row_warps=None, pdl: bool = False, seed: int = 0):
    """kda_verify on the emulator (same arguments; CPU tensors). Returns `out`; pdl as in run_decode."""
    _PDL["early"] = _early(params, state, conv_state)
    _run(lambda m, **a: m.kv.kda_verify(**a, tile_v=tile_v, row_warps=row_warps, pdl=pdl),
         dict(qkv=qkv, f=f, b=b, gate=gate, params=params, state=state, conv_state=conv_state, out=out,
              state_hist=state_hist, conv_hist=conv_hist, lengths=lengths), seed)
    return out


def run_prefill(qkv, f, b, gate, params, state, conv_state, out, chunk: int = 64, inverse: str = "fp32",
                grouped: bool = False, tile_v: int = 32, seed: int = 0):
    """kda_prefill on the emulator (all of its launches). Returns `out`."""
    _run(lambda m, **a: m.kp.kda_prefill(**a, chunk=chunk, inverse=inverse, grouped=grouped, tile_v=tile_v),
         dict(qkv=qkv, f=f, b=b, gate=gate, params=params, state=state, conv_state=conv_state, out=out), seed)
    return out


def launch(fn, *args, grid=(1, 1, 1), block=(256, 1, 1), cluster=None, seed: int = 0):
    """Run `fn(*args)` as a kernel: a device function written against the fake DSL (inside emulated(),
    `cutlass.cute`; or this module's make_tensor, sync_threads, ...). CPU torch tensors among args become
    global pointers to them (assumed aligned as far as their address is, up to 16 bytes)."""
    with emulated(seed=seed):
        ptrs = []
        for a in args:
            if isinstance(a, torch.Tensor):
                _EMU.mem.register(a)
                p = a.data_ptr()
                a = _EMU.make_ptr(_TORCH_DT[a.dtype], p, "gmem", assumed_align=min(16, p & -p))
            ptrs.append(a)
        _EMU.mem.refresh()
        try:
            kernel(fn)(*ptrs).launch(grid=list(grid), block=list(block), cluster=cluster)
        finally:
            _EMU.mem.write_back()


def run_attnres(blocks, prefix, new, w_norm, w_proj, norm_w, out, partial_out, update: str = "none",
                eps: float = 1e-6, seed: int = 0, early: bool = False, declare: bool = True, **opts):
    """attnres_norm (kernels/cute/attnres_norm.py) on the emulator: the same arguments as CPU tensors (blocks a
    list, new / partial_out None for update "none"), opts its options (cluster, vec, alpha, pdl). Returns `out`.
    pdl=True also checks that only the three weight vectors are read before griddepcontrol.wait; early=True runs
    the module's EARLY setting, the blocks and the prefix declared readable there too (declare=False: not)."""
    old = list(blocks) + [prefix] if early and declare else []
    _PDL["early"] = frozenset(t.data_ptr() for t in (w_norm, w_proj, norm_w, *old))
    blocks = list(blocks)
    named = {f"block{i}": b for i, b in enumerate(blocks)}

    def call(m, **a):
        mod = m.mod["attnres_norm"]
        saved, mod.EARLY = mod.EARLY, early
        try:
            mod.attnres_norm([a[f"block{i}"] for i in range(len(blocks))], a["prefix"], a["new"], a["w_norm"],
                             a["w_proj"], a["norm_w"], a["out"], a["partial_out"], update=update, eps=eps, **opts)
        finally:
            mod.EARLY = saved

    _run(call, dict(named, prefix=prefix, new=new, w_norm=w_norm, w_proj=w_proj, norm_w=norm_w, out=out,
                    partial_out=partial_out), seed)
    return out


def run_verify_checkpoint(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist, lengths=None,
                          tile_v: int = 128, row_warps=None, pdl: bool = False, checkpoint=None, seed: int = 0):
    """kda_verify with a `checkpoint` (state_hist [B, ceil(T / c), H, D, D]) on the emulator; as run_verify."""
    _PDL["early"] = _early(params, state, conv_state)
    _run(lambda m, **a: m.kv.kda_verify(**a, tile_v=tile_v, row_warps=row_warps, pdl=pdl, checkpoint=checkpoint),
         dict(qkv=qkv, f=f, b=b, gate=gate, params=params, state=state, conv_state=conv_state, out=out,
              state_hist=state_hist, conv_hist=conv_hist, lengths=lengths), seed)
    return out
