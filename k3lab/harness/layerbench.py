"""Per-component timing of one decode layer, per backend: what notebooks/01_decode_layer runs.

For each requested backend that can run here (`k3lab.switches.backend_status`) and each layer kind,
`k3lab.model.build_layer(view, kind, seed, ...)` builds the layer; every component of
`.components()` (name -> (callable, bytes_moved, flops)) is
  1. checked once against an fp64 CPU build of the same layer (same seed, components called in
     order on fresh layers, every output compared: k3lab.harness.checker.check_twin),
  2. timed: CUDA-graph replay with rotated layer copies on a GPU, `cpu-smoke` wall clock otherwise,
  3. placed against its floor (bytes over the measured read bandwidth for weight and cache reads, over the
     copy bandwidth for the KDA core whose state is read and written, or the launch floor).
What ran and why anything did not is recorded in the bundle.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence

import torch

from k3lab.harness import checker, roofline, timing
from k3lab.harness.bundle import Bundle, Row
from k3lab.switches import Switches, backend_status

DEFAULT_TOL = {"reference": 2e-2, "torch_compile": 2e-2, "triton": 2e-2, "cute": 2e-2, "aiter": 2e-2}


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:300] if s else ''}"


def parse_backends(backends: str | Sequence[str]) -> list[str]:
    if isinstance(backends, str):
        backends = [b.strip() for b in backends.split(",")]
    return [b for b in backends if b]


def bundle_name(preset: str, view) -> str:
    """The layer notebook's bundle name: preset, batch and context, then every view setting away from its default
    (draft depth, fp8 cache, DCP, expert format), so two different layer configurations never share a name (sweeps
    and `k3lab compare` match baselines by name)."""
    name = f"decode_layer-{preset}-b{view.batch}-c{view.context}"
    if view.draft_depth:
        name += f"-d{view.draft_depth}"
    if view.kv_dtype != "bf16":
        name += f"-kv{view.kv_dtype}"
    if view.dcp != 1:
        name += f"-dcp{view.dcp}"
    if view.expert_dtype != "bf16":
        name += f"-{view.expert_dtype}"
    return name


def bench_layers(view, *, kinds: Sequence[str] = ("kda", "mla"), backends: str | Sequence[str] = "reference",
                 switches: Switches | None = None, seed: int = 0, reps: int = 20, warmup: int = 3,
                 name: str | None = None, device: str | None = None, kernels: bool = True,
                 tol: dict[str, float] | None = None, n_experts: int | str | None = "auto",
                 log: Callable[[str], None] = print) -> Bundle:
    """n_experts: routed experts built per MoE layer (see k3lab.model.build_layer; "auto" keeps a
    layer's expert pool under 2 GiB as stored: at TP8 all 896 in MXFP4 (`view.expert_dtype`), 64 in bf16 / fp8).
    The count built is recorded in the notes: with fewer than the model's experts the router moves fewer bytes
    than the real one. On a GPU a pool of more than AUTO_EXPERTS experts is drawn on the GPU (the reference twin's
    too, so both hold the same values; drawing 896 experts on the CPU takes minutes), and the notes say so."""
    switches = switches or Switches()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.startswith("cuda")
    from k3lab.config import ConfigError
    from k3lab.model import AUTO_EXPERTS, auto_n_experts, build_layer
    lo, hi = view.cfg.num_experts_per_tok, view.cfg.n_routed_experts
    if n_experts not in ("auto", None) and (isinstance(n_experts, bool) or not isinstance(n_experts, int)
                                            or not lo <= n_experts <= hi):
        raise ConfigError(f"n_experts must be 'auto', None (the whole pool) or an int in {lo}..{hi} (top-k .. the "
                          f"pool), got {n_experts!r}")
    for arg, v, least in (("reps", reps, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ConfigError(f"{arg} must be an int >= {least}, got {v!r}")
    tol = {**DEFAULT_TOL, **(tol or {})}
    n_built = auto_n_experts(view) if n_experts == "auto" else (n_experts or view.cfg.n_routed_experts)
    gen = "cuda" if on_gpu and n_built > AUTO_EXPERTS else "cpu"
    name = name or f"decode_layer-b{view.batch}-c{view.context}-tp{view.tp}"
    b = Bundle.new(name, view=view, switches=switches)
    b.notes.append("layers from k3lab.model")
    pr = timing.probes(device)
    b.copy_tbps, b.read_tbps, b.launch_floor_us = pr["copy_tbps"], pr["read_tbps"], pr["launch_us"]
    kind_label = "gpu-graph" if on_gpu else "cpu-smoke"
    log(f"{'GPU' if on_gpu else 'CPU (smoke timing only)'}: copy {b.copy_tbps:.3f} TB/s, read {b.read_tbps:.3f} "
        f"TB/s, launch floor {b.launch_floor_us:.2f} us")
    if not on_gpu:
        b.notes.append("CPU run: times are cpu-smoke wall clock, floors use a host memcpy; not GPU figures")
    if gen != "cpu":
        b.notes.append(f"weights drawn on {gen} ({n_built} routed experts a MoE layer, {view.expert_dtype}): the same "
                       f"values for the layer and its fp64 twin, not those a CPU run draws")

    for be in parse_backends(backends):
        ok, why = backend_status(be)
        if not ok:
            b.backends_skipped[be] = why
            log(f"skip {be}: {why}")
            continue
        ran_any = False
        for kind in kinds:
            try:
                ref_layer = build_layer(view, kind, seed, backend="reference", device="cpu",
                                        dtype=torch.float64, switches=switches, n_experts=n_experts, gen_device=gen)
                test_layer = build_layer(view, kind, seed, backend=be, device=device, switches=switches,
                                         n_experts=n_experts, gen_device=gen)
                note = (f"{kind}: {getattr(test_layer, 'n_experts', '?')} of {view.cfg.n_routed_experts} routed "
                        f"experts built")
                if note not in b.notes:
                    b.notes.append(note)
                comps = test_layer.components()
                ref_comps = ref_layer.components()
                errs = {cname: checker.check_twin(test_layer, ref_layer, fn, ref_comps[cname][0], tol.get(be),
                                                  name=cname)
                        for cname, (fn, _, _) in comps.items()}
                for cname, st in errs.items():
                    if st.note:
                        b.notes.append(f"{be} {kind}.{cname}: {st.note}")
                        log(f"{kind:4s} {be:14s} {cname:16s} {st.note}")
            except Exception as e:  # noqa: BLE001 - recorded, the other backends go on
                b.backends_skipped[f"{be}:{kind}"] = _first_line(e)
                log(f"skip {be} {kind}: {_first_line(e)}")
                b.notes.append(f"{be} {kind} failed: {traceback.format_exc(limit=3)[-600:]}")
                continue
            ran_any = True
            for cname, why_not in (getattr(test_layer, "skipped", None) or {}).items():
                b.notes.append(f"{be} {kind}: {cname} not timed: {why_not}")
            # rotation: extra copies of the layer so weights are not served from L2
            sets = [test_layer]
            if on_gpu:
                layer_bytes = sum(v[1] for v in comps.values())
                n = timing.rotation_count(layer_bytes, timing.l2_bytes(), max_sets=8)
                if switches.kda_pdl:
                    # a PDL launch may read its state while the previous call still writes it: never
                    # replay one layer copy back to back (k3lab_kernels.cute.kda_decode, pdl)
                    n = max(n, 2)
                sets += [build_layer(view, kind, seed + 1000 * i, backend=be, device=device, switches=switches,
                                     n_experts=n_experts, gen_device=gen) for i in range(1, n)]
            set_comps = [s.components() if s is not test_layer else comps for s in sets]
            for cname, (fn, nbytes, flops) in comps.items():
                fns = [(sc[cname][0],) for sc in set_comps]
                if on_gpu:
                    t = timing.bench_gpu(lambda f: f(), input_sets=fns, warmup=warmup, reps=reps,
                                         bytes_per_call=nbytes)
                else:
                    t = timing.bench_cpu(fn, warmup=min(warmup, 2), reps=reps, bytes_per_call=nbytes)
                kl = timing.kernel_list(fn, calls=2) if (kernels and on_gpu) else []
                fl = roofline.floor_from_probes(nbytes, flops, pr, test_layer.floor_bw(cname))
                ran = getattr(test_layer, "ran", {}).get(cname, be)
                rname = cname if cname.startswith(kind + ".") else f"{kind}.{cname}"
                row = Row.from_timing(rname, be, t, floor=fl, kernels=kl, error=errs[cname], layer=kind, ran=ran)
                b.add(row)
                log(f"{kind:4s} {be:14s} {cname:16s} {t.median_us:10.2f} us  floor {fl.floor_us:8.2f} us  "
                    f"rel err {errs[cname].rel_norm:.2e}{'' if errs[cname].ok else '  FAILED'}")
        if ran_any:
            b.backends_ran[be] = why if kind_label == "gpu-graph" else f"{why} (cpu-smoke)"
    return b
