"""The per-GPU decode step: one AttnRes block of K3 layers on one GPU, timed, attributed and checked.

    step = DecodeStep(view, switches)          # the layers of block 0 at view (tp8: 9 KDA + 3 MLA, layer 0 dense)
    x = step.run()                             # one step: every layer's components in order, chained
    res = bench_step(view, switches, ...)      # timing, launches, trace, comparison, toggles, 93-layer estimate

What it composes. `DecodeStep` builds the layers `block * 12 .. block * 12 + 11` of `view.cfg` (one K3 AttnRes
block; a config with fewer layers, the CPU `tiny` preset, takes all of its layers) with `k3lab.model.build_layer`:
each layer holds its own weights (MoE layers the full routed pool unless `n_experts` says otherwise, in
`view.expert_dtype`: MXFP4, fp8 or bf16), its KDA state or MLA cache at `view.context`, and its components in
layer order (AttnRes mix + norm, the attention projections and core, the second mix + norm, router, latent
down, experts, latent up, shared experts; layer 0's dense MLP). The step chains them: layer i reads the stream
and the AttnRes block list that layer i-1 left (`buf["x_out"]`, `buf["blocks_mlp"]`), layer `block * 12` starts
from the step's input `x_in` and the history `blocks_in` (empty for block 0). `view.draft_depth` D > 0 runs
the verify path (T = D + 1 positions a sequence: KDA verify with state histories, MLA causal among the new
positions, the MoE at batch x T tokens). With a TP view every partial sum stays partial: the all-reduces
are not run (the 93-layer estimate adds them as an assumed cost).

Backends come from the switch object (`k3lab.switches.Switches`), one per component group, read by the layer
builder and the component APIs. `resolve_switches` turns `auto` into what runs: on a CPU the reference (as
`k3lab.policy` does without a GPU); on a GPU `auto` itself where the layer hands it to a component that
resolves it through the one dispatcher (KDA); the group's measured rule where the step or the layer calls a
component API by backend (`OVERRIDE_OPS`; the MLA group through `mla_decode`'s rule, `RULE_OPS`); else the first
fused backend (cute, triton, aiter) the layer has a path for and this machine can run, else the reference.
Whatever lands later in the component modules and `k3lab.model` is picked up through the same calls; nothing here
names a kernel.

How time is attributed (every figure through the one timer, `k3lab.harness.timing`):
  * the whole step: `timing.bench` of `step.run`; on a GPU its calls are captured in ONE CUDA graph (a
    capture failure, e.g. a host sync in a component, falls back to eager timing, and the row's
    `timing_note` and `capture` say so);
  * per layer: one graph per layer (the layer's components in order), rotated over the step's layers of
    the same type when the layer alone fits in L2 several times; the sum of the per-layer medians is
    checked against the whole step (`layer_sum_ratio`, ok within `SUM_TOL`);
  * per component: the same, one graph per component; the stacked bars of a layer are its components;
  * launches and kernel attribution: one eager step under `torch.profiler` with a `record_function`
    range per component ("L03.mla.attn"); every kernel is attributed to the innermost range whose CPU
    span holds its launch (correlation ids); the trace, cut to kernels, copies and ranges, is saved as a
    Chrome/Perfetto JSON (`save_trace`). On a CPU there are no kernels: the count is top-level aten ops.
Floors: each component's bytes come from the layer builder (the registry's `nbytes` formula for the ops
that have one, KDA's `kda_bytes`; else the weights, caches and activations it moves) over the read or copy
bandwidth measured in the same run (`k3lab.harness.roofline`); a layer's floor is the sum of its
components', the step's the sum of its layers'.

The 93-layer estimate (`estimate_93`): the measured attention part of the KDA and of the MLA layers and the
MLP part of the MoE and dense layers (each layer's time split between its attention and MLP parts in
proportion to its components), times 69 / 24 / 92 / 1, plus 2 all-reduces a layer at an ASSUMED cost (no
second GPU here), beside the byte floor of the same layers. Tokens/s = batch x committed positions per step
over the step time (the TP group's rate) and that over the TP degree (per GPU).

Numerics (`step_numerics`): the same stack (same seed, same view) in the compute dtype on the device against
an fp64 reference build on the CPU, over N decode steps of fresh inputs; the per-layer relative error of
the stream and of the KDA state after every step (a router pick that differs from the oracle's but is right for the
step's own input is followed by the oracle and listed: k3lab.model.Layer.align_twin).
"""
from __future__ import annotations

import contextlib
import gzip
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3lab.config import GpuView
from k3lab.harness import roofline, timing
from k3lab.harness.bundle import Bundle, Row
from k3lab.harness.numerics import error_stats
from k3lab.switches import ALLOWED, COMPONENTS, NOT_WIRED, BackendUnavailable, Switches, backend_status

STEP_LAYERS = 12  # one K3 AttnRes block
FUSED = ("cute", "triton", "aiter")
COMPILE_WARM_STEPS = 3  # steps run before timing torch.compile: compile time never lands in a timed region
SUM_TOL = 0.25
# numerics rows: a gate against blow-ups (NaN, growth over the steps), not a precision claim. The stream is bf16
# (2^-8 a rounding, a dozen roundings a layer) through a random stack: up to ~0.1 by layer 7 of the tiny preset
# (measured, 2 steps). A router that picks another expert in bf16 than in fp64 at a near-tie moved that layer's error
# to ~0.2; such picks are aligned now (step_numerics) and listed on the row.
NUMERICS_TOL = 0.25  # per-layer medians summed vs the whole step: |sum / whole - 1| <= this
K3_COUNTS = {"kda": 69, "mla": 24, "moe": 92, "dense": 1}  # layer types of the full model (docs/MODEL.md, The stack)
ALLREDUCE_ASSUMED_US = 12.0  # per all-reduce; docs/MODEL.md, Switches: symmetric-memory one-shot 11-14 us (2 x H200)
ALLREDUCES_PER_LAYER = 2  # the attention output and the MLP output are partial sums under TP
# split_router's exchange (each rank's router logits and latent-down shares gathered, one all-gather a MoE layer):
# not timed on one GPU; assumed at the one-shot all-reduce's latency (a few KB a token either way)
ALLGATHER_ASSUMED_US = ALLREDUCE_ASSUMED_US
MAX_KERNELS_A_ROW = 8  # kernel names kept per component row (the bundle stays small); the trace has them all
TRACE_MAX_EVENTS = 4000  # kernels kept in a saved trace (every range is kept): a report stays small
TRACE_KERNEL_ARGS = ("correlation", "grid", "block", "registers per thread", "stream")  # kernel args kept


class StepError(ValueError):
    """A bad argument of the decode step (named), or a switch the step cannot honour."""


def _fail(name: str, msg: str):
    raise StepError(f"step: {name!r} {msg}")


def _oom_message(view: GpuView, n_experts: int | None, device, layer: int, built: int) -> str:
    """What a step that does not fit tells: where it stopped, what the GPU holds, and the arguments that shrink it."""
    where = f"{device}"
    if _on_gpu(torch.device(device)):
        free, total = torch.cuda.mem_get_info(device)
        where += f" ({free / 1e9:.1f} of {total / 1e9:.1f} GB free after the failure)"
    pool = view.cfg.n_routed_experts if n_experts is None else n_experts
    return (f"step: out of GPU memory building layer {layer} ({built} of the block's layers built) on {where} at "
            f"batch {view.batch}, context {view.context}, draft depth {view.draft_depth}, {view.expert_dtype} experts "
            f"with {pool} routed experts a MoE layer: pass a smaller 'n_experts' (the notebooks' parameter of that "
            f"name: fewer experts built a MoE layer, top-k unchanged, so at larger batch more tokens share an "
            f"expert), a shorter 'context' or a smaller 'batch', or free the GPU's other tensors (another step "
            f"still referenced)")


def block_layer_ids(cfg, block: int = 0) -> list[int]:
    """The layers of AttnRes block `block` (12 layers; all layers of a config with fewer than 12)."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 0:
        _fail("block", f"must be an int >= 0, got {block!r}")
    n = cfg.num_hidden_layers
    if n <= STEP_LAYERS:
        if block:
            _fail("block", f"the config has {n} layers, one step block; got block={block}")
        return list(range(n))
    first = block * STEP_LAYERS
    if first >= n:
        _fail("block", f"block {block} starts at layer {first}, the config has {n} layers")
    return list(range(first, min(first + STEP_LAYERS, n)))


def _on_gpu(device) -> bool:
    return torch.device(device).type == "cuda"


# ---- switches ------------------------------------------------------------------------------------

# Component groups with kernels behind their component APIs: group -> the registry op whose dispatcher rule `auto`
# follows. The layer builder (k3lab.model) runs AttnRes, the router and the experts on their kernels itself; for
# the projections (the builder runs torch matmuls for every "proj" backend) the step fuses them by shared input and
# calls the component APIs (`_fused_parts`); a group the builder refuses is refused by name.
OVERRIDE_OPS = {"attnres": "attnres_norm", "router": "router_topk", "moe": "moe_experts", "proj": "proj"}
LAYER_PATHS = ("reference", "torch_compile")  # what the layer builder itself runs for those groups
# Groups the layer builder runs on a named backend whose choice under `auto` follows a registry op's measured rule
# (data/<component>_defaults.json) before the first fused backend with a path: the MLA group's decode decides it
RULE_OPS = {"mla": "mla_decode"}


def _tokens(layers) -> int:
    L = layers[0]
    return L.B * L.T


def _group_facts(layers, comp: str) -> dict:
    """What the step knows of a component group's calls for its one `auto` choice: the experts' weight format (the
    MoE rules are measured per format) and the trunk projections' (bf16: the layers' weights); no output rows or input
    width, so the rules measured on some projection shapes only (k3lab.policy.matches) stay out of the group's
    choice (`proj_cute` is the step's own per-shape switch)."""
    if comp == "moe":
        return {"fmt": layers[0].view.expert_dtype}
    if comp == "proj":
        return {"fmt": "bf16"}
    return {}


def _override_ok(group: str, backend: str, n_tokens: int) -> tuple[bool, str]:
    """Whether the step can run `group` on `backend` through its component API (named backends may use the
    Triton interpreter on a CPU, as the dispatcher allows when asked by name)."""
    from k3lab.components import dispatch, trunk

    if group not in OVERRIDE_OPS or backend in LAYER_PATHS:
        return False, "the layer builder's path"
    if group == "proj" and n_tokens > trunk.MAX_BATCH:
        return False, f"the trunk projection kernels take <= {trunk.MAX_BATCH} tokens, the step has {n_tokens}"
    try:
        dispatch.select(OVERRIDE_OPS[group], backend, B=n_tokens)
    except (BackendUnavailable, ValueError) as e:
        return False, str(e).splitlines()[0]
    return True, f"{OVERRIDE_OPS[group]} through its component API"


def resolve_switches(switches: Switches, layers: Sequence[Any], device) -> tuple[Switches, dict[str, str]]:
    """`auto` per component group -> what runs here (see the module docstring), with the reason per group.
    A named backend is kept as asked (the layer or the component refuses it by name if it cannot run)."""
    if not isinstance(switches, Switches):
        raise TypeError(f"step: 'switches' must be k3lab.switches.Switches, got {type(switches).__name__}")
    want = dict(switches.backend)
    why: dict[str, str] = {}
    gpu = _on_gpu(device) and torch.cuda.is_available()
    resolved = dict(want)
    for comp, be in want.items():
        if be != "auto":
            why[comp] = "requested"
            continue
        if not gpu:
            resolved[comp], why[comp] = "reference", "auto without a GPU: the torch reference (k3lab.policy)"
            continue
        if comp in OVERRIDE_OPS:  # the component's own measured rule (data/<component>_defaults.json)
            from k3lab.components import dispatch

            be, _, rule = dispatch.select(OVERRIDE_OPS[comp], "auto", B=_tokens(layers),
                                          shape=_group_facts(layers, comp))
            if be not in LAYER_PATHS and _override_ok(comp, be, _tokens(layers))[0] and (
                    comp == "proj" or _group_accepts(layers, comp, be, switches)):
                resolved[comp], why[comp] = be, f"auto: {be}, the {OVERRIDE_OPS[comp]} rule ({rule})"
                continue
        if comp in RULE_OPS:
            from k3lab.components import dispatch

            L = layers[0]
            be, _, rule = dispatch.select(RULE_OPS[comp], "auto", B=L.B, T=L.T)
            if be not in LAYER_PATHS and _group_accepts(layers, comp, be, switches):
                resolved[comp], why[comp] = be, f"auto: {be}, the {RULE_OPS[comp]} rule ({rule})"
                continue
        for cand in ("auto",) + FUSED:
            if cand != "auto" and not backend_status(cand)[0]:
                continue
            if _group_accepts(layers, comp, cand, switches):
                resolved[comp] = cand
                why[comp] = ("auto: the component resolves it through the one dispatcher" if cand == "auto"
                             else f"auto: {cand}, the first fused backend with a path for {comp!r} here")
                break
        else:
            resolved[comp], why[comp] = "reference", f"auto: no fused path for {comp!r} here, the torch reference"
    return switches.replace(backend=resolved), why


def on_one_backend(switches: Switches, backend: str) -> Switches:
    """`switches` with every component group on `backend` (the comparison steps, the build pass on the reference);
    `kda_pdl`, the CuTe KDA kernels' launch mode, is off unless that backend is cute (the KDA component refuses it
    on any other by name)."""
    return switches.replace(backend={c: backend for c in COMPONENTS},
                            kda_pdl=switches.kda_pdl and backend == "cute")


def _group_accepts(layers, comp: str, backend: str, switches: Switches) -> bool:
    """Whether the layers give component group `comp` a path under `backend`: with every other group on the
    reference (always a path), no component is left out (`Layer.skipped`)."""
    probe = switches.replace(backend={c: "reference" for c in COMPONENTS} | {comp: backend})
    for L in layers:
        old = L.switches
        try:
            L.switches = probe
            L.components()
            if L.skipped:
                return False
        finally:
            L.switches = old
    return True


# ---- the step ------------------------------------------------------------------------------------

class DecodeStep:
    """One AttnRes block of decode layers on one GPU (see the module docstring)."""

    def __init__(self, view: GpuView, switches: Switches | None = None, *, block: int = 0,
                 n_experts: int | None = None, device=None, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 gen_device=None, ranges: bool = False, ranks: str = "one"):
        from k3lab.model import build_layer

        if ranks not in TP_RANKS:
            _fail("ranks", f"must be one of {TP_RANKS} (the TP switches' emulation: rank 0's share, timed; or every "
                           f"rank's share in turn, assembled), got {ranks!r}")
        self.ranks = ranks

        if not isinstance(view, GpuView):
            raise TypeError(f"step: 'view' must be k3lab.config.GpuView, got {type(view).__name__}")
        if view.dcp != 1:
            _fail("view.dcp", f"must be 1 for the step (DCP is the MLA component's option), got {view.dcp}")
        if n_experts is not None and (not isinstance(n_experts, int) or isinstance(n_experts, bool)):
            _fail("n_experts", f"must be None (the full pool) or an int, got {n_experts!r}")
        if dtype not in (torch.bfloat16, torch.float64):
            _fail("dtype", f"must be torch.bfloat16 (the step) or torch.float64 (the oracle), got {dtype}")
        self.view = view
        self.cfg = view.cfg
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype
        self.seed = seed
        self.block = block
        self.ids = block_layer_ids(self.cfg, block)
        self.ranges = ranges
        switches = switches or Switches()
        if not isinstance(switches, Switches):
            raise TypeError(f"step: 'switches' must be k3lab.switches.Switches, got {type(switches).__name__}")
        self.requested = switches
        plain = on_one_backend(switches, "reference")
        gen = gen_device or ("cuda" if _on_gpu(self.device) else "cpu")
        t0 = time.perf_counter()
        self.layers = []
        for i in self.ids:
            try:
                self.layers.append(build_layer(view, self.cfg.layer_kind(i), seed, n_experts, device=self.device,
                                               dtype=dtype, switches=plain, layer_index=i, gen_device=gen))
            except torch.OutOfMemoryError as e:
                built = len(self.layers)
                self.layers = []  # what was built goes with this step, before the caller sees the error
                raise torch.OutOfMemoryError(_oom_message(view, n_experts, self.device, i, built)) from e
        self.build_s = time.perf_counter() - t0
        self.n_experts = max((getattr(L, "n_experts", 0) for L in self.layers), default=0)
        L0 = self.layers[0]
        self.x_in = L0.buf["x"]
        self.blocks_in = list(L0.buf["blocks"])
        self.comps: list = []
        self.commit()  # verify path: every build starts from the state after the build's own pass (see commit)
        self.set_switches(switches)

    # -- configuration
    def set_switches(self, switches: Switches) -> None:
        """Resolve `auto`, hand the switches to every layer and rebuild the component lists; refuses a
        backend some component has no path for (no silent fallback)."""
        sw, why = resolve_switches(switches, self.layers, self.device)
        built = self.layers[0].switches.kda_state_dtype
        if sw.kda_state_dtype != built:
            _fail("kda_state_dtype", f"the KDA states were allocated as {built!r}; build a new DecodeStep for "
                                     f"{sw.kda_state_dtype!r}")
        n_tok = _tokens(self.layers)
        over = {}
        for g in OVERRIDE_OPS:
            be = sw.backend[g]
            if be in LAYER_PATHS or (g != "proj" and _group_accepts(self.layers, g, be, sw)):
                continue  # the layer builder runs it
            if g != "proj":  # the fused composition runs only the projections itself (`_fused_parts`)
                raise BackendUnavailable(f"step: backend {be!r} for {g!r}: the layer builder has no path for it "
                                         f"(k3lab.model._IMPLEMENTED, or not for these layers: _PATH_RULES), and "
                                         f"the step runs only the projections itself")
            ok, reason = _override_ok(g, be, n_tok)
            if ok:
                over[g] = be
            elif g != "proj":
                raise BackendUnavailable(f"step: backend {be!r} for {g!r}: {reason}")
            else:
                why[g] = f"{why.get(g, '')}; projections stay on torch matmuls: {reason}"
        comps = []
        for L in self.layers:
            # the layer builder sees the reference for the groups the step runs itself
            L.switches = sw.replace(backend={**sw.backend, **{g: "reference" for g in over}})
            c = L.components()
            if L.skipped:
                raise BackendUnavailable(f"step: layer {L.index} ({L.kind}) has components without a path for "
                                         f"the requested backends: {L.skipped}")
            comps.append(_fused_parts(L, over, c, prefetch=sw.prefetch, prologues=sw.fuse_prologues,
                                      split_router=sw.split_router, owned_output=sw.owned_output,
                                      shared_stream=sw.shared_expert_stream, ranks=self.ranks,
                                      proj_cute=sw.proj_cute and over.get("proj") == "triton"))
        if _on_gpu(self.device) and sw.backend["moe"] in ("triton", "cute", "auto"):
            from k3lab.components import moe as moe_comp

            for L in self.layers:  # the MXFP4 kernel layouts this step's experts read, made now, not inside a
                if L.w.mlp_kind == "moe":  # captured (timed) step
                    moe_comp.prepare(L.w.mlp, tokens=n_tok, backend=sw.backend["moe"])
        if sw.owned_output and sw.fuse_prologues and over.get("proj") == "triton":
            why["fuse_prologues"] = (why.get("fuse_prologues", "") + "; not in moe_out: owned_output runs its glue "
                                     "launch and two projections there").lstrip("; ")
        if sw.shared_expert_stream and over.get("proj") == "triton":
            why["shared_expert_stream"] = (f"on: the shared experts' w1/w3 on a side stream beside the routed experts, "
                                           f"their launch held to at most {SHARED_STREAM_CTAS} CTAs where its "
                                           f"column tiles allow (shared_stream_knobs)")
        if sw.pdl:
            comps = [{n: (_chained(fn), nb, fl) for n, (fn, nb, fl) in c.items()} for c in comps]
            why["pdl"] = ("on: every k3lab Triton kernel of the step (and the CuTe AttnRes, router and cache write) "
                          "launched with programmatic dependent launch (waits for its predecessor, then lets its "
                          "successor launch; cuBLAS and torch ops, the side streams and the CuTe KDA kernels "
                          "without kda_pdl launch plainly)")
        for k in ("split_router", "owned_output", "shared_expert_stream"):
            if getattr(sw, k) and over.get("proj") != "triton":
                why[k] = "on, but no effect: the projections are not on triton (the fused composition applies it)"
            elif getattr(sw, k) and k != "shared_expert_stream":
                tp = self.layers[0].view.tp
                why[k] = (f"on, TP{tp} emulated on one GPU ({self.ranks!r}: " + (
                    "rank 0's share timed; the other ranks' shares from an all-ranks pass at build, the exchange not "
                    "timed" if self.ranks == "one" else "every rank's share in turn, assembled") + ")")
        if sw.proj_cute and over.get("proj") != "triton":
            why["proj_cute"] = "on, but no effect: the projections are not on triton (the fused composition applies it)"
        elif sw.proj_cute:
            why["proj_cute"] = (f"on: the projections of <= {PROJ_CUTE_MAX_TOKENS} token with bf16 weights, no input "
                                f"prologue or fused selection, where the trunk's proj rule (data/trunk_defaults.json) "
                                f"says cute, on the CuTe DSL GEMV (k3lab.step.proj_cute_takes)"
                                + (f"; those of 2..{PROJ_MMA_MAX_TOKENS} tokens without a prologue or fused selection "
                                   f"on its tensor-core path (proj_mma_takes)" if PROJ_MMA_MAX_TOKENS >= 2 else ""))
        if sw.prefetch and over.get("proj") != "triton":
            why["prefetch"] = "on, but no effect: the projections are not on triton (nothing prefetches)"
        elif sw.prefetch:
            why["prefetch"] = (f"on: {PREFETCH_FRACTION} of L2 ({prefetch_budget(self.device)} bytes) of the input "
                               f"projections' weights prefetched on a side stream during each AttnRes")
        self.switches, self.why, self.comps, self.overridden = sw, why, comps, over

    @property
    def backends(self) -> dict[str, str]:
        return dict(self.switches.backend)

    def label(self) -> str:
        return ",".join(f"{c}={b}" for c, b in self.switches.backend.items() if c not in ("dense",))

    # -- running
    def _layer_fns(self, i: int) -> list[tuple[str, Callable[[], Any]]]:
        L = self.layers[i]
        return [(f"L{L.index:02d}.{L.kind}.{n}", fn) for n, (fn, _, _) in self.comps[i].items()]

    def run_layer(self, i: int, after: Callable[[int, str], Any] | None = None) -> torch.Tensor:
        """Layer i alone on the inputs it last saw (its components in order); after(i, component) is called after
        each component when given (the numerics' alignment of a near-tied router choice: step_numerics)."""
        for (name, fn), comp in zip(self._layer_fns(i), self.comps[i]):
            with torch.profiler.record_function(name) if self.ranges else contextlib.nullcontext():
                fn()
            if after is not None:
                after(i, comp)
        return self.layers[i].buf["x_out"]

    def run(self, x: torch.Tensor | None = None, after: Callable[[int, str], Any] | None = None) -> torch.Tensor:
        """One decode step. x (optional): copied into the step's input buffer first ([B, D], [B, T, D] when
        draft_depth > 0). Returns the stream after the last layer (a buffer of the last layer). after: run_layer's."""
        if x is not None:
            if not isinstance(x, torch.Tensor) or x.shape != self.x_in.shape:
                _fail("x", f"must be a tensor of shape {tuple(self.x_in.shape)}, got "
                           f"{tuple(getattr(x, 'shape', ()))}")
            self.x_in.copy_(x)
        xs, blocks = self.x_in, self.blocks_in
        for i, L in enumerate(self.layers):
            L.buf["x"], L.buf["blocks"] = xs, blocks
            self.run_layer(i, after)
            xs, blocks = L.buf["x_out"], L.buf["blocks_mlp"]
        self.x_out = xs
        return xs

    def commit(self) -> None:
        """Verify path (T > 1): accept every position, i.e. copy each KDA layer's state and conv state after the
        last position (state_hist[:, -1], conv_hist[:, -1]) into its state. The KDA component's verify only
        reads the start state (a rejected suffix rolls back for free); the fp64 oracle build advances it in
        place, so without this a bf16 build and its oracle would start from different states. Not part of the
        timed step (the commit is its own op, k3lab.components.kda.commit); the numerics call it after every
        step. No-op for T = 1 (decode advances the state in place)."""
        if self.view.tokens_per_seq == 1:
            return
        for L in self.layers:
            if L.kind == "kda":
                L.state.state.copy_(L.buf["state_hist"][:, -1])
                L.state.conv_state.copy_(L.buf["conv_hist"][:, -1])

    def kda_commit_us(self, accepted: Sequence[int], *, reps: int = 20, warmup: int = 3) -> tuple[float, dict]:
        """Verify path: one KDA layer's commit (`k3lab.components.kda.commit`, backend auto: the Triton copy or
        replay on a GPU) of sequence b's first accepted[b] positions, with the layer's own checkpoint, timed over
        the step's KDA layers in rotation (each its own buffers, as the model runs them). Returns (median us, the
        record of what ran). The states are left as committed."""
        from k3lab.components import kda

        T = self.view.tokens_per_seq
        if T == 1:
            raise StepError("kda_commit_us: the step decodes (draft_depth 0): there is no commit")
        acc = [int(a) for a in accepted]
        if len(acc) != self.view.batch or any(not 1 <= a <= T for a in acc):
            raise StepError(f"kda_commit_us: 'accepted' must hold {self.view.batch} counts in 1..{T}, got {acc}")
        kdas = [L for L in self.layers if L.kind == "kda"]
        n = torch.tensor(acc, dtype=torch.int32, device=self.device)
        ran: list = []

        def one(L):
            b = L.buf
            kda.commit(b["state_hist"], b["conv_hist"], n, L.state.state, L.state.conv_state,
                       checkpoint=L.kda_checkpoint(), qkv=b["qkv"], f=b["f"], b=b["b"], params=L.w.attn.params,
                       backend="auto", check_values=False, ran=ran if not ran else None)

        tm = timing.bench(one, input_sets=[(L,) for L in kdas], reps=reps, warmup=warmup, device=self.device,
                          bytes_per_call=1)
        return tm.median_us, (ran[0].to_dict() if ran else {})

    # -- bytes and floors
    def component_table(self) -> list[dict[str, Any]]:
        """One record per component of every layer: layer, kind, part (attn | mlp), name, group backend,
        bytes (`bytes_from`: the registry's formula where one fits the component, else the layer builder's
        count of weights, caches and activations), flops, floor bandwidth kind."""
        out = []
        for i, L in enumerate(self.layers):
            part = "attn"
            for n, (_, nb, fl) in self.comps[i].items():
                if n == "attnres_mlp":
                    part = "mlp"
                reg = registry_bytes(self.view, L, n)
                src = {"kda_core": "registry: k3lab.ops.kda.kda_bytes"}.get(n, "layer builder")
                out.append(dict(layer=L.index, kind=L.kind, mlp=L.w.mlp_kind, part=part, name=n,
                                backend=L.ran.get(n, "?"), bytes=int(reg if reg is not None else nb), flops=int(fl),
                                floor_bw=L.floor_bw(n), bytes_from="registry: mla_decode" if reg is not None
                                else src))
        return out

    def state_bytes(self) -> int:
        """KDA states + conv states + MLA caches held by the step."""
        tot = 0
        for L in self.layers:
            st = L.state
            if L.kind == "kda":
                tot += sum(t.numel() * t.element_size() for t in (st.state, st.conv_state))
            else:
                c = st.cache
                tot += c.data.numel() * c.data.element_size()
                if getattr(c, "scale", None) is not None:
                    tot += c.scale.numel() * c.scale.element_size()
        return tot

    def weight_bytes(self) -> int:
        from k3lab.weights import nbytes

        return sum(nbytes(L.w) for L in self.layers)

    def group_of(self, i: int) -> tuple:
        L = self.layers[i]
        return (L.kind, L.w.mlp_kind, L.block_start)


def registry_bytes(view: GpuView, layer, name: str) -> int | None:
    """The registry's byte formula for a layer component where one fits it, else None: the MLA attention
    (`mla_decode`: the cache rows read, queries, partial outputs) when the layer has the K3 latent widths the
    formula is written for. (The KDA core's bytes already come from the registry's kda_bytes in the layer
    builder; the other components have no registry op yet.)"""
    if layer.kind != "mla" or name != "attn":
        return None
    from k3lab import registry
    from k3lab.ops import mla as mla_ops

    w = layer.w.attn
    if (w.kv_lora, w.rope_dim) != (mla_ops.C, mla_ops.DR):
        return None
    op = registry.get("mla_decode")
    return int(op.nbytes(op.case(heads=w.heads, batch=layer.B, context=view.context_per_gpu, T=layer.T, page_size=0,
                                 kv_dtype=view.kv_dtype, fp8_scale=layer.fp8_scale, ragged=False)))


_OVERRIDE_GROUP = {"attnres_attn": "attnres", "attnres_mlp": "attnres", "router": "router", "experts": "moe"}


def _cuts(n: int, parts: int) -> list[slice]:
    """n split into `parts` consecutive ranges (TP ranks' shares; sizes differ by at most one)."""
    return [slice(n * q // parts, n * (q + 1) // parts) for q in range(parts)]


def _cat_rows(obj_attrs: list[tuple[Any, str]], dim: int = 0) -> torch.Tensor:
    """Concatenate weights along `dim` (0: [n_i, K] by rows; 1: [N, k_i] side by side) into one tensor and
    re-point each owner's attribute at its range (a view): the group's one launch reads one weight, the builder's
    own paths read the same storage, and the layer holds no second copy. Weights that already are consecutive
    views of one tensor (a step whose switches were set before) are taken as they are."""
    ws = [getattr(o, a) for o, a in obj_attrs]
    base = ws[0]._base
    if base is not None and all(w._base is base for w in ws) and sum(w.shape[dim] for w in ws) == base.shape[dim]:
        off, ok = ws[0].data_ptr() - base.data_ptr(), True
        for w in ws:
            ok = ok and w.data_ptr() - base.data_ptr() == off
            off += w.shape[dim] * w.stride(dim) * w.element_size()
        if ok:
            return base
    if dim == 1:
        ws = [w.t() for w in ws]
    if any(w.dim() != 2 or w.shape[1] != ws[0].shape[1] or w.dtype != ws[0].dtype for w in ws):
        raise ValueError(f"step: cannot fuse weights of shapes {[tuple(w.shape) for w in ws]} and dtypes "
                         f"{sorted({str(w.dtype) for w in ws})} by rows")
    cat = torch.cat(ws, 0)
    if dim == 1:
        cat = cat.t().contiguous()
    a = 0
    for (o, attr), w in zip(obj_attrs, ws):
        setattr(o, attr, cat[a:a + w.shape[0]] if dim == 0 else cat[:, a:a + w.shape[0]])
        a += w.shape[0]
    return cat


PROLOGUE_MAX_TOKENS = 16  # up to this many tokens the norms / SiTU run as the projections' input prologues (above,
# every program of a projection would repeat them on 32-128 rows; batch 64 measured 109 against 29 us for the MoE
# output: docs/NOTES_step.md, ninth session); the router's selection is fused to the same size (SELECT_MAX_BATCH)
TP_RANKS = ("one", "all")  # split_router / owned_output on one GPU: rank 0's share (timed), or all ranks assembled
PREFETCH_FRACTION = 0.5  # of L2: the prefetch switch's budget a phase (the rest keeps the activations and scratch)
_SIDE: dict[str, Any] = {}  # per device: the prefetch switch's side stream


def prefetch_budget(device) -> int:
    """Bytes one prefetch may pull in: PREFETCH_FRACTION of the device's L2 (50 MiB assumed off the GPU)."""
    from k3lab.harness.timing import l2_bytes

    l2 = l2_bytes(device) if _on_gpu(device) else 50 * 2**20
    return int(PREFETCH_FRACTION * l2)


def _prefetching(comp, w: torch.Tensor, n_tok: int, budget: int, prologue: bool = False):
    """The component `comp` (fn, bytes, flops) with an L2 prefetch of `w` (the next projection's weight) launched on
    a side stream beside it and joined at its end (trunk.prefetch_l2; the `prefetch` switch). Off the GPU the
    interpreter's hint prefetches nothing; the plan is still made and recorded."""
    from k3lab.components import trunk

    return _beside(comp, lambda: trunk.prefetch_l2(w, n_tok, budget=budget, prologue=prologue, backend="triton"),
                   w.device)


def _fork(side_fn: Callable[[], Any], device) -> Callable[[], None]:
    """Launch `side_fn` on the side stream now and return the join: what runs on the main stream between the two
    overlaps it (the prefetch of Wo beside the MLA combine, inside one component). In order off the GPU."""
    if not _on_gpu(device):
        side_fn()
        return lambda: None
    key = str(device)
    side = _SIDE.get(key)
    if side is None:
        side = _SIDE[key] = torch.cuda.Stream(device=device)
    cur = torch.cuda.current_stream(device)
    side.wait_stream(cur)
    from k3lab_kernels.triton.pdl import pdl_chain

    with torch.cuda.stream(side), pdl_chain(False):  # a side stream's first kernel follows an event, not a kernel
        side_fn()
    return lambda: cur.wait_stream(side)


def _chained(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn with every k3lab Triton kernel it launches under programmatic dependent launch (the `pdl` switch)."""
    from k3lab_kernels.triton.pdl import pdl_chain

    def run():
        with pdl_chain(True):
            return fn()
    return run


def _beside(comp, side_fn: Callable[[], Any], device):
    """The component `comp` (fn, bytes, flops) with `side_fn` launched on the side stream beside it (forked when
    it starts, joined when it ends: each component stays capturable alone); in order off the GPU."""
    fn = comp[0]

    def run():
        join = _fork(side_fn, device)
        r = fn()
        join()
        return r
    return (run, *comp[1:])


# the `shared_expert_stream` switch's bounded share: the shared experts' w1/w3 launch on the side stream takes at
# most this many CTAs (about a quarter of the H200's 132 SMs), the routed experts beside it the rest. With 16 / 32 / 64
# the step lost at batch 1 and tied at best at batch 8 (H100; docs/NOTES_moe.md, fortieth section): the switch
# stays off.
SHARED_STREAM_CTAS = 32


def shared_stream_knobs(batch: int, n: int, k: int, device, *, fp8: bool = False, tma: bool = True,
                        ctas: int | None = None) -> tuple[dict, int]:
    """The Triton projection's knobs that hold a launch of x [batch, k] W^T (W [n, k]) to at most `ctas` CTAs
    (default SHARED_STREAM_CTAS): its default tile path (the register path "rows", which has no split-K and a CTA
    every few columns, replaced by "dot"), column tiles widened while the tiles alone exceed the bound, then split-K
    cut to what fits. Returns (knobs, the launch's CTAs: tiles x K ranges; more than `ctas` only where the widest
    tiles alone exceed it: n > 256 x ctas at batch <= 16, e.g. both shared experts whole on one GPU at TP1)."""
    from k3lab_kernels.triton import proj_gemv as pg

    ctas = SHARED_STREAM_CTAS if ctas is None else ctas
    if isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < 1:
        _fail("ctas", f"must be an int >= 1, got {ctas!r}")
    dev = torch.device(device)
    path = pg.default_path(batch, n, fp8, tma, K=k)
    path = "dot" if path == "rows" else path
    cfg = pg.config(batch, n, k, dev, path=path, fp8=fp8)
    bn, rows = cfg["BN"], -(-batch // cfg["BM"])
    while -(-n // bn) * rows > ctas and bn < pg.TMA_MAX_BOX:
        bn *= 2
    tiles = -(-n // bn) * rows
    # split-K within the projection's option range (k3lab.ops.trunk: 1..56)
    knobs = dict(path=path, block_n=bn, split_k=min(56, max(1, ctas // tiles)))
    cfg = pg.config(batch, n, k, dev, fp8=fp8, **knobs)
    return knobs, tiles * cfg["SPLIT"]


PROJ_CUTE_MAX_TOKENS = 1
# the KDA decay's second factor f = W_fb fa chained into the input group's CuTe launch (k3lab_kernels.cute.proj_gemv
# `chain`) up to this many tokens, where both run on the CuTe GEMV; 0: its own launch (decay_proj)
KDA_DECAY_CHAIN_MAX_TOKENS = 16
MLA_QUERY_MAX_TOKENS = 4        # the one-launch query step (k3lab_kernels.cute.mla_query.MAX_BATCH)
# the MoE output's glue folded into the launches around it (moe_glue_fold) up to this many tokens; 0: glue.norm_glu
MOE_GLUE_FOLD_MAX_TOKENS = 1
MOE_GLUE_FOLD_ALIGN = 256       # the latent width a multiple of this: the CuTe GEMV's rmsp takes whole 256-column steps
# the `proj_cute` switch's projections of 2..this many tokens on the CuTe tensor-core path (k3lab_kernels.cute.proj_mma,
# `proj_mma_takes`); 0: off, the default until measured inside the step (experiments/step_folds/step_ab.py proj_mma)
PROJ_MMA_MAX_TOKENS = 0


def moe_glue_fold(n_tok: int, be_in: str, lat: int, s_inter: int, sh_row0: int, norm_w: torch.Tensor,
                  be_experts: str | None, experts_fmt: str = "mxfp4") -> bool:
    """Whether the MoE output's glue (glue.norm_glu: the routed norm of y and the shared experts' SiTU, a launch of
    its own) folds into the launches around it (one launch fewer a MoE layer):
      moe_in   the group on the CuTe GEMV (k3lab_kernels.cute.proj_gemv) stores situ(g, u) as its GLU output (its
               shared rows [w1 | w3] from row `sh_row0`, a multiple of 4; s_inter even) into the second segment of
               moe_out's input;
      experts  the one-token CuTe MXFP4 experts' down kernel (or the reference backends, by torch) also writes bf16(y
               routed_norm) into its first segment and a partial sum of y^2 a CTA (`glue`);
      moe_out  reads that input on the CuTe GEMV with the "rmsp" prologue: the first segment's sum times the norm's
               factor from the partials.
    One token (the CuTe experts' path "token"), at most MOE_GLUE_FOLD_MAX_TOKENS, routed_norm bf16, the latent width
    `lat` a multiple of MOE_GLUE_FOLD_ALIGN (K3's 3584; not the tiny preset's, whose step keeps the glue). Measured on
    the batch-1 headline step: experiments/step_folds/step_ab.py moe_glue_fold and docs/NOTES_step.md (twenty-ninth
    session), with the forms that lost (moe_out on the Triton kernel's rmsp prologue; reading y fp32 in moe_out)."""
    return (be_in == "cute" and n_tok == 1 and n_tok <= MOE_GLUE_FOLD_MAX_TOKENS and s_inter % 2 == 0
            and sh_row0 % 4 == 0 and (be_experts in ("reference", "torch_compile")
                                      or (be_experts == "cute" and experts_fmt == "mxfp4"))
            and norm_w.dtype == torch.bfloat16 and lat % MOE_GLUE_FOLD_ALIGN == 0)


def proj_mma_takes(n_tok: int, k_in: int, *, prologue: bool = False, select: bool = False,
                   wdtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the `proj_cute` switch runs a step projection of several tokens on the CuTe tensor-core path (path
    "mma": 2..PROJ_MMA_MAX_TOKENS tokens, bf16 or fp8 weights, K a multiple of 32 / 64, no input prologue or fused
    selection; the fused folds of one token, chain, GLU output and rmsp, stay the GEMV's). Off (0) until measured."""
    return (2 <= n_tok <= PROJ_MMA_MAX_TOKENS and not prologue and not select
            and wdtype in (torch.bfloat16, torch.float8_e4m3fn)
            and k_in % (64 if wdtype == torch.float8_e4m3fn else 32) == 0)


MMA = "cute:mma"  # a part's backend when proj_mma_takes it: backend "cute", path "mma"


def proj_backend(be: str) -> dict:
    """The trunk call's backend keywords for a part's backend string (MMA: the cute backend's path "mma")."""
    return dict(backend="cute", path="mma") if be == MMA else dict(backend=be)


def proj_cute_takes(n_tok: int, n_out: int, k_in: int, *, prologue: bool = False, select: bool = False,
                    wdtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the `proj_cute` switch runs a step projection on the CuTe DSL GEMV (kernels/cute/proj_gemv.py) instead
    of the triton kernels: one token, bf16 weights, no input prologue or fused router selection, and the trunk's
    measured rule for its output rows and input width says cute (data/trunk_defaults.json, the one table `auto` reads
    too: a short input, K <= 2048, or >= 3584 outputs over the model width). The evidence, from the H200 at TP8, cute
    against triton at batch 1, us (weights rotated past L2;
    seventeenth session: profiles/h200/proj_cute.json.gz, proj_group_cute.json.gz, proj_cute_b1.json.gz (git history
    at b20ad25)):
      K <= 2048 wins: mla_uq (K 1536, 2304 outputs) 4.07 / 6.02, kda_fb 1.55 / 2.15, kda_o and mla_o (7168 outputs)
        7.76 / 7.89-7.90, with the residual 8.02-8.04 / 8.38-8.40;
      K = 7168 wins from 3584 outputs alone: the KDA input group 22.89 / 25.26, the MLA input group (3648) 15.29 /
        16.53, the MoE input group without selection 22.05 / 22.82, moe_down 15.14 / 15.94; loses at 1536 and fewer
        (kda_q, kda_v 9.94-9.96 / 9.45-9.49, mla_dq 9.96 / 9.46, mla_dkv 8.46 / 6.61, router 8.87 / 7.74, shared_w1
        8.64 / 7.12: one warp a row over a long K and no split-K); inside the step (notebook 06, two runs) the MLA
        input group on cute took 19.3-19.4 us against 16.4 on triton (fifteenth session's run), so the bar was 4096;
        since the GEMV preloads its weights before the pdl wait the bar is 3584 again, the MLA input group included
        (twentieth session: 16.15 us alone; the batch-1 step with it on cute 1170.3-1170.4 us, not timed against the
        group on triton in the same process);
      K = 4352 (the MoE output's [Wup | w2], 17 steps) loses: 18.77 / 16.94;
    and it loses from batch 4 everywhere (kda_o 12.14 / 8.00 at 4)."""
    if n_tok > PROJ_CUTE_MAX_TOKENS or prologue or select or wdtype != torch.bfloat16:
        return False
    from k3lab import policy

    rule = policy.rule("trunk", "proj", n_tok, 1, {"fmt": "bf16", "n": int(n_out), "k": int(k_in)})
    return rule is not None and rule["backend"] == "cute"


def _fused_parts(L, over: dict[str, str], comps, prefetch: bool = False, prologues: bool = True,
                 split_router: bool = False, owned_output: bool = False, shared_stream: bool = False,
                 ranks: str = "one", proj_cute: bool = False) -> "OrderedDict[str, Any]":
    """The layer's components with its projections fused by shared input when the "proj" group runs on a kernel
    backend (`over["proj"]`); the other components are the builder's (AttnRes, the KDA core, the MLA attention,
    the experts). Fused (each a `k3lab.components.trunk` call, one launch; an RMSNorm or SiTU-GLU between two
    projections runs as the second one's input prologue, `trunk.proj(..., prologue=...)`):
      KDA   in_proj    fa (the decay's first factor), q|k|v, g and beta from h: one proj_group (kda_in); where it
                       and W_fb run on the CuTe GEMV (proj_cute, <= KDA_DECAY_CHAIN_MAX_TOKENS tokens), the
                       decay's second factor f = W_fb fa too (the GEMV's `chain`: CTAs after the main grid wait
                       for fa's CTAs), and decay_proj is gone
            decay_proj the decay's second factor fb (its own launch otherwise)
            out_proj   Wo with the residual add in its epilogue
      MLA   in_proj    q down, kv down, the output gate's logits from h: one proj_group (mla_in)
            q_proj     Wuq with q_norm as its input prologue, and the absorption of Wuk (a batched matmul); where
                       Wuq runs on the CuTe GEMV (proj_cute), the three in one launch (k3lab_kernels.cute.mla_query)
            kv_proj    kv_norm + the cache write (the MLA component's kernel on triton, else the reference)
            out_proj   the combine (merge, Wuv, gate) then Wo with the residual add
      MoE   moe_in     router logits (fp32), latent down, the shared experts' w1 and w3 from h2: one proj_group
                       (moe_in), then the router's top-k (in the same launch: on triton at <= 16 tokens with the
                       router on triton; on the CuTe GEMV at <= 4 tokens with the group and the router on cute)
            moe_out    p + Wup rms(y) + w2 situ(g, u): the routed norm and up-projection and the shared experts'
                       w2 (their w2 side by side) as ONE projection over two K segments, [Wup | w2], the residual
                       p in the epilogue: the layer's output. Its input [rms(y) | situ(g, u)] is written by the
                       one glue kernel (`glue.norm_glu`: two launches in all), or made by the projection's input
                       prologues (`fuse_prologues`: one launch, measured slower); at one token with the groups on
                       the CuTe GEMV the glue folds into the launches around it (`moe_glue_fold`: moe_in's GLU
                       output, the experts' bf16(y routed_norm) and partial sums of y^2, moe_out's rmsp prologue)
      dense MLP        [w1; w3] in one projection, then w2 with SiTU-GLU as its prologue and the residual.
    The weights a group reads are concatenated once and the layer's tensors re-pointed at views of it. Bytes: the
    weights, the activations in and out (the floors' formula of the builder, `Layer._mm`, per launch).
    With prologues=True (the `fuse_prologues` switch, default off) and at most PROLOGUE_MAX_TOKENS tokens the norms
    and SiTU run inside the projections as input prologues; otherwise as launches of their own (glue.rms_norm,
    glue.situ_glu; glue.norm_glu for the MoE output's two segments). The router's top-k runs in moe_in's launch up
    to SELECT_MAX_BATCH tokens.
    prefetch (the switch, projections on triton): each AttnRes launches an L2 prefetch of the next group's weight
    (in_proj's, moe_in's) on a side stream (`_prefetching`), and the MLA output projection's launches Wo's beside
    the combine (`_fork`). Not beside the router's top-k: up to SELECT_MAX_BATCH tokens it runs inside moe_in's
    launch, and the weights read after it are the chosen experts', unknown until it ends.
    split_router / owned_output (the switches, projections on triton), TP emulated on one GPU (`TP_RANKS`):
      split_router  rank r computes rows r of the router and of the latent down-projection (E/tp, Lat/tp; the shared
                    experts' w1/w3 with rank 0's share, one launch), and the shares are exchanged; the top-k then
                    runs on the whole logits (its own launch).
      owned_output  rank r adds only its D/tp output coordinates of the routed up-projection: the shared w2 (+ p)
                    over every coordinate, then Wup's rows r into those coordinates (two launches after the glue).
    ranks "one" (the timed step): rank 0's share only; the other ranks' shares of the logits and latent are those
    of an all-ranks pass made when the parts are built (the exchange itself is not timed: one GPU), and the stream
    leaves this GPU without the other ranks' routed coordinates (their GPUs add them; the all-reduce assembles).
    ranks "all" (the numerics and the tests): every rank's share in turn, assembled: the plain path's values.
    shared_stream (the `shared_expert_stream` switch, projections on triton): the shared experts' w1/w3 leave
    moe_in's launch and run on the side stream beside the routed experts (`_beside`: forked when the experts start,
    joined when they end); their SiTU-GLU and w2 stay in moe_out. Their share of the SMs is bounded by their grid:
    at most SHARED_STREAM_CTAS CTAs (`shared_stream_knobs`), so the routed experts keep the other SMs.
    proj_cute (the switch, projections on triton): the projections `proj_cute_takes` accepts run on the CuTe DSL
    GEMV (backend "cute"); the component's record says "cute" (its one launch) or "triton+cute"."""
    from k3lab.components import glue, trunk
    from k3lab.components import mla as mla_comp
    from k3lab.components import moe as moe_comp
    from k3lab.model import _nb

    if "proj" not in over:
        return comps
    be = over["proj"]
    b, lw = L.buf, L.w
    N, e, dev, dt = L.N, L.e, L.device, L.dtype
    lead = (L.B, L.T) if L.T > 1 else (L.B,)
    D = L.view.cfg.hidden_size

    def flat(t):
        return t.reshape(-1, t.shape[-1])

    def buf(n, dtype=None):
        return torch.empty(N, n, dtype=dtype or dt, device=dev)

    def mm_bytes(cat_w, k_in, n_out, e_out=None, residual=False):
        return _nb(cat_w) + N * (k_in * e + n_out * (e_out or e) + (n_out * e if residual else 0))

    cute_parts: set[str] = set()
    q_one = False  # the MLA query step in one launch (below)
    fold = False  # the MoE output's glue folded into moe_in's and moe_out's CuTe launches (below)

    def pb(w, part: str, prologue: bool = False, select: bool = False) -> str:
        """A projection's backend (the `proj_cute` switch), decided when the parts are built; `part` its component."""
        if proj_cute and be == "triton" and proj_cute_takes(N, w.shape[0], w.shape[1], prologue=prologue,
                                                             select=select, wdtype=w.dtype):
            cute_parts.add(part)
            return "cute"
        if proj_cute and be == "triton" and proj_mma_takes(N, w.shape[1], prologue=prologue, select=select,
                                                           wdtype=w.dtype):
            cute_parts.add(part)
            return MMA
        return be

    def P(x, w, out=None, residual=None, prologue=None, be_=None):
        r = None if residual is None else flat(residual).contiguous()
        return trunk.proj(flat(x).contiguous(), w, out, residual=r, prologue=prologue, **proj_backend(be_ or be))

    fused = ("in_proj", "decay_proj", "out_proj", "q_proj", "kv_proj", "moe_in", "moe_out", "dense_mlp")
    out: OrderedDict[str, Any] = OrderedDict()
    out["attnres_attn"] = comps["attnres_attn"]
    pf = prefetch and be == "triton"
    fuse_pro = prologues and N <= PROLOGUE_MAX_TOKENS  # the norms and SiTU as the projections' input prologues
    budget = prefetch_budget(dev) if pf else 0
    w = lw.attn
    if L.kind == "kda":
        H, Dh = w.params.heads, w.params.head_dim
        # fa first: its rows are the group's first CTAs, which a chained f (below) waits for
        w_in = _cat_rows([(w, "w_fa"), (w, "w_qkv"), (w, "w_g"), (w, "w_b")])
        R = w.w_fa.shape[0]
        fa, qkv, g, beta = buf(R), buf(3 * H * Dh), buf(H * Dh), buf(H)
        b["qkv"], b["gate"], b["b"] = qkv.view(*lead, -1), g.view(*lead, -1), beta.view(*lead, -1)
        f = buf(H * Dh)
        b["f"] = f.view(*lead, -1)
        be_in, be_fb, be_o = pb(w_in, "in_proj"), pb(w.w_fb, "decay_proj"), pb(w.w_o, "out_proj")
        # f = W_fb fa in the input group's launch (one launch fewer) where both run on the CuTe GEMV
        from k3lab_kernels.cute.proj_gemv import K_STEP, MAX_BATCH as CUTE_MAX_BATCH
        chain = (be_in == "cute" and be_fb == "cute" and N <= min(KDA_DECAY_CHAIN_MAX_TOKENS, CUTE_MAX_BATCH)
                 and R % 8 == 0 and R <= K_STEP)

        def in_proj():
            trunk.proj_group(flat(b["h"]), w_in, [fa, qkv, g, beta], **proj_backend(be_in),
                             chain=(w.w_fb, f) if chain else None)
            return b["qkv"]

        def decay():
            P(fa, w.w_fb, f, be_=be_fb)
            return b["f"], b["b"]

        n_in = w_in.shape[0]
        if chain:
            out["in_proj"] = (in_proj, mm_bytes(w_in, D, n_in) + mm_bytes(w.w_fb, R, H * Dh) - N * R * e,
                              2 * N * (D * n_in + R * H * Dh))
        else:
            out["in_proj"] = (in_proj, mm_bytes(w_in, D, n_in), 2 * N * D * n_in)
        if pf:
            out["attnres_attn"] = _prefetching(out["attnres_attn"], w_in, N, budget)
        if not chain:
            out["decay_proj"] = (decay, mm_bytes(w.w_fb, R, H * Dh), 2 * N * R * H * Dh)
        out["kda_core"] = comps["kda_core"]
        p = buf(D)

        def out_proj():
            P(b["o"], w.w_o, p, residual=None if L.block_start else b["x"], be_=be_o)
            b["p"] = p.view(*lead, D)
            return b["p"]
        out["out_proj"] = (out_proj, mm_bytes(w.w_o, w.w_o.shape[1], D, residual=not L.block_start),
                           2 * N * w.w_o.shape[1] * D)
    else:
        H, C, Dn, Dr = w.heads, w.kv_lora, w.nope_dim, w.rope_dim
        w_in = _cat_rows([(w, "w_dq"), (w, "w_dkv"), (w, "w_gate")])
        Q = w.w_dq.shape[0]
        cq, ckv, gl = buf(Q), buf(C + Dr), buf(w.w_gate.shape[0])
        qf = buf(H * (Dn + Dr))
        q_lat = torch.empty(H, N, C, dtype=dt, device=dev)
        lead3 = (L.B, L.T)
        b["mla_gate"] = gl.view(*lead, -1)
        st = L.state

        be_in, be_uq, be_o = pb(w_in, "in_proj"), pb(w.w_uq, "q_proj", prologue=fuse_pro), pb(w.w_o, "out_proj")
        # the whole query step (q_norm, Wuq, Wuk) as one CuTe launch where the GEMV takes Wuq (proj_cute) and the
        # kernel takes the shape (small test models' rope width of 8 does not: they keep the three launches)
        from k3lab.ops import mla as mla_ops

        q_one = (be_uq == "cute" and N <= MLA_QUERY_MAX_TOKENS
                 and mla_ops.query_supports("cute", dict(B=N, Dn=Dn, Dr=Dr, C=C)) is None)

        def in_proj():
            trunk.proj_group(flat(b["h"]), w_in, [cq, ckv, gl], **proj_backend(be_in))
            return cq

        cqn = None if fuse_pro else buf(Q)

        def q_proj():
            if q_one:
                q3 = qf.view(N, H, Dn + Dr)
                mla_comp.query(cq, w.q_norm, w.w_uq, w.w_uk, q_lat.transpose(0, 1), q3[..., Dn:], eps=float(w.eps),
                               backend="cute")
                b["q_lat"] = q_lat.transpose(0, 1).unflatten(0, lead3)
                b["q_rope"] = q3[..., Dn:].view(*lead3, H, Dr)
                return b["q_lat"], b["q_rope"]
            if fuse_pro:
                P(cq, w.w_uq, qf, prologue=("rms", w.q_norm, float(w.eps)))
            else:
                glue.rms_norm(cq, w.q_norm, cqn, eps=float(w.eps), backend=be)
                P(cqn, w.w_uq, qf, be_=be_uq)
            q3 = qf.view(N, H, Dn + Dr)
            torch.bmm(q3[..., :Dn].transpose(0, 1), w.w_uk, out=q_lat)  # [H, N, Dn] @ [H, Dn, C]
            b["q_lat"] = q_lat.transpose(0, 1).unflatten(0, lead3)  # a strided view: the kernel takes any strides
            b["q_rope"] = q3[..., Dn:].view(*lead3, H, Dr)
            return b["q_lat"], b["q_rope"]

        def kv():
            L.mla_write_cache(ckv.view(*lead3, C + Dr))
            return ckv

        n_in = w_in.shape[0]
        out["in_proj"] = (in_proj, mm_bytes(w_in, D, n_in), 2 * N * D * n_in)
        if pf:
            out["attnres_attn"] = _prefetching(out["attnres_attn"], w_in, N, budget)
        q_act = Q + H * (Dr + C) if q_one else (1 if fuse_pro else 3) * Q + H * (Dn + Dr) + H * (Dn + C)
        out["q_proj"] = (q_proj, _nb(w.q_norm, w.w_uq, w.w_uk) + N * q_act * e,
                         2 * N * (Q * H * (Dn + Dr) + H * Dn * C))
        kv_e = st.cache.data.element_size()
        out["kv_proj"] = (kv, _nb(w.kv_norm) + N * (C + Dr) * (e + kv_e), 0)
        out["attn"] = comps["attn"]
        p = buf(D)

        def out_proj():
            # with the prefetch switch Wo is pulled into L2 on the side stream while the combine (merge, Wuv, gate:
            # a few hundred KB) runs, joined before Wo's own launch
            join = (_fork(lambda: trunk.prefetch_l2(w.w_o, N, budget=budget, backend="triton"), dev) if pf
                    else None)
            xo = L.mla_wo_input(b["mla_gate"])
            if join is not None:
                join()
            P(xo, w.w_o, p, residual=None if L.block_start else b["x"], be_=be_o)
            b["p"] = p.view(*lead, D)
            return b["p"]
        ob = comps["out_proj"][1]
        out["out_proj"] = (out_proj, ob, comps["out_proj"][2])
    out["attnres_mlp"] = comps["attnres_mlp"]
    m = lw.mlp
    if lw.mlp_kind == "moe":
        r, sh = m.router, m.shared
        Lat, E = m.w_down.shape[0], r.n_experts
        if len({(s.b1, s.b2) for s in sh}) > 1:
            raise ValueError(f"step: the shared experts have different SiTU constants {[(s.b1, s.b2) for s in sh]}")
        w_moe = _cat_rows([(r, "w"), (m, "w_down")] + [(s, "w1") for s in sh] + [(s, "w3") for s in sh])
        sI = sum(s.w1.shape[0] for s in sh)
        logits, z, gu = buf(E, torch.float32), buf(Lat), buf(2 * sI)
        xin = buf(Lat + sI)  # moe_out's input [rms(y) | situ(g, u)] (or, folded, [bf16(y gamma) | situ(g, u)])
        a_sh = xin[:, Lat:]  # the folded glue's GLU output (moe_glue_fold)
        from k3lab_kernels.cute.moe_experts import glue_partials

        ssp = torch.zeros(N, glue_partials(Lat), dtype=torch.float32, device=dev)  # the folded norm's partials
        # [Wup | w2_1 | w2_2] [D, Lat + sI]: Wup rms(y) + sum_i w2_i a_i is one projection over two K segments
        w_out = _cat_rows([(m, "w_up")] + [(s, "w2") for s in sh], dim=1)
        b["z"] = z
        idx = torch.empty(N, r.top_k, dtype=torch.int64, device=dev)
        wk = torch.empty(N, r.top_k, dtype=torch.float32, device=dev)
        bias = r.e_bias.float().contiguous()
        be_r = L._backend("router") or "reference"
        be_r = "reference" if be_r == "torch_compile" else be_r

        from k3lab_kernels.cute.proj_gemv import SELECT_MAX_BATCH as CUTE_SELECT_MAX_BATCH
        from k3lab_kernels.triton.proj_gemv import SELECT_MAX_BATCH

        fuse_sel = be == "triton" and be_r == "triton" and N <= SELECT_MAX_BATCH and not split_router
        tp = L.view.tp

        def topk():
            trunk.router_topk(logits, bias, top_k=r.top_k, scaling=r.scaling, idx=idx, weights=wk, backend=be_r)

        if split_router:  # rank q: [router rows q; latent-down rows q] (+ the shared w1/w3 with rank 0's share)
            ce, cl = _cuts(E, tp), _cuts(Lat, tp)
            w_sh13 = w_moe[E + Lat:]
            sh0 = not shared_stream  # the shared w1/w3 in rank 0's launch
            w_rank = [torch.cat([r.w[ce[q]], m.w_down[cl[q]]] + ([w_sh13] if q == 0 and sh0 else []), 0)
                      for q in range(tp)]

            be_rank = [pb(w_rank[q], "moe_in") for q in range(tp)]

            def shares(qs):
                for q in qs:
                    outs = [logits[:, ce[q]], z[:, cl[q]]] + ([gu[:, :sI], gu[:, sI:]] if q == 0 and sh0 else [])
                    trunk.proj_group(flat(b["h2"]), w_rank[q], outs, **proj_backend(be_rank[q]))

            if ranks == "one":
                if "h2" in b:
                    shares(range(tp))  # the other ranks' shares, as exchanged (made once, outside any timed region)
                del w_rank[1:]  # the timed step reads rank 0's weight only

            def moe_in():
                shares(range(tp) if ranks == "all" else (0,))
                topk()
                b["idx"], b["wk"] = idx, wk
                return idx, wk
            w_ins = list(w_rank)  # what moe_in reads: rank 0's weight, or every rank's in turn
        else:
            w_in_moe = w_moe[:E + Lat] if shared_stream else w_moe  # rows: router, latent down (, shared w1/w3)
            w_ins = [w_in_moe]
            be_min = pb(w_in_moe, "moe_in", select=fuse_sel)
            # the CuTe GEMV's fused selection: the group on cute (proj_cute) and the router on cute
            fuse_cute = be_min == "cute" and be_r == "cute" and N <= CUTE_SELECT_MAX_BATCH
            # the glue folded (moe_glue_fold): the shared SiTU as the group's GLU output, the routed norm's inputs
            # from the experts' down kernel, moe_out's rmsp prologue
            fold = not (shared_stream or owned_output or fuse_pro) and moe_glue_fold(
                N, be_min, Lat, sI, E + Lat, m.routed_norm, L.ran.get("experts"), m.w1.fmt)

            def moe_in():
                outs = [logits, z] + ([] if shared_stream else [a_sh] if fold else [gu[:, :sI], gu[:, sI:]])
                glu = (sh[0].b1, sh[0].b2) if fold else None
                if fuse_sel or fuse_cute:  # the top-k in the group's launch
                    trunk.proj_group(flat(b["h2"]), w_in_moe, outs, select=trunk.Select(bias, idx, wk, r.scaling),
                                     **proj_backend(be_min), glu=glu)
                else:
                    trunk.proj_group(flat(b["h2"]), w_in_moe, outs, **proj_backend(be_min), glu=glu)
                    topk()
                b["idx"], b["wk"] = idx, wk
                return idx, wk

        n_in = sum(w.shape[0] for w in w_ins)
        if pf:
            out["attnres_mlp"] = _prefetching(out["attnres_mlp"], w_ins[0], N, budget)
        out["moe_in"] = (moe_in, _nb(*w_ins) + N * (D * e * len(w_ins) + n_in * e) + N * E * 2 + r.e_bias.numel() * 4
                         + N * r.top_k * 12, 2 * N * D * n_in)
        out["experts"] = comps["experts"]
        if shared_stream:  # the shared w1/w3 beside the routed experts, on the side stream
            w_sh13 = w_moe[E + Lat:]

            from k3lab_kernels.triton.proj_gemv import tma_ok

            sk = shared_stream_knobs(N, w_sh13.shape[0], D, dev, fp8=w_sh13.dtype == torch.float8_e4m3fn,
                                     tma=tma_ok(flat(b["h2"]), w_sh13))[0] if be == "triton" else {}

            def shared_up():
                trunk.proj_group(flat(b["h2"]), w_sh13, [gu[:, :sI], gu[:, sI:]], backend=be, **sk)

            fn_e, nb_e, fl_e = comps["experts"]
            out["experts"] = _beside((fn_e, nb_e + mm_bytes(w_sh13, D, 2 * sI), fl_e + 2 * N * D * 2 * sI), shared_up,
                                     dev)
        xo = buf(D)
        nb_glue = _nb(m.routed_norm) + N * Lat * (4 + e) + N * sI * 3 * e

        def glue_in():  # [rms(y) | situ(g, u)]: the output projection's input, one launch
            glue.norm_glu(flat(b["y"]), m.routed_norm, gu, xin, eps=float(m.eps), b1=sh[0].b1, b2=sh[0].b2,
                          backend=be)

        if owned_output:  # the shared w2 (+ p) everywhere, then rank q's rows of Wup into its coordinates
            cd = _cuts(D, tp)
            w_sh2 = w_out[:, Lat:].contiguous()
            w_up = [w_out[cd[q], :Lat].contiguous() for q in range(tp)]
            qs = range(tp) if ranks == "all" else (0,)
            be_sh2, be_up = pb(w_sh2, "moe_out"), [pb(w_up[q], "moe_out") for q in range(tp)]

            def moe_out():
                glue_in()
                trunk.proj(xin[:, Lat:], w_sh2, xo, residual=flat(b["p"]).contiguous(), **proj_backend(be_sh2))
                for q in qs:
                    trunk.proj(xin[:, :Lat], w_up[q], xo[:, cd[q]], residual=xo[:, cd[q]], **proj_backend(be_up[q]))
                b["x_out"] = xo.view(*lead, D)
                return b["x_out"]
            d_own = sum(w_up[q].shape[0] for q in qs)
            nb_out = (nb_glue + mm_bytes(w_sh2, sI, D, residual=True) + _nb(*[w_up[q] for q in qs])
                      + N * (Lat * e + 2 * d_own * e))
            fl_out = 2 * N * (sI * D + Lat * d_own)
        elif fuse_pro:
            def moe_out():
                trunk.proj(flat(b["y"]), w_out, xo, residual=flat(b["p"]).contiguous(),
                           prologue=("rms", m.routed_norm, float(m.eps)), x2=gu,
                           prologue2=("situ", sh[0].b1, sh[0].b2), backend=be)
                b["x_out"] = xo.view(*lead, D)
                return b["x_out"]
            nb_out = _nb(m.routed_norm) + N * Lat * 4 + mm_bytes(w_out, 2 * sI, D, residual=True)
            fl_out = 2 * N * (Lat + sI) * D
        elif fold:  # experts write [bf16(y gamma) | .] and the partials; one launch: [Wup | w2] xin (rmsp) + p
            cute_parts.add("moe_out")
            be_e = L.ran["experts"]
            fn_e, nb_e, fl_e = out["experts"]

            def experts():
                b["y"] = moe_comp.experts(b["z"], b["idx"], b["wk"], m, backend=be_e, check_values=False,
                                          glue=(m.routed_norm, xin[:, :Lat], ssp))
                return b["y"]
            out["experts"] = (experts, nb_e + _nb(m.routed_norm) + N * Lat * e + ssp.numel() * 4, fl_e)

            def moe_out():
                trunk.proj(xin, w_out, xo, residual=flat(b["p"]).contiguous(),
                           prologue=("rmsp", ssp, Lat, float(m.eps)), backend="cute")
                b["x_out"] = xo.view(*lead, D)
                return b["x_out"]
            nb_out = ssp.numel() * 4 + mm_bytes(w_out, Lat + sI, D, residual=True)
            fl_out = 2 * N * (Lat + sI) * D
        else:  # two launches: the glue into the two segments of one input, then one projection over [Wup | w2]
            be_out = pb(w_out, "moe_out")

            def moe_out():
                glue_in()
                P(xin, w_out, xo, residual=b["p"], be_=be_out)
                b["x_out"] = xo.view(*lead, D)
                return b["x_out"]
            nb_out = nb_glue + mm_bytes(w_out, Lat + sI, D, residual=True)
            fl_out = 2 * N * (Lat + sI) * D
        out["moe_out"] = (moe_out, nb_out, fl_out)
    else:
        w13 = _cat_rows([(m, "w1"), (m, "w3")])
        I = m.w1.shape[0]
        gu, xo = buf(2 * I), buf(D)

        a_d = None if fuse_pro else buf(I)
        be_13, be_2 = pb(w13, "dense_mlp"), pb(m.w2, "dense_mlp", prologue=fuse_pro)

        def dense():
            P(b["h2"], w13, gu, be_=be_13)
            if fuse_pro:
                P(gu, m.w2, xo, residual=b["p"], prologue=("situ", m.b1, m.b2))
            else:
                glue.situ_glu(gu, a_d, b1=m.b1, b2=m.b2, backend=be)
                P(a_d, m.w2, xo, residual=b["p"], be_=be_2)
            b["x_out"] = xo.view(*lead, D)
            return b["x_out"]
        out["dense_mlp"] = (dense, mm_bytes(w13, D, 2 * I) + mm_bytes(m.w2, (2 if fuse_pro else 1) * I, D,
                                                                        residual=True)
                            + (0 if fuse_pro else N * I * 3 * e),
                            2 * N * D * 3 * I)
    single = (("in_proj", "decay_proj") + (("out_proj",) if L.kind == "kda" else ()) + (("q_proj",) if q_one else ())
              + (("moe_out",) if fold else ()))
    # (one launch each)

    def ran_as(name: str) -> str:
        if name in cute_parts:
            return "cute" if name in single else f"{be}+cute"
        return be if name in fused else L.ran.get(name, "reference")
    L.ran = {name: ran_as(name) for name in out}
    return out


def _why_failed(e: BaseException, limit: int = 900) -> str:
    """An exception in a few lines for the record: its type and first line, its root cause (inductor wraps the
    error that matters: `BackendCompilerFailed ... raised:` then the cause) and the message's last lines."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    out = f"{type(e).__name__}: {lines[0] if lines else ''}"
    cause = e.__cause__ or e.__context__
    while cause is not None and (cause.__cause__ or cause.__context__) is not None:
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        out += f" | cause {type(cause).__name__}: {' '.join(str(cause).split())[:300]}"
    if len(lines) > 1:
        out += " | " + " / ".join(ln.strip() for ln in lines[-3:])
    return out[:limit]


# ---- profiling: launches and kernel attribution ------------------------------------------------------

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace categories of work on the GPU


def trace_events(path: str | Path) -> list[dict]:
    """A Chrome trace's events: the profiler's raw export or a trace `save_trace` wrote (gzip when it ends in .gz)."""
    path = Path(path)
    d = json.loads(gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text())
    return d.get("traceEvents", d) if isinstance(d, dict) else d


def attribute(events: list[dict], prefix: str = "L") -> dict[str, dict[str, Any]]:
    """Per range (record_function name starting with `prefix`): launches, kernel time (us) and kernel
    names, from a Chrome trace's events. GPU: a kernel / copy / memset belongs to the innermost range
    whose CPU span holds the runtime call that launched it (matched by correlation id). Without GPU events:
    the top-level aten ops inside each range (kind "cpu-ops")."""
    ranges = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)
              and "dur" in e]
    dev = [e for e in events if e.get("cat") in GPU_WORK]
    out: dict[str, dict[str, Any]] = {}
    for r in ranges:
        out.setdefault(r["name"], {"launches": 0, "kernel_us": 0.0, "kernels": {}, "kind": "gpu" if dev else
                                   "cpu-ops"})

    def innermost(ts: float, tid) -> str | None:
        best = None
        for r in ranges:
            if r.get("tid") == tid and r["ts"] <= ts <= r["ts"] + r["dur"]:
                if best is None or r["dur"] < best["dur"]:
                    best = r
        return best["name"] if best else None

    if dev:
        launch = {}
        for e in events:
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {}):
                launch[e["args"]["correlation"]] = e
        for k in dev:
            c = (k.get("args") or {}).get("correlation")
            rt = launch.get(c)
            if rt is None:
                continue
            name = innermost(rt["ts"], rt.get("tid"))
            if name is None:
                continue
            rec = out[name]
            rec["launches"] += 1
            rec["kernel_us"] += float(k.get("dur", 0.0))
            kn = str(k.get("name", "?"))[:120]
            rec["kernels"][kn] = rec["kernels"].get(kn, 0) + 1
        return out
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and "dur" in e), key=lambda e: (e["ts"], -e["dur"]))
    top: list[dict] = []
    end = -1.0
    for e in ops:  # top-level ops: not inside the previous top-level op
        if e["ts"] >= end:
            top.append(e)
            end = e["ts"] + e["dur"]
    for e in top:
        name = innermost(e["ts"] + 1e-3, e.get("tid"))
        if name is not None and str(e.get("name", "")).startswith("aten::"):
            out[name]["launches"] += 1
            out[name]["kernel_us"] += float(e["dur"])
            out[name]["kernels"][e["name"]] = out[name]["kernels"].get(e["name"], 0) + 1
    return out


def profile_step(step: DecodeStep, trace_path: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """One eager step under torch.profiler with a range per component; returns `attribute(...)` of it.
    trace_path: also save the trace cut to kernels, copies and ranges (gzip when it ends in .gz)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = _on_gpu(step.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    old = step.ranges
    step.ranges = True
    try:
        step.run()  # warm (compiles, autotunes) outside the profile
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            with torch.profiler.record_function("step"):
                step.run()
            if cuda:
                torch.cuda.synchronize()
    finally:
        step.ranges = old
    with tempfile.TemporaryDirectory() as td:
        raw = Path(td) / "trace.json"
        prof.export_chrome_trace(str(raw))
        events = trace_events(raw)
    att = attribute(events)
    if trace_path is not None:
        save_trace(events, trace_path)
    return att


def save_trace(events: list[dict], path: str | Path, max_events: int = TRACE_MAX_EVENTS) -> Path:
    """The trace cut to what the timeline needs, as Chrome trace JSON (gzip when `path` ends in .gz): every
    range (CPU and GPU side) and the first `max_events` kernels, copies and memsets in time order (on a CPU:
    top-level ops); the metadata event "k3lab" says how many were left out."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = [e for e in events if e.get("ph") == "M"]
    rng = [e for e in events if e.get("cat") in ("user_annotation", "gpu_user_annotation")]
    work = [e for e in events if e.get("cat") in GPU_WORK]
    if not work:  # CPU run: the ops instead
        work = [e for e in events if e.get("cat") == "cpu_op"]
    work.sort(key=lambda e: e.get("ts", 0))
    left = max(0, len(work) - max_events)
    keep = meta + rng + work[:max_events]
    for e in keep:
        if e.get("cat") == "cpu_op":
            e.pop("args", None)
        elif isinstance(e.get("args"), dict) and e.get("cat") in GPU_WORK:
            e["args"] = {k: v for k, v in e["args"].items() if k in TRACE_KERNEL_ARGS}
    keep.append({"ph": "M", "name": "k3lab", "pid": 0, "tid": 0,
                 "args": {"events_left_out": left, "kept": min(len(work), max_events)}})
    text = json.dumps({"traceEvents": keep, "displayTimeUnit": "ms"})
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


# ---- timing --------------------------------------------------------------------------------------------

def _bench(fn, sets, *, device, bytes_per_call: int, reps: int, warmup: int, min_calls: int,
           graph: bool = True) -> timing.Timing:
    """The one timer: a graph of rotated sets on a GPU (hot when fewer sets than the rotation needs and one
    set is all there is; graph=False: eager), cpu-smoke on a CPU."""
    if _on_gpu(device):
        need = timing.rotation_count(bytes_per_call, timing.l2_bytes(), max_sets=64)
        rotate = len(sets) > 1 or need <= 1
        return timing.bench_gpu(fn, input_sets=sets, warmup=warmup, reps=reps, bytes_per_call=bytes_per_call,
                                min_calls_per_graph=min_calls, rotate=rotate, graph=graph)
    return timing.bench_cpu(fn, input_sets=sets[:1], warmup=min(warmup, 1), reps=reps, bytes_per_call=bytes_per_call)


def _sets_for(step: DecodeStep, i: int, bytes_per_call: int, device) -> list[int]:
    """Layer indices to rotate over for layer i: i first, then the step's other layers of its type, as many
    as the timer's rotation count asks for (one on a CPU)."""
    if not _on_gpu(device):
        return [i]
    need = timing.rotation_count(bytes_per_call, timing.l2_bytes(), max_sets=64)
    same = [j for j in range(len(step.layers)) if j != i and step.group_of(j) == step.group_of(i)]
    return [i] + same[:max(0, need - 1)]


@dataclass
class StepResult:
    bundle: Bundle
    components: list[dict[str, Any]] = field(default_factory=list)
    attribution: dict[str, dict[str, Any]] = field(default_factory=dict)
    estimate: dict[str, Any] = field(default_factory=dict)
    trace: str | None = None
    numerics: dict[str, Any] | None = None


def time_step(step: DecodeStep, *, reps: int, warmup: int, min_calls: int = 3, graph: bool = True) -> timing.Timing:
    """The whole step through the one timer (one CUDA graph of `min_calls` steps on a GPU; graph=False: eager)."""
    nb = sum(c["bytes"] for c in step.component_table())
    return _bench(lambda: step.run(), [()], device=step.device, bytes_per_call=nb, reps=reps, warmup=warmup,
                  min_calls=min_calls, graph=graph)


def _ran_record(L, name: str) -> dict[str, Any]:
    """What the component API recorded for the layer's last call of `name` (its kernel and options, and the rule
    or request behind them), for the component's row; {} where the layer keeps no record."""
    r = getattr(L, "records", {}).get(name)
    if not r:
        return {}
    return {"ran_kernel": r.get("kernel"), "ran_options": r.get("options") or {}, "ran_why": r.get("why")}


def _floor_us(rec: dict, pr: dict) -> float:
    return roofline.floor_from_probes(rec["bytes"], rec["flops"], pr, rec["floor_bw"]).floor_us


def bench_step(view: GpuView, switches: Switches | None = None, *, block: int = 0, n_experts: int | None = None,
               compare: Sequence[str] = ("reference", "torch_compile"), toggles: bool | Sequence[str] = True,
               components: bool = True,
               reps: int = 20, warmup: int = 3, compare_reps: int | None = None, trace_path: str | Path | None = None,
               allreduce_us: float = ALLREDUCE_ASSUMED_US, allreduce_label: str = "assumed", seed: int = 0,
               name: str | None = None, device=None,
               step: DecodeStep | None = None, profile: bool = True, log: Callable[[str], None] = print,
               checkpoint: Callable[[Bundle], Any] | None = None) -> StepResult:
    """Build the step (or take `step`), then: launches and kernel attribution (one profiled eager step, trace
    saved to `trace_path`), per-component and per-layer timing with floors, the whole step in one graph, the
    per-layer sum check, the same step under each backend of `compare` (every component on it), each switch
    toggled alone (`toggle_list`; `toggles` True, False, or the names to toggle: components and switches from
    `TOGGLE_NAMES`), the 93-layer estimate. profile=False leaves out the profiled step (no launch
    counts, no trace). checkpoint(bundle): called after the fused step and after every toggle and comparison
    (a run cut short keeps what it measured). Order: the fused step, the estimate, the toggles, the
    comparisons in the order given. Returns the bundle and the tables behind it."""
    switches = switches or Switches()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = _on_gpu(device)
    if not isinstance(reps, int) or reps < 1:
        _fail("reps", f"must be an int >= 1, got {reps!r}")
    compare_reps = compare_reps or max(2, reps // 4)
    for be in compare:
        if be not in ("reference", "torch_compile"):
            _fail("compare", f"holds {be!r}; the comparison steps are 'reference' and 'torch_compile'")
    only = None
    if not isinstance(toggles, bool):
        if isinstance(toggles, str) or not all(isinstance(n, str) for n in toggles):
            _fail("toggles", f"must be True, False or a sequence of names from {TOGGLE_NAMES}, got {toggles!r}")
        only = set(toggles)
        bad = sorted(only - set(TOGGLE_NAMES))
        if bad:
            _fail("toggles", f"names {bad} are not toggled by the step; names: {TOGGLE_NAMES}")
    pr = timing.probes(device)

    def save() -> None:
        if checkpoint is not None:
            checkpoint(b)

    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    if step is None:
        step = DecodeStep(view, switches, block=block, n_experts=n_experts, device=device, seed=seed)
    name = name or f"decode_step-tp{view.tp}-b{view.batch}-c{view.context}-d{view.draft_depth}"
    b = Bundle.new(name, view=view, switches=step.switches)
    b.copy_tbps, b.read_tbps, b.launch_floor_us = pr["copy_tbps"], pr["read_tbps"], pr["launch_us"]
    kind = "gpu" if gpu else "cpu-smoke"
    log(f"{'GPU' if gpu else 'CPU (smoke timing only)'}: copy {b.copy_tbps:.3f} TB/s, read {b.read_tbps:.3f} TB/s, "
        f"launch floor {b.launch_floor_us:.2f} us; {len(step.layers)} layers built in {step.build_s:.1f} s")
    if not gpu:
        b.notes.append("CPU run: times are cpu-smoke wall clock, floors use host figures; not GPU figures")
    mem = {"weights_gb": step.weight_bytes() / 1e9, "states_gb": step.state_bytes() / 1e9}
    if gpu:
        mem["allocated_gb"] = torch.cuda.memory_allocated(device) / 1e9
    comp = step.component_table()
    base_switches = step.switches
    label = "fused"
    for be in COMPONENTS:
        b.backends_ran[f"{label}:{be}"] = f"{step.switches.backend[be]} ({step.why.get(be, '')})"

    # launches and kernel attribution: one profiled eager step
    att = profile_step(step, trace_path) if profile else {}
    for c in comp:
        a = att.get(f"L{c['layer']:02d}.{c['kind']}.{c['name']}", {})
        c["launches"] = a.get("launches", 0)
        c["kernel_us"] = a.get("kernel_us", 0.0)
        c["kernels"] = a.get("kernels", {})
        c["floor_us"] = _floor_us(c, pr)
    launch_kind = "kernels" if gpu else "cpu aten ops (no GPU: a smoke count)"
    if profile:
        log(f"launches per step: {sum(c['launches'] for c in comp)} {launch_kind}")
    else:
        launch_kind = "not counted (profile=False)"

    # per component
    if components:
        for c in comp:
            i = step.ids.index(c["layer"])
            sets = [(step.comps[j][c["name"]][0],) for j in _sets_for(step, i, c["bytes"], device)]
            t = _bench(lambda f: f(), sets, device=device, bytes_per_call=c["bytes"], reps=reps, warmup=warmup,
                       min_calls=20)
            c["median_us"] = t.median_us
            fl = roofline.floor_from_probes(c["bytes"], c["flops"], pr, c["floor_bw"])
            top = sorted(c["kernels"].items(), key=lambda kv: -kv[1])[:MAX_KERNELS_A_ROW]
            kl = [{"name": k[:90], "count": v, "device": "cuda"} for k, v in top] if gpu else []
            row = Row.from_timing(f"L{c['layer']:02d}.{c['kind']}.{c['name']}", label, t, floor=fl, kernels=kl,
                                  layer=c["layer"], kind_attn=c["kind"], mlp=c["mlp"], part=c["part"],
                                  bytes_from=c["bytes_from"],
                                  component=c["name"], ran=c["backend"], input_sets_layers=len(sets),
                                  kernel_names=len(c["kernels"]), **_ran_record(step.layers[i], c["name"]))
            row.launches = c["launches"]
            b.add(row)
    # per layer
    layer_rows = []
    for i, L in enumerate(step.layers):
        recs = [c for c in comp if c["layer"] == L.index]
        nb = sum(c["bytes"] for c in recs)
        sets = [(j,) for j in _sets_for(step, i, nb, device)]
        t = _bench(step.run_layer, sets, device=device, bytes_per_call=nb, reps=reps, warmup=warmup, min_calls=10)
        row = Row.from_timing(f"L{L.index:02d}.{L.kind}", label, t, layer=L.index, kind_attn=L.kind,
                              mlp=L.w.mlp_kind, input_sets_layers=len(sets),
                              component_sum_us=sum(c.get("median_us", 0.0) for c in recs) if components else None)
        row.floor_us = sum(c["floor_us"] for c in recs)
        row.bytes = nb
        row.launches = sum(c["launches"] for c in recs)
        b.add(row)
        layer_rows.append(row)
        log(f"layer {L.index:2d} {L.kind}+{L.w.mlp_kind:5s} {t.median_us:10.1f} us  floor {row.floor_us:9.1f} us  "
            f"launches {row.launches}")
    # the whole step: one graph
    t = time_step(step, reps=reps, warmup=warmup)
    captured = t.kind == "gpu-graph"
    whole = Row.from_timing("step", label, t)
    whole.floor_us = sum(c["floor_us"] for c in comp)
    whole.bytes = sum(c["bytes"] for c in comp)
    whole.launches = sum(c["launches"] for c in comp)
    lsum = sum(r.median_us for r in layer_rows)
    ratio = lsum / t.median_us if t.median_us > 0 else float("inf")
    whole.extra.update(layer_sum_us=lsum, layer_sum_ratio=ratio, layer_sum_ok=abs(ratio - 1) <= SUM_TOL,
                       capture=("one CUDA graph" if captured else (t.note or "not on a GPU")),
                       launches_per_layer=whole.launches / len(step.layers), memory=mem, backends=step.backends)
    if gpu:
        mem["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        mem["reserved_gb"] = torch.cuda.memory_reserved(device) / 1e9
    b.add(whole)
    log(f"step {t.median_us:.1f} us ({t.kind}), floor {whole.floor_us:.1f} us; per-layer sum {lsum:.1f} us "
        f"(x{ratio:.2f} of the whole); memory {json.dumps({k: round(v, 3) for k, v in mem.items()})}")
    if not captured and gpu:
        b.notes.append(f"the fused step was not captured in one CUDA graph: {t.note}")

    est = estimate_93(comp, layer_rows, view, allreduce_us=allreduce_us, step_us=t.median_us,
                      allreduce_label=allreduce_label)
    er = Row(name="estimate:93_layers", backend=label, kind=t.kind, median_us=est["step_us"], p10_us=est["step_us"],
             p90_us=est["step_us"], floor_us=est["floor_us"], bytes=est["bytes"], extra=est)
    b.add(er)
    log(f"93-layer estimate: {est['step_us'] / 1e3:.3f} ms a step ({est['allreduce_label']} all-reduce "
        f"{est['allreduce_us_total'] / 1e3:.3f} ms), {est['tokens_per_s']:.1f} tok/s "
        f"({est['tokens_per_s_per_gpu']:.1f} per GPU); byte floor {est['floor_us'] / 1e3:.3f} ms "
        f"({est['floor_tokens_per_s']:.1f} tok/s)")
    b.config["step"] = {"layers": step.ids, "block": step.block, "n_experts": step.n_experts,
                        "expert_dtype": view.expert_dtype, "kda_layers": sum(L.kind == "kda" for L in step.layers),
                        "mla_layers": sum(L.kind == "mla" for L in step.layers), "why": step.why,
                        "launch_count": launch_kind, "memory": mem, "kind": kind,
                        "requested": step.requested.to_dict()["backend"],
                        "prefetch": dict(on=step.switches.prefetch, fraction_of_l2=PREFETCH_FRACTION,
                                         budget_bytes=prefetch_budget(step.device),
                                         l2_bytes_assumed=prefetch_budget(step.device) / PREFETCH_FRACTION)}
    b.notes.append("all-reduce: none (tp 1)" if view.tp == 1 else
                   f"all-reduce: {ALLREDUCES_PER_LAYER} a layer at {allreduce_us} us each, "
                   + ("ASSUMED (one GPU here)" if allreduce_label == "assumed" else allreduce_label))
    b.notes.append(f"{step.n_experts} of {view.cfg.n_routed_experts} routed experts built per MoE layer "
                   f"({view.expert_dtype})")
    save()
    # each switch toggled alone
    if toggles:
        from k3lab.components.kda import default_checkpoint
        T = view.tokens_per_seq  # kda_checkpoint changes the step only where it verifies and "auto" is not 1 there
        todo = toggle_list(step.requested, base_switches, verify=T > 1 and (
            step.requested.kda_checkpoint != "auto" or default_checkpoint(view.batch, T) != 1))
        if only is not None:
            missing = sorted(only - {tl.split("=")[0] for tl, _ in todo})
            if missing:
                b.notes.append(f"toggles asked for but not applicable to this step: {missing} (toggle_list)")
            todo = [(tl, sw) for tl, sw in todo if tl.split("=")[0] in only]
        for tlabel, sw in todo:
            try:
                step.set_switches(sw)
                tt = time_step(step, reps=compare_reps, warmup=2)
            except Exception as e:  # noqa: BLE001
                b.notes.append(f"toggle {tlabel}: not run: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                log(f"toggle {tlabel}: not run ({type(e).__name__})")
                continue
            r = Row.from_timing(f"toggle:{tlabel}", label, tt, base_us=t.median_us,
                                delta_us=tt.median_us - t.median_us, switches=sw.to_dict(),
                                **untimed_exchange(tlabel, step))
            b.add(r)
            ex = r.extra.get("assumed_exchange_us")
            log(f"toggle {tlabel:40s} {tt.median_us:10.1f} us ({tt.median_us - t.median_us:+.1f})"
                + (f"; {ex:+.1f} us of untimed exchange (assumed)" if ex is not None else ""))
            save()
        skipped = sorted(NOT_WIRED)
        b.notes.append(f"switches not toggled (declared, not wired yet): {skipped}")
    step.set_switches(step.requested)

    # comparison: the same step on the reference and on torch.compile of it
    for be in compare:
        try:
            step.set_switches(on_one_backend(step.requested, be))
            for _ in range(COMPILE_WARM_STEPS if be == "torch_compile" else 0):
                step.run()  # compiles (and any recompiles) before the timer's own warm-up
            # eager: the reference expert loop reads the routing on the host, so a capture always fails; at batch 64
            # torch.compile then failed with inductor's "Offset increment outside graph capture encountered
            # unexpectedly" (eighth session), most likely a recompile (new expert token counts) begun inside the
            # failed capture. Not yet confirmed on a GPU.
            tc = time_step(step, reps=compare_reps, warmup=2, graph=False)
        except Exception as e:  # noqa: BLE001 - recorded; the other comparisons go on
            b.backends_skipped[be] = _why_failed(e)
            log(f"compare {be}: skipped: {b.backends_skipped[be]}")
            continue
        r = Row.from_timing("step", be, tc)
        r.floor_us, r.bytes = whole.floor_us, whole.bytes
        r.extra["speedup_of_fused"] = tc.median_us / t.median_us if t.median_us else None
        b.add(r)
        b.backends_ran[be] = f"every component on {be}" + (" (kda_pdl off: a CuTe launch mode)"
                                                           if step.requested.kda_pdl else "")
        log(f"step on {be:14s} {tc.median_us:10.1f} us ({tc.kind}); the fused step is "
            f"x{tc.median_us / t.median_us:.2f} faster")
        save()
    step.set_switches(step.requested)
    return StepResult(b, comp, att, est, str(trace_path) if (trace_path and profile) else None)


TOGGLE_NAMES = tuple(c for c in COMPONENTS if c != "dense") + (
    "pad_heads", "kda_tile_v", "mla_partitions", "prefetch", "fuse_prologues", "split_router", "owned_output",
    "shared_expert_stream", "kda_pdl", "pdl", "kda_checkpoint", "proj_cute", "moe_tile_n")  # what toggle_list can
# change (each label starts with one of them)


def untimed_exchange(tlabel: str, step: DecodeStep, each_us: float = ALLGATHER_ASSUMED_US) -> dict[str, Any]:
    """What a toggle leaves untimed on one GPU, for its row: split_router adds an all-gather a MoE layer (the ranks'
    router logits and latent shares) that one GPU cannot run, so the row carries that exchange at an ASSUMED latency
    (`assumed_exchange_us`, signed like the toggle: turning it on adds the exchange, off removes it; the toggles
    figure draws the change with it beside the timed one). {} for the other toggles (owned_output's coordinates ride
    the all-reduce the step already assumes)."""
    name, _, flip = tlabel.partition("=")
    if name != "split_router":
        return {}
    n = sum(L.w.mlp_kind == "moe" for L in step.layers)
    sign = 1 if flip.endswith("True") else -1
    return {"untimed": f"{n} all-gathers of the router logits and latent shares (one a MoE layer): not timed on one "
                       f"GPU, ASSUMED {each_us:g} us each", "assumed_exchange_us": sign * n * each_us}


def toggle_list(requested: Switches, resolved: Switches, *, verify: bool = False) -> list[tuple[str, Switches]]:
    """Each switch changed alone from the step's switches: every component on a non-reference backend put
    on the reference, and each wired knob moved to another allowed value (pad_heads 0 <-> 16, kda_tile_v
    128 <-> 16, mla_partitions auto <-> 1, prefetch, fuse_prologues, split_router, owned_output,
    shared_expert_stream, pdl and proj_cute when the projections run on triton, kda_pdl when the KDA runs on cute,
    moe_tile_n auto <-> 32 when the routed experts run on triton,
    kda_checkpoint auto <-> 1 on the verify path where it changes the checkpoint (`verify`)). kda_state_dtype
    needs a new build and the unwired switches are refused by Switches: neither is toggled."""
    out = []
    for comp in COMPONENTS:
        if comp == "dense":  # no component reads it (layer 0's dense MLP is a projection group)
            continue
        be = resolved.backend[comp]
        if be != "reference":
            out.append((f"{comp}={be}->reference", requested.replace(**{f"backend_{comp}": "reference"})))
    flips = {"pad_heads": {0: 16}, "kda_tile_v": {"auto": 16, 128: 16}, "mla_partitions": {"auto": 1}}
    if verify:
        flips["kda_checkpoint"] = {"auto": 1, 1: "auto"}
    if resolved.backend["moe"] == "triton":  # the one backend whose experts take a tile (k3lab.model refuses others)
        flips["moe_tile_n"] = {"auto": 32, 32: "auto"}
    if resolved.backend["proj"] == "triton" or requested.prefetch:
        flips["prefetch"] = {False: True, True: False}
        flips["fuse_prologues"] = {True: False, False: True}
        flips["split_router"] = {False: True, True: False}
        flips["owned_output"] = {False: True, True: False}
        flips["shared_expert_stream"] = {False: True, True: False}
        flips["pdl"] = {False: True, True: False}
        flips["proj_cute"] = {False: True, True: False}
    for k, m in flips.items():
        v = getattr(requested, k)
        nv = m.get(v, next(iter(m)) if v != next(iter(m)) else None)
        if nv is not None and nv in ALLOWED[k]:
            out.append((f"{k}={v}->{nv}", requested.replace(**{k: nv})))
    if resolved.backend["kda"] == "cute" or requested.kda_pdl:
        out.append((f"kda_pdl={requested.kda_pdl}->{not requested.kda_pdl}",
                    requested.replace(kda_pdl=not requested.kda_pdl)))
    return out


def estimate_93(comp: list[dict], layer_rows: list[Row], view: GpuView, *, allreduce_us: float = ALLREDUCE_ASSUMED_US,
                step_us: float | None = None, allreduce_label: str = "assumed") -> dict[str, Any]:
    """The full model's step from the measured layer types (see the module docstring); allreduce_label: "assumed"
    or where a measured all-reduce time came from (k3lab.studies.allreduce.measured)."""
    by_layer: dict[int, list[dict]] = {}
    for c in comp:
        by_layer.setdefault(c["layer"], []).append(c)
    parts: dict[str, list[tuple[float, float, int]]] = {k: [] for k in K3_COUNTS}
    for r in layer_rows:
        recs = by_layer[r.extra["layer"]]
        csum = sum(c.get("median_us", 0.0) for c in recs)
        for part, key in (("attn", r.extra["kind_attn"]), ("mlp", r.extra["mlp"])):
            pr = [c for c in recs if c["part"] == part]
            share = (sum(c.get("median_us", 0.0) for c in pr) / csum) if csum > 0 else (
                sum(c["floor_us"] for c in pr) / max(sum(c["floor_us"] for c in recs), 1e-12))
            parts[key].append((r.median_us * share, sum(c["floor_us"] for c in pr), sum(c["bytes"] for c in pr)))
    type_us, type_floor, type_bytes, missing = {}, {}, {}, []
    for k, v in parts.items():
        if not v:
            missing.append(k)
            continue
        type_us[k] = sum(x[0] for x in v) / len(v)
        type_floor[k] = sum(x[1] for x in v) / len(v)
        type_bytes[k] = sum(x[2] for x in v) / len(v)
    for k in missing:  # a type the step has none of (a tiny config's dense-only block): the nearest measured one
        alt = {"dense": "moe", "moe": "dense", "kda": "mla", "mla": "kda"}[k]
        type_us[k], type_floor[k] = type_us.get(alt, 0.0), type_floor.get(alt, 0.0)
        type_bytes[k] = type_bytes.get(alt, 0)
    n_layers = K3_COUNTS["kda"] + K3_COUNTS["mla"]
    n_ar = ALLREDUCES_PER_LAYER * n_layers if view.tp > 1 else 0
    compute = sum(K3_COUNTS[k] * type_us[k] for k in K3_COUNTS)
    floor = sum(K3_COUNTS[k] * type_floor[k] for k in K3_COUNTS)
    nbytes = int(sum(K3_COUNTS[k] * type_bytes[k] for k in K3_COUNTS))
    total = compute + n_ar * allreduce_us
    toks = view.batch * view.tokens_per_seq
    return {"step_us": total, "compute_us": compute, "floor_us": floor, "bytes": nbytes,
            "allreduce_us_total": n_ar * allreduce_us, "allreduces": n_ar, "allreduce_us_each": allreduce_us,
            "allreduce_label": allreduce_label, "type_us": type_us, "type_floor_us": type_floor,
            "counts": dict(K3_COUNTS),
            "missing_types": missing, "positions_per_step": toks,
            "tokens_per_s": toks / (total * 1e-6) if total > 0 else None,
            "tokens_per_s_per_gpu": toks / (total * 1e-6) / view.tp if total > 0 else None,
            "floor_tokens_per_s": toks / (floor * 1e-6) if floor > 0 else None,
            "x_floor": total / floor if floor > 0 else None, "block_step_us": step_us,
            "note": "tokens/s: the TP group's positions a second (with draft_depth > 0 every position verified, "
                    "not committed); per GPU: that over tp"}


def targets(bundle: Bundle) -> dict[str, Any]:
    """Issue 15's H200 targets read off a step bundle: the fused step within 1.3x of its byte floor, >= 1.5x
    faster than torch.compile of the reference, <= 10 launches a layer."""
    rows = {(r.name, r.backend): r for r in bundle.rows}
    f = rows.get(("step", "fused"))
    tc = rows.get(("step", "torch_compile"))
    out: dict[str, Any] = {}
    if f is not None:
        out["x_floor"] = f.distance
        out["x_floor_ok"] = f.distance is not None and f.distance <= 1.3
        out["launches_per_layer"] = f.extra.get("launches_per_layer")
        out["launches_ok"] = (out["launches_per_layer"] or 1e9) <= 10
    if f is not None and tc is not None:
        out["speedup_vs_compile"] = tc.median_us / f.median_us
        out["speedup_ok"] = out["speedup_vs_compile"] >= 1.5
    return out


# ---- numerics ------------------------------------------------------------------------------------------

def step_numerics(view: GpuView, switches: Switches | None = None, *, n_steps: int = 4, n_experts: int | None = None,
                  device=None, seed: int = 0) -> dict[str, Any]:
    """The step in bf16 on `device` against an fp64 reference build on the CPU (same seed: the same weights,
    states and inputs, both drawn on the CPU), over `n_steps` decode steps of fresh random inputs (verify path:
    every position committed after each step). Returns per layer the relative error of its output stream (and
    of the KDA state) after each step, and what ran.
    A router pick the bf16 step made differently from the oracle, where it is the top-k of the step's own input and
    weights scored in fp64 (k3lab.model.Layer.align_twin, the layer check's rule), is taken over by the oracle for
    the rest of that layer, so the errors measure arithmetic rather than which of two near-equal experts won;
    `aligned` lists each such pick (step, layer, what). A pick outside the rule is left as it is and shows as
    error."""
    if not isinstance(n_steps, int) or n_steps < 1:
        _fail("n_steps", f"must be an int >= 1, got {n_steps!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    test = DecodeStep(view, switches, n_experts=n_experts, device=device, seed=seed, gen_device="cpu",
                      ranks="all")  # split_router / owned_output: every rank's share, assembled
    oracle = DecodeStep(view, Switches(), n_experts=n_experts, device="cpu", dtype=torch.float64, seed=seed,
                        gen_device="cpu")
    gen = torch.Generator(device="cpu").manual_seed(seed + 4242)
    errs = [[] for _ in test.layers]
    state_errs = [[] for _ in test.layers]
    aligned: list[dict[str, Any]] = []
    for step in range(n_steps):
        x = torch.randn(tuple(test.x_in.shape), generator=gen, dtype=torch.float32)
        test.run(x.to(device=device, dtype=test.dtype))

        def align(i: int, comp: str, step: int = step) -> None:
            if comp == "router":  # the oracle's router has run; the test layer's picks are in its buffers
                got = test.layers[i].align_twin(oracle.layers[i], "router")
                if got is not None:
                    aligned.append(dict(step=step, layer=test.ids[i], note=got[1]))
        oracle.run(x.to(torch.float64), after=align)
        test.commit()
        oracle.commit()
        for i, (L, R) in enumerate(zip(test.layers, oracle.layers)):
            errs[i].append(error_stats(L.buf["x_out"], R.buf["x_out"]).rel_norm)
            if L.kind == "kda":
                state_errs[i].append(error_stats(L.state.state, R.state.state).rel_norm)
    return {"layers": test.ids, "kinds": [f"{L.kind}+{L.w.mlp_kind}" for L in test.layers], "n_steps": n_steps,
            "rel_err": errs, "state_rel_err": state_errs, "backends": test.backends, "device": str(device),
            "view": view.to_dict(), "aligned": aligned}


def numerics_rows(num: dict[str, Any], tol: float | None = None) -> list[Row]:
    """The numerics as bundle rows named "numerics:Lnn.kind" (no timing: kind cpu-smoke, 0 us), each with the
    error after the last step and every step's error in extra. ok = finite and <= NUMERICS_TOL."""
    tol = NUMERICS_TOL if tol is None else tol
    rows = []
    for lid, kind, e, se in zip(num["layers"], num["kinds"], num["rel_err"], num["state_rel_err"]):
        last = e[-1]
        err = {"rel_norm": last, "max_abs": None, "numel": None, "nonfinite": 0 if math.isfinite(last) else 1,
               "tol": tol, "ok": bool(math.isfinite(last) and last <= tol)}
        al = [f"step {a['step']}: {a['note']}" for a in num.get("aligned", ()) if a["layer"] == lid]
        if al:
            err["note"] = f"router near-ties aligned at {len(al)} step(s) (extra.aligned)"
        rows.append(Row(name=f"numerics:L{lid:02d}.{kind}", backend="fused", kind="cpu-smoke", median_us=0.0,
                        p10_us=0.0, p90_us=0.0, error=err,
                        extra={"rel_err_by_step": e, "state_rel_err_by_step": se, "layer": lid, "aligned": al,
                               "preset_view": num["view"], "device": num["device"], "not_a_timing": True}))
    return rows


# ---- nsight-python ------------------------------------------------------------------------------------

NSIGHT_METRICS = ("gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                  "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread")


def find_ncu() -> str | None:
    """The ncu executable: on the PATH, else the newest /opt/nvidia/nsight-compute/*/ncu, else CUDA's bin."""
    hit = shutil.which("ncu")
    if hit:
        return hit
    cands = sorted(Path("/opt/nvidia/nsight-compute").glob("*/ncu")) + [Path("/usr/local/cuda/bin/ncu")]
    return next((str(c) for c in reversed(cands) if c.exists()), None)


def nsight_status() -> tuple[bool, str]:
    """(available, why) for nsight-python metrics: a GPU, the nsight package, and ncu."""
    import importlib.util

    if not torch.cuda.is_available():
        return False, "no GPU: nsight-python metrics need an NVIDIA GPU and Nsight Compute (ncu)"
    if importlib.util.find_spec("nsight") is None:
        return False, "nsight-python is not installed (pip install nsight-python; on the H200: .gpu/base)"
    if find_ncu() is None:
        return False, ("ncu (Nsight Compute) was not found on the PATH nor under /opt/nvidia/nsight-compute: "
                       "nsight-python runs the profiled code under it")
    return True, f"nsight-python and ncu ({find_ncu()}) found"


def nsight_metrics(view: GpuView, switches: Switches, layer: int, *, n_experts: int | None = None,
                   launches: dict[str, int] | None = None, timeout_s: int = 150, workdir: str | Path | None = None
                   ) -> dict[str, Any]:
    """Nsight Compute metrics (duration, DRAM throughput % of peak, achieved occupancy, registers per thread)
    of layer `layer`'s components, through nsight-python in a subprocess running a two-line launcher script
    written to `workdir` (nsight-python re-runs the script it is called from under ncu, which a notebook
    kernel is not).
    nsight-python measures one kernel per annotation: components with one launch (`launches`, from the
    step's profile) are profiled; the others are listed with their launch counts. Returns
    {"ok", "message", "rows": [...]}, never raises for a missing tool."""
    n_layers = view.cfg.num_hidden_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise ValueError(f"nsight_metrics: 'layer' (the notebook's nsight_layer) must be a layer of the model, 0.."
                         f"{n_layers - 1} (or -1 in the notebook: none), got {layer!r}")
    ok, why = nsight_status()
    if not ok:
        return {"ok": False, "message": why, "rows": []}
    spec = {"view": view.to_dict(), "model": view.cfg.to_dict(), "switches": switches.to_dict(), "layer": layer,
            "n_experts": n_experts, "launches": launches or {}}
    wd = Path(workdir or tempfile.mkdtemp(prefix="k3nsight-"))
    wd.mkdir(parents=True, exist_ok=True)
    (wd / "spec.json").write_text(json.dumps(spec))
    (wd / "nsight_layer.py").write_text("import sys\nfrom k3lab.step import _nsight_main\n_nsight_main(sys.argv[1])\n")
    import os

    env = dict(os.environ)
    env["PATH"] = str(Path(find_ncu()).parent) + os.pathsep + env.get("PATH", "")
    try:
        p = subprocess.run([sys.executable, str(wd / "nsight_layer.py"), str(wd / "spec.json")],
                           capture_output=True, text=True, timeout=timeout_s, cwd=wd, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "message": f"nsight-python did not finish in {timeout_s} s", "rows": []}
    res = wd / "nsight.json"
    if p.returncode != 0 or not res.exists():
        tail = (p.stdout + p.stderr).strip().splitlines()[-6:]
        return {"ok": False, "message": "nsight-python failed: " + " | ".join(tail), "rows": []}
    return json.loads(res.read_text())


def _nsight_main(spec_path: str) -> None:
    """Run by the launcher `nsight_layer.py SPEC` (and again by nsight-python under ncu)."""
    import nsight

    from k3lab.config import GpuView, K3Config
    from k3lab.model import build_layer

    spec = json.loads(Path(spec_path).read_text())
    v = dict(spec["view"])
    v.pop("heads", None)
    view = GpuView(K3Config(**{**spec["model"], "mla_layers": (tuple(spec["model"]["mla_layers"])
                                                                if spec["model"]["mla_layers"] else None)}), **v)
    sw = Switches.from_dict(spec["switches"])
    lid = int(spec["layer"])
    L = build_layer(view, view.cfg.layer_kind(lid), 0, spec["n_experts"], device="cuda", layer_index=lid,
                    switches=Switches(**{**sw.to_dict(), "backend": {c: "reference" for c in COMPONENTS}}),
                    gen_device="cuda")
    res, _ = resolve_switches(sw, [L], "cuda")
    over = {g: res.backend[g] for g in OVERRIDE_OPS
            if res.backend[g] not in LAYER_PATHS and (g == "proj" or not _group_accepts([L], g, res.backend[g], res))
            and _override_ok(g, res.backend[g], L.B * L.T)[0]}
    L.switches = res.replace(backend={**res.backend, **{g: "reference" for g in over}})
    comps = _fused_parts(L, over, L.components(), prologues=res.fuse_prologues, split_router=res.split_router,
                         owned_output=res.owned_output, shared_stream=res.shared_expert_stream,
                         proj_cute=res.proj_cute and over.get("proj") == "triton")  # the same components as the step's
    launches = spec.get("launches") or {}
    single = [n for n in comps if launches.get(f"L{lid:02d}.{L.kind}.{n}", 0) == 1]
    for _, (fn, _, _) in comps.items():  # warm: compiles and autotunes outside ncu's view
        fn()
    torch.cuda.synchronize()

    @nsight.analyze.kernel(metrics=list(NSIGHT_METRICS), runs=1, output="quiet", thermal_mode="off")
    def profile_layer():
        for n, (fn, _, _) in comps.items():
            if n in single:
                with nsight.annotate(n):
                    fn()
            else:
                fn()

    rows = []
    if single:
        df = profile_layer().to_dataframe()
        for rec in df.to_dict("records"):
            rows.append({str(k): (v if isinstance(v, (int, float, str)) or v is None else str(v))
                         for k, v in rec.items()})
    others = {n: launches.get(f"L{lid:02d}.{L.kind}.{n}", 0) for n in comps if n not in single}
    out = {"ok": True, "rows": rows, "layer": lid, "profiled": single, "not_profiled_launches": others,
           "message": (f"{len(single)} single-kernel components profiled; components with several launches are "
                       f"not (nsight-python measures one kernel per annotation): {others}")}
    Path(spec_path).with_name("nsight.json").write_text(json.dumps(out, default=str))


