"""KDA in the registry: decode (T = 1), verify (T = 2..8, the state after every `checkpoint`-th position and
the last), commit (a verify's accepted prefix into the state: a slot copy or a replay) and chunked prefill. The
maths is k3lab.ref.kda; the API k3lab.components.kda; the kernels are named below.

Bytes (the one formula; fp32 state 4 bytes or bf16 2, bf16 activations, conv kernel W = 4):
    state   B*H*D*D*s read + written (verify: read once, ceil(T / checkpoint) states written to the history;
            prefill: read and written once; commit: one state read and written)
    inputs  B*T*(3HD + HD + H + HD)*2 read (qkv, f, b, gate);  out  B*T*HD*2 written
    conv    B*3HD*(W-1)*2 read + written (verify: T windows written to the history)
    params  3HD*W*2 + HD*4 + H*4 + D*2
    commit  the state B*H*D*D*s read (a slot, or the start state) + written, the conv window read + written, and
            on a partial accept the replayed positions' qkv, f, b (B*r*(3HD + HD + H)*2; r = n mod c)
The state dominates and is read and written: the floor uses the copy bandwidth.

Tolerances (relative norm against fp64):
    out         1e-2: a bf16 output is one rounding (2^-9 relative per element) of fp32 maths
    state       fp32 1e-4: fp32 rounding over D-term sums and the T-step chain; bf16 2e-2: one bf16
                rounding of the state each step
    conv state  bit-exact: the window only shifts bf16 values
    prefill with the bf16-rounded inverse is compared with the fp64 chunked form that rounds the same
    inverse (the switch's own loss is not the kernel's error)
"""
from __future__ import annotations

import torch

from k3lab.ref import kda as ref
from k3lab import registry
from k3lab.registry import Case, Op, Peer, register

HEADS = (6, 12)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
TILES_TRITON = (4, 8, 16, 32, 64, 128)
TILES_CUTE = (16, 32, 64, 128)  # the CuTe kernels split a head over a cluster of 8, 4, 2 or 1 CTAs
OUT_TOL = 1e-2
STATE_TOL = {"fp32": 1e-4, "bf16": 2e-2}
WHY = ("out 1e-2: one bf16 rounding of fp32 maths; state fp32 1e-4: fp32 sums of D terms over T steps; "
       "state bf16 2e-2: one bf16 rounding a step; conv window bit-exact (shifted bf16 values)")


def _sd(case: Case) -> torch.dtype:
    return torch.float32 if case.get("state_dtype", "fp32") == "fp32" else torch.bfloat16


def kda_bytes(B: int, H: int, T: int = 1, *, D: int = 128, W: int = 4, state_bytes: int = 4, hist: bool = True,
              prefill: bool = False, checkpoint: int = 1) -> int:
    """Bytes one KDA call must move (module docstring). T = 1 decode, T > 1 verify (hist: ceil(T / checkpoint)
    states written), prefill: T positions, the state read and written once."""
    HD = H * D
    st = B * H * D * D * state_bytes
    if T == 1 or prefill:
        state = 2 * st
    else:
        state = st * (1 + (-(-T // checkpoint) if hist else 1))
    io = B * T * (3 * HD + HD + H + HD) * 2 + B * T * HD * 2
    win = B * 3 * HD * (W - 1) * 2
    conv = 2 * win if (T == 1 or prefill) else win * (1 + (T if hist else 0))
    params = 3 * HD * W * 2 + HD * 4 + H * 4 + D * 2
    return state + io + conv + params


def kda_flops(B: int, H: int, T: int = 1, D: int = 128) -> int:
    """Per position and head: decay D*D, k^T S 2*D*D, rank-1 update 2*D*D, S^T q 2*D*D."""
    return B * T * H * 7 * D * D


def commit_bytes(B: int, H: int, replayed: int = 0, *, D: int = 128, W: int = 4, state_bytes: int = 4) -> int:
    """Bytes a commit must move: the state read (a slot or the start state) and written, the conv window read
    and written, and the inputs of the `replayed` positions summed over the batch (qkv, f, b)."""
    HD = H * D
    return 2 * B * H * D * D * state_bytes + 2 * B * 3 * HD * (W - 1) * 2 + replayed * (3 * HD + HD + H) * 2


def _commit_counts(c: Case) -> list[int]:
    """num_accepted of every sequence of a commit case (`accepted`: an int n for every sequence, or "each":
    sequence b accepts 1 + b mod T, so a batch of T covers every n)."""
    B, T, a = c["batch"], c["T"], c["accepted"]
    return [1 + bb % T for bb in range(B)] if a == "each" else [int(a)] * B


def _case_bytes(c: Case) -> int:
    sb = 4 if c.get("state_dtype", "fp32") == "fp32" else 2
    if c.op == "kda_commit":
        ck = c["checkpoint"]
        rep = sum(ref.replay_plan(n, c["T"], ck)[2] for n in _commit_counts(c))
        return commit_bytes(c["batch"], c["heads"], rep, D=c.get("D", 128), state_bytes=sb)
    T = c.get("T", 1) if c.op != "kda_prefill" else c["L"]
    return kda_bytes(c["batch"], c["heads"], T, D=c.get("D", 128), state_bytes=sb, prefill=c.op == "kda_prefill",
                     checkpoint=c.get("checkpoint", 1))


def _case_flops(c: Case) -> int:
    if c.op == "kda_commit":
        return sum(kda_flops(1, c["heads"], ref.replay_plan(n, c["T"], c["checkpoint"])[2], c.get("D", 128))
                   for n in _commit_counts(c))
    T = c.get("T", 1) if c.op != "kda_prefill" else c["L"]
    return kda_flops(c["batch"], c["heads"], T, c.get("D", 128))


# ---- inputs and references ------------------------------------------------------------------------------

def _make(case: Case, seed: int, device: str, T: int | None) -> dict:
    B, H, D = case["batch"], case["heads"], case.get("D", 128)
    inp, p, S, cs = ref.make_kda_inputs(B, H, D, T=T, seed=seed, device=device)
    d = dict(inp, params=p, state=S.to(_sd(case)), conv_state=cs)
    lead = (B,) if T is None else (B, T)
    d["out"] = torch.empty(*lead, H * D, dtype=torch.bfloat16, device=device)
    return d


def _args(d: dict, dtype=None) -> list:
    xs = [d[k] for k in ("qkv", "f", "b", "gate")]
    return [x.to(dtype) for x in xs] if dtype is not None else xs


def make_decode(case: Case, seed: int, device: str) -> dict:
    return _make(case, seed, device, None)


def make_verify(case: Case, seed: int, device: str) -> dict:
    B, T, H, D = case["batch"], case["T"], case["heads"], case.get("D", 128)
    d = _make(case, seed, device, T)
    ns = -(-T // case.get("checkpoint", 1))
    d["state_hist"] = torch.empty(B, ns, H, D, D, dtype=_sd(case), device=device)
    d["conv_hist"] = torch.empty(B, T, *d["conv_state"].shape[1:], dtype=torch.bfloat16, device=device)
    if case.get("ragged", False):
        g = torch.Generator().manual_seed(seed + 17)
        n = torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int32)
        n[0] = T  # one full-length sequence, and (B > 1) the shortest possible
        if B > 1:
            n[-1] = 1
        d["lengths"] = n.to(device)
    return d


def make_prefill(case: Case, seed: int, device: str) -> dict:
    return _make(case, seed, device, case["L"])


def ref_decode(d: dict, case: Case) -> dict:
    f64 = torch.float64
    o, S, cs = ref.kda_decode(*_args(d, f64), d["params"].to(f64), d["state"].to(f64), d["conv_state"].to(f64),
                              dtype=f64, out_dtype=f64)
    return dict(out=o, state=S, conv_state=cs)


def ref_verify(d: dict, case: Case) -> dict:
    """The fp64 verify; state_hist holds the checkpoint slots (ref.checkpoint_positions). Ragged: positions >=
    lengths[b], and the slots whose position is >= lengths[b], must be left untouched (NaN)."""
    f64 = torch.float64
    ck, T = case.get("checkpoint", 1), d["qkv"].shape[1]
    o, Sh, ch = ref.kda_verify(*_args(d, f64), d["params"].to(f64), d["state"].to(f64), d["conv_state"].to(f64),
                               dtype=f64, out_dtype=f64, checkpoint=ck)
    if "lengths" in d:
        n = d["lengths"].to("cpu", torch.long)
        for b in range(o.shape[0]):
            o[b, n[b]:] = float("nan")
            Sh[b, ref.slots_written(int(n[b]), T, ck):] = float("nan")
            ch[b, n[b]:] = float("nan")
    return dict(out=o, state_hist=Sh, conv_hist=ch)


def make_commit(case: Case, seed: int, device: str) -> dict:
    """A verify's inputs and the start state, the verify's outputs at `checkpoint` (state_hist: the fp64 states
    rounded to the state dtype, as a verify leaves them; conv_hist exact) and num_accepted (_commit_counts)."""
    T = case["T"]
    d = _make(case, seed, device, T)
    f64 = torch.float64
    _, Sh, ch = ref.kda_verify(*_args(d, f64), d["params"].to(f64), d["state"].to(f64), d["conv_state"].to(f64),
                               dtype=f64, out_dtype=f64, checkpoint=case["checkpoint"])
    d["state_hist"] = Sh.to(_sd(case)).contiguous()
    d["conv_hist"] = ch.to(torch.bfloat16).contiguous()
    d["num_accepted"] = torch.tensor(_commit_counts(case), dtype=torch.int32, device=device)
    del d["out"]
    return d


def ref_commit(d: dict, case: Case) -> dict:
    """The fp64 state and conv window after each sequence's last accepted position, from the start state over
    every position (not from the slots): the commit's error includes the slot's own rounding."""
    f64 = torch.float64
    _, Sh, ch = ref.kda_verify(*_args(d, f64), d["params"].to(f64), d["state"].to(f64), d["conv_state"].to(f64),
                               dtype=f64, out_dtype=f64)
    idx = torch.arange(Sh.shape[0], device=Sh.device)
    p = d["num_accepted"].to(Sh.device, torch.long) - 1
    return dict(state=Sh[idx, p], conv_state=ch[idx, p])


def ref_prefill(d: dict, case: Case) -> dict:
    """fp32 inverse: the exact recurrence (the decode step L times). bf16 inverse: the fp64 chunked form
    with the same bf16-rounded inverse (the switch's own loss is not the kernel's error)."""
    f64 = torch.float64
    p64, S, c = d["params"].to(f64), d["state"].to(f64), d["conv_state"].to(f64)
    if case["inverse"] == "bf16":
        o, S, c = ref.kda_prefill_chunked(*_args(d, f64), p64, S, c, chunk=case["chunk"], dtype=f64,
                                          inverse_dtype=torch.bfloat16, grouped=case["grouped"])
        return dict(out=o, state=S, conv_state=c)
    outs = []
    for t in range(d["qkv"].shape[1]):
        o, S, c = ref.kda_decode(*(x[:, t] for x in _args(d, f64)), p64, S, c, dtype=f64, out_dtype=f64)
        outs.append(o)
    return dict(out=torch.stack(outs, 1), state=S, conv_state=c)


def tolerances(case: Case) -> dict[str, float]:
    st = STATE_TOL[case.get("state_dtype", "fp32")]
    return dict(out=OUT_TOL, state=st, state_hist=st, conv_state=0.0, conv_hist=0.0)


# ---- calls through the component API ------------------------------------------------------------------

def call_decode(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import kda

    return kda.decode(*_args(d), d["params"], d["state"], d["conv_state"], d["out"], backend=backend, ran=ran,
                      **opts)


def call_verify(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import kda

    return kda.verify(*_args(d), d["params"], d["state"], d["conv_state"], d["out"], state_hist=d["state_hist"],
                      conv_hist=d["conv_hist"], lengths=d.get("lengths"), checkpoint=case.get("checkpoint", 1),
                      backend=backend, ran=ran, check_values=False, **opts)


def call_commit(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import kda

    return kda.commit(d["state_hist"], d["conv_hist"], d["num_accepted"], d["state"], d["conv_state"],
                      checkpoint=case["checkpoint"], qkv=d["qkv"], f=d["f"], b=d["b"], params=d["params"],
                      backend=backend, ran=ran, check_values=False, **opts)


def call_prefill(d: dict, case: Case, backend: str, opts: dict, ran: list | None = None):
    from k3lab.components import kda

    return kda.prefill(*_args(d), d["params"], d["state"], d["conv_state"], d["out"], chunk=case["chunk"],
                       inverse=case["inverse"], grouped=case["grouped"], backend=backend, ran=ran, **opts)


# ---- peers ----------------------------------------------------------------------------------------------

def fla_peers(case: Case) -> list[Peer]:
    """fla's recurrence alone (T >= 1) and its served decode path (T = 1), on the same inputs."""
    from k3lab.bench import peers

    ok, _ = peers.fla_available()
    if not ok or case.get("state_dtype", "fp32") != "fp32" or case.get("ragged", False):
        return []
    B, H, D, T = case["batch"], case["heads"], case.get("D", 128), case.get("T", 1)

    def make_rec(s):
        x = s["qkv"].view(B, T, 3, H, D)
        q, k, v = (torch.nn.functional.silu(x[:, :, i].float()).to(torch.bfloat16).contiguous() for i in range(3))
        fg, bb = s["f"].view(B, T, H, D), s["b"].view(B, T, H)
        o = torch.empty(B, T, H, D, dtype=torch.bfloat16, device=q.device)
        return lambda: peers.fla_recurrence(q, k, v, fg, bb, s["params"].A_log, s["params"].dt_bias, s["state"], o)

    out = [Peer("fla_recurrence", make_rec, note="recurrence only (no conv, no output norm); final state only")]
    if T == 1:
        def make_path(s):
            path = peers.FlaDecodePath(s["params"], s["state"], s["conv_state"], B)
            a = _args(s)
            return lambda: path(*a)
        out.append(Peer("fla_path", make_path, note="fla conv x3 + fused_recurrent_kda + gated rmsnorm"))
    return out


def copy_peer(case: Case) -> list[Peer]:
    """torch's copy of the case's bytes (half read, half written) in the same rotated graph: what a plain
    copy of this size reaches. Decode, fp32 state only."""
    if case.get("T", 1) != 1 or case.get("state_dtype", "fp32") != "fp32" or not torch.cuda.is_available():
        return []
    n = _case_bytes(case) // 2

    def make(s):
        src = torch.empty(n, dtype=torch.uint8, device=s["state"].device).fill_(1)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    return [Peer("torch_copy", make, note="copy of the same bytes, half read and half written")]


def flashinfer_peer(case: Case) -> list[Peer]:
    """FlashInfer's fused KDA decode (one launch, same work as ours), layouts converted outside the timed
    region; checked against the same fp64 reference (its errors are reported, our tolerances applied)."""
    from k3lab.bench import peers

    if case.get("T", 1) != 1 or case.get("state_dtype", "fp32") != "fp32" or case.get("D", 128) != 128:
        return []
    ok, _ = peers.flashinfer_available()
    if not ok or case["heads"] not in (8, 12, 24, 32, 48, 96):
        return []

    def make(s):
        fi = peers.FlashInferKDADecode(s["params"], s["state"], s["conv_state"], case["batch"])
        a = _args(s)
        return lambda: fi(*a)

    def check(c, s):
        """The one checker on FlashInfer's run: its results converted back into our buffers."""
        from k3lab.harness import checker

        def impl(d):
            fi = peers.FlashInferKDADecode(d["params"], d["state"], d["conv_state"], c["batch"])
            fi(*_args(d))
            out, st, cs = fi.ours()
            d["out"].copy_(out)
            d["state"].copy_(st)
            d["conv_state"].copy_(cs)
        return checker.check(registry.get(c.op), c, impl=impl, impl_name="flashinfer", inputs=s)
    return [Peer("flashinfer", make, check, note="FlashInfer 0.7.2 fused_kda_decode (CuTe DSL), one launch")]


class FlashInferKDAVerify:
    """FlashInfer's multi-token fused KDA (`kda_kernels.fused_kda_decode_multitoken`: conv update, silu, q/k
    l2norm, gate, beta, delta rule and gated RMSNorm over T packed tokens, one checkpoint state written per
    token, one launch) on our verify inputs; layouts converted here, outside any timed region. Its public
    entry refuses anything but SM10x (`run_fused_kda_decode_multitoken` checks the major version only); the
    kernel itself is plain CuTe DSL (SIMT, clusters, mbarriers), so on the H200 its private runner is called
    with the arguments the public entry would pass, and the one checker says whether it is right there.
    Slots: 0 is FlashInfer's null slot; sequence n's checkpoints t live in slot 1 + n T + t, and its source
    state is slot idx[n, 0] (num_accepted 1), overwritten by the first checkpoint as in serving. The conv
    cache is [slots, 3HD, T + 2] stored sequence-strided; columns 0..2 hold our window; the call leaves the
    window's last two inputs in columns 0, 1 and token t's input in column t + 2, so columns t..t + 2 are the
    window after position t."""

    def __init__(self, params, state, conv_state, B: int, T: int):
        from k3lab.bench import peers

        self.mod = peers.flashinfer_module("kda_kernels.fused_kda_decode_multitoken")
        H, D, W = params.heads, params.head_dim, params.conv_kernel
        HD, dev = H * D, state.device
        self.B, self.T, self.H, self.D, self.p = B, T, H, D, params
        self.weight = params.conv_w.view(3, HD, W).permute(0, 2, 1).contiguous().float()
        self.A_log = params.A_log.float().contiguous()
        self.dt_bias = params.dt_bias.float().contiguous()
        self.norm_w = params.o_norm_w.float().contiguous()
        slots = 1 + B * T
        self.state = torch.zeros(slots, H, D, D, dtype=torch.float32, device=dev)
        self.idx = torch.arange(1, slots, dtype=torch.int32, device=dev).view(B, T).contiguous()
        src = self.idx[:, 0].long()
        self.state[src] = state.transpose(-1, -2).float()
        conv = torch.zeros(slots, T + W - 2, 3 * HD, dtype=torch.bfloat16, device=dev)
        conv[src, :W - 1] = conv_state.transpose(1, 2)
        self.conv = conv.transpose(1, 2)  # [slots, 3HD, T + 2], strides (.., 1, 3HD)
        self.qsl = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=dev)
        self.acc = torch.ones(B, dtype=torch.int32, device=dev)
        self.out = torch.empty(1, B * T, H, D, dtype=torch.bfloat16, device=dev)

    def __call__(self, qkv, f, b, gate):
        B, T, H, D = self.B, self.T, self.H, self.D
        n = B * T
        self.mod._run_fused_kda_decode_multitoken(
            qkv.view(n, -1), self.weight, self.conv, f.view(1, n, H, D), b.view(1, n, H), self.A_log, self.dt_bias,
            self.idx, self.qsl, self.acc, self.state, gate.view(n, H, D), self.norm_w, float(self.p.lower_bound),
            float(self.p.eps), self.out)
        return self.out

    def ours(self):
        """(out [B, T, HD], state_hist [B, T, H, K, V], conv_hist [B, T, 3HD, W-1]) in our layouts."""
        B, T = self.B, self.T
        sh = self.state[self.idx.long().view(-1)].view(B, T, self.H, self.D, self.D).transpose(-1, -2)
        src = self.conv[self.idx[:, 0].long()]  # [B, 3HD, T + 2]
        ch = torch.stack([src[:, :, t:t + 3] for t in range(T)], 1)
        return self.out.view(B, T, -1), sh.contiguous(), ch.contiguous()


def flashinfer_mt_peer(case: Case) -> list[Peer]:
    """FlashInfer's multi-token fused KDA (FlashInferKDAVerify) at uniform T, fp32 state, its head counts."""
    from k3lab.bench import peers

    if case.get("state_dtype", "fp32") != "fp32" or case.get("ragged", False) or case.get("D", 128) != 128:
        return []
    ok, _ = peers.flashinfer_available()
    if not ok or case["heads"] not in (12, 24, 32, 48, 96):
        return []
    B, T = case["batch"], case["T"]

    def make(s):
        fi = FlashInferKDAVerify(s["params"], s["state"], s["conv_state"], B, T)
        a = _args(s)
        return lambda: fi(*a)

    def check(c, s):
        from k3lab.harness import checker

        def impl(d):
            fi = FlashInferKDAVerify(d["params"], d["state"], d["conv_state"], B, T)
            fi(*_args(d))
            out, sh, ch = fi.ours()
            d["out"].copy_(out)
            d["state_hist"].copy_(sh[:, ref.checkpoint_positions(T, c.get("checkpoint", 1))])
            d["conv_hist"].copy_(ch)
        return checker.check(registry.get(c.op), c, impl=impl, impl_name="flashinfer_mt", inputs=s)
    return [Peer("flashinfer_mt", make, check,
                 note="FlashInfer 0.7.2 fused_kda_decode_multitoken (CuTe DSL), one launch, a checkpoint per token")]


# ---- measurement of kernel variants (the H200 sweeps behind the shape rules) ---------------------------

def _direct(v: dict):
    """(make, impl) of one verify variant run on the CuTe kernel directly, at an explicit tile_v and row_warps
    (the component API takes the shape's row_warps)."""
    from k3lab_kernels.cute import kda_verify as kv

    def run(d):
        return kv.kda_verify(*_args(d), d["params"], d["state"], d["conv_state"], d["out"], d["state_hist"],
                             d["conv_hist"], tile_v=v["tile_v"], row_warps=v["row_warps"], pdl=bool(v.get("pdl")))

    return (lambda d: (lambda: run(d))), run


def h200_explore(out: str, entries: list, *, reps: int = 15, deadline_s: float = 0.0, name: str = "kda_explore",
                 device: str = "cuda", log=print) -> str | None:
    """Each entry (op, case, variants, peers): every variant beside the named peers (of the op's peers) on the
    same rotated input sets, every row checked against fp64 first (`k3lab.bench.runner.explore`). A variant
    {"name", "tile_v", ...}: without "row_warps" the production path through the component API (backend "cute"
    unless the variant names one, tile_v, pdl); with it the verify kernel called directly (`_direct`). One bundle
    `name` under `out`."""
    from k3lab.bench import runner
    from k3lab.harness import checker

    def impls(op, case, variants, peers, gpu):
        out_ = []
        for v in variants:
            v = dict(v)
            label = v.pop("name")
            be = v.pop("backend", "cute")
            if "row_warps" not in v:
                out_.append(runner._ours(op, case, be, v, name=label))
                continue
            make, impl = _direct(v)
            chk = (lambda s, impl=impl, label=label: checker.check(op, case, impl=impl, impl_name=label, inputs=s))
            out_.append(runner.Impl(label, make, chk, v, min_sets=2 if v.get("pdl") else 1))
        return out_ + runner.named_peers(op, case, peers, gpu)

    return runner.explore(out, entries, impls, reps=reps, deadline_s=deadline_s, name=name, device=device, log=log)


def _v(name: str, tile_v: int, **kw) -> dict:
    return dict(name=name, tile_v=tile_v, **kw)


def _final_entries() -> list:
    """The ninth session's evidence run (profiles/h200/kda_decode_fi.json.gz; docs/NOTES_kda.md): per batch the
    production path at the auto rule's tile (row `cute`, through the component API) and `kda_pdl` on
    (`cute_pdl`), the verify row_warps beside the rule's, FlashInfer's fused decode / multi-token kernel and
    fla's recurrence (verify). In order of priority: a deadline cuts the tail."""
    from k3lab import policy

    H = 12
    out = []
    for B in (8, 16, 4, 64, 32, 1, 2):
        tv = policy.rule("kda", "decode", B)["tile_v"]
        vs = [_v("cute", tv), _v("cute_pdl", tv, pdl=True)]
        out.append(("kda_decode", dict(heads=H, batch=B, T=1), vs, ("flashinfer",)))
    extra = {(8, 8): ((128, 1), (64, 2)), (16, 8): ((128, 1), (64, 2)), (8, 4): ((128, 1), (64, 2)),
             (64, 8): ((64, 2), (128, 4)), (16, 4): ((128, 1),)}
    for B in (1, 8, 64, 16, 4, 2, 32):
        for T in (2, 4, 8):
            tv = policy.rule("kda", "verify", B, T)["tile_v"]
            vs = [_v("cute", tv)] + [_v(f"cute_t{t}_rw{w}", t, row_warps=w)
                                     for t, w in extra.get((B, T), ())]
            out.append(("kda_verify", dict(heads=H, batch=B, T=T), vs, ("flashinfer_mt", "fla_recurrence")))
    return out


H200_FINAL = _final_entries()


def _checkpoint_entries(cs: dict | None = None, commits: bool = True) -> list:
    """The verify checkpoint study (issue 16, verify at T = 8; docs/NOTES_kda.md, fourteenth session): per batch and
    T the CuTe verify at the rule's tile with every checkpoint c in `cs` (one case each, the peers beside c = 1
    only: their work does not depend on c), then the commit (triton) at c = 1 (a slot copy) and c = T (the replay
    of up to T - 1 positions when the accept is partial; accepted "each": sequence b accepts 1 + b mod T). In order
    of priority: a deadline cuts the tail."""
    from k3lab import policy

    H = 12
    out = []
    cs = cs or {8: (1, 2, 4, 8), 4: (1, 4), 2: (1, 2)}

    def verify(T):
        for B in (8, 16, 64, 1, 4, 32, 2):
            tv = policy.rule("kda", "verify", B, T)["tile_v"]
            for c in cs[T]:
                peers = ("flashinfer_mt", "fla_recurrence") if c == 1 else ()
                out.append(("kda_verify", dict(heads=H, batch=B, T=T, checkpoint=c), [_v("cute", tv)], peers))

    verify(8)
    for B in (1, 8, 16, 64) if commits else ():
        for c, acc in ((1, (8,)), (8, ("each", 7, 8))):
            for a in acc:
                out.append(("kda_commit", dict(heads=H, batch=B, T=8, checkpoint=c, accepted=a),
                            [dict(name="triton", tile_v=None, backend="triton")], ()))
    verify(4)
    verify(2)
    return out


H200_CKPT = _checkpoint_entries()
H200_CKPT_PEERS = _checkpoint_entries({8: (1, 8), 4: (1, 4), 2: (1, 2)}, commits=False)


def _commit_tile_entries() -> list:
    """The commit's replay tile (`tile_v` of `_kda_replay_kernel`) at the checkpoints and accepts that replay
    (accepted 7 at c = 8: the longest replay; "each" at c = 2, 4, 8), beside the c = 1 slot copy."""
    out = []
    tiles = [dict(name=f"triton_t{tv}", tile_v=tv, backend="triton") for tv in (8, 16, 32, 64, 128)]
    for B in (64, 8, 16, 1):
        out.append(("kda_commit", dict(heads=12, batch=B, T=8, checkpoint=1, accepted=8),
                    [dict(name="triton", tile_v=None, backend="triton")], ()))
        for c, a in ((8, 7), (4, "each"), (2, "each"), (8, "each")):
            out.append(("kda_commit", dict(heads=12, batch=B, T=8, checkpoint=c, accepted=a), tiles, ()))
    return out


H200_COMMIT_TILES = _commit_tile_entries()


# ---- the entries --------------------------------------------------------------------------------------

def cute_supports(backend: str, shape: dict) -> str | None:
    """The shapes the CuTe KDA kernels take (kernels/cute/kda_*.py: head_dim 128, conv width 4; verify T <= 16);
    every other backend takes any shape the component validates."""
    if backend != "cute":
        return None
    if shape.get("D", 128) != 128:
        return f"the CuTe kernels need head_dim 128 (got {shape['D']})"
    if shape.get("W", 4) != 4:
        return f"the CuTe kernels need conv width 4 (got {shape['W']})"
    return None


def _cute_supports_verify(backend: str, shape: dict) -> str | None:
    if backend == "cute" and shape.get("T", 1) > 16:
        return f"the CuTe verify takes T <= 16 positions (got {shape['T']})"
    return cute_supports(backend, shape)


_AXES = dict(heads=HEADS, batch=BATCHES, D=(128,), state_dtype=("fp32",))


def _known(c: Case) -> bool:
    """The state dtype is one the ops know (fp32 or bf16: STATE_TOL)."""
    return c.get("state_dtype", "fp32") in STATE_TOL


def _tile_fits(c: Case, opts: dict) -> bool:
    """A value-column tile fits a head when it divides D (a D = 16 test head takes tiles up to 16)."""
    t = opts.get("tile_v")
    return t is None or c.get("D", 128) % t == 0


_PDL = {"cute_pdl": ("cute", {"pdl": True})}  # the kda_pdl switch, timed at the auto rule's tile
# num_warps (Triton): None = the tuned default (k3lab_kernels.triton.kda_decode.default_num_warps); the Triton
# tuner is `k3lab bench kda --backends triton --grid num_warps=1,2,4,8,16`
_TILE = {"tile_v": {"triton": TILES_TRITON, "cute": TILES_CUTE}, "pdl": {"cute": (False,)},
         "num_warps": {"triton": (None, 1, 2, 4, 8, 16)}}
_TILE_DEFAULTS = {"num_warps": (None,)}

register(Op(
    name="kda_decode", component="kda", policy_key="decode",
    doc="one position: conv update + silu + q/k l2norm + gate + beta + delta rule + gated RMSNorm",
    axes=dict(_AXES, T=(1,)), option_axes=_TILE, option_defaults=_TILE_DEFAULTS, option_valid=_tile_fits,
    make_inputs=make_decode, reference=ref_decode, written=("out",), updated=("state", "conv_state"),
    tolerances=tolerances, tolerance_why=WHY, call=call_decode,
    nbytes=_case_bytes, flops=_case_flops, floor_bw="copy",
    backends={"reference": "k3lab.ref.kda:kda_decode",
              "torch_compile": "k3lab.components.kda:ref_decode_fp32",
              "triton": "k3lab_kernels.triton.kda_decode:kda_decode",
              "cute": "k3lab_kernels.cute.kda_decode:kda_decode"},
    peers=lambda c: fla_peers(c) + flashinfer_peer(c) + copy_peer(c), valid=lambda c: c["T"] == 1 and _known(c),
    variants=_PDL,
    test_file="tests/test_kda_component.py", supports=cute_supports,
))

register(Op(
    name="kda_verify", component="kda", policy_key="verify",
    doc="T = draft depth + 1 positions from the start state; the state after every checkpoint-th position (and "
        "the last) and the conv window after every position kept for the commit",
    axes=dict(_AXES, T=(2, 4, 8), ragged=(False,), checkpoint=(1,)), option_axes=_TILE,
    option_defaults=_TILE_DEFAULTS, option_valid=_tile_fits,
    make_inputs=make_verify, reference=ref_verify, written=("out", "state_hist", "conv_hist"), updated=(),
    tolerances=tolerances, tolerance_why=WHY, call=call_verify,
    nbytes=_case_bytes, flops=_case_flops, floor_bw="copy",
    # torch_compile of verify runs the reference (the record says so)
    backends={"reference": "k3lab.ref.kda:kda_verify", "torch_compile": "k3lab.ref.kda:kda_verify",
              "triton": "k3lab_kernels.triton.kda_verify:kda_verify",
              "cute": "k3lab_kernels.cute.kda_verify:kda_verify"},
    peers=lambda c: fla_peers(c) + flashinfer_mt_peer(c),
    valid=lambda c: 2 <= c["T"] <= 8 and c["checkpoint"] <= c["T"] and _known(c), variants=_PDL,
    test_file="tests/test_kda_component.py", supports=_cute_supports_verify,
))

register(Op(
    name="kda_commit", component="kda", policy_key="commit",
    doc="a verify's accepted prefix into the state: the slot's copy, or (checkpoint >= 2, between slots) the "
        "replay of up to checkpoint - 1 positions from the last slot",
    axes=dict(heads=(12,), batch=(1, 8, 64), D=(128,), state_dtype=("fp32",), T=(8,), checkpoint=(8,),
              accepted=("each", 7, 8)),
    option_axes={"tile_v": {"triton": TILES_TRITON}}, option_defaults={"tile_v": (None,)}, option_valid=_tile_fits,
    make_inputs=make_commit, reference=ref_commit, written=(), updated=("state", "conv_state"),
    tolerances=tolerances, tolerance_why=WHY, call=call_commit,
    nbytes=_case_bytes, flops=_case_flops, floor_bw="copy",
    backends={"reference": "k3lab.ref.kda:kda_commit", "triton": "k3lab_kernels.triton.kda_verify:commit"},
    valid=lambda c: 2 <= c["T"] <= 8 and c["checkpoint"] <= c["T"] and _known(c) and (c["accepted"] == "each"
                                                                          or 1 <= c["accepted"] <= c["T"]),
    test_file="tests/test_kda_triton.py", in_sweep=False,
))

register(Op(
    name="kda_prefill", component="kda", policy_key="prefill",
    doc="L positions in chunks of 16/32/64 (fp32 or bf16-rounded inverse; grouped chunk scan on/off)",
    axes=dict(heads=(12,), batch=(1,), L=(64, 1000, 4096), chunk=(64,), inverse=("fp32",), grouped=(False, True),
              D=(128,), state_dtype=("fp32",)),
    option_axes={"tile_v": {"triton": (16, 32, 64, 128), "cute": (16, 32, 64, 128)}}, option_valid=_tile_fits,
    make_inputs=make_prefill, reference=ref_prefill, written=("out",), updated=("state", "conv_state"),
    tolerances=tolerances, tolerance_why=WHY, call=call_prefill,
    nbytes=_case_bytes, flops=_case_flops, floor_bw="copy",
    backends={"reference": "k3lab.ref.kda:kda_prefill_chunked",
              "torch_compile": "k3lab.ref.kda:kda_prefill_chunked",
              "triton": "k3lab_kernels.triton.kda_prefill:kda_prefill",
              "cute": "k3lab_kernels.cute.kda_prefill:kda_prefill"},
    test_file="tests/test_kda_component.py", in_sweep=False, supports=cute_supports, valid=_known,
))
