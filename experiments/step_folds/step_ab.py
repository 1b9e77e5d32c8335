"""The decode step at batch 1 (BATCH; DRAFT the draft depth, 0; TP8, 8K, MXFP4, pdl, proj_cute, kda_pdl: notebook 06's
headline settings) with one
launch fold or setting of `k3lab.step` (or a kernel module) in each arm, arm against arm in one build:
  kda_chain  the KDA decay's second factor f = W_fb fa chained into the input group's CuTe launch
             (KDA_DECAY_CHAIN_MAX_TOKENS 16, the default) or its own CuTe GEMV launch (0);
  moe_glue_fold  the MoE output's glue folded into the launches around it (k3lab.step.moe_glue_fold,
             MOE_GLUE_FOLD_MAX_TOKENS 1, the default): the shared SiTU as the MoE input group's GLU output, bf16(y
             routed_norm) and the partial sums of y^2 by the experts' down kernel, moe_out on the CuTe GEMV through its
             rmsp prologue; or glue.norm_glu's launch (0);
  proj_unroll  the CuTe GEMV's steps in flight (UNROLL) and preloaded before the pdl wait (PRE): 4 / 4, 8 / 4, 8 / 8
             (8 / 8 won and is the default: profiles/h200/proj_unroll_step_ab.json.gz, git history at 720c776);
  proj_short the GEMV's short inputs (K <= 2048: the output projections, W_fb) at 4 / 4 (SHORT_K 2048) or at the
             long inputs' 8 / 8 (SHORT_K 0);
  short_k    UNROLL_SHORT / PRE_SHORT for the inputs up to 2048 long: 4/4, 2/2, 3/3, 4/2, 6/6 (6 / 6 = the long
             inputs' 8 / 8 at K 1536, six steps; 4 / 2 won and is the default:
             profiles/h200/short_k_step_ab.json.gz (retired for room, git history at 93364f5));
  mid_k      moe_out (K 3968) at the short inputs' UNROLL / PRE (SHORT_K 4096) or the long inputs' (2048);
  long_k     UNROLL / PRE of the inputs longer than SHORT_K: 8/8 (the default), 16/16, 12/12, 16/8, 8/16, 8/12, 6/6,
             8/6 (16 / 16 and 12 / 12 lost: profiles/h100-80gb-hbm3/long_k62_step_ab.json.gz, git history at
             5085684; 16 / 8 ties, 8 / 16 lost: profiles/h100-80gb-hbm3/long_k63_step_ab.json.gz,
             git history at 7e3e20a);
  expert_rows  the one-token experts' rows a CTA, up / down: 4/4, 2/4, 6/4, 4/2, 4/8 (expert_rows2: 4/4, 4/8, 6/8;
             expert_rows3: 6/8, 6/16, 8/8, 8/16; 6 / 8 kept);
  attnres_early  the CuTe AttnRes with the blocks and the prefix read (and the blocks' partials formed) before its
             pdl wait, or after it (EARLY; early kept: profiles/h200/attnres_early_step_ab.json.gz);
  mla_parts  the `mla_partitions` switch at auto / 64 / 32 / 16 (an arm's "switch:NAME" keys replace the switch);
  shared_stream  the `shared_expert_stream` switch off, and on with the side-stream launch held to 16 / 32 / 64 CTAs
             (k3lab.step.SHARED_STREAM_CTAS; the unbounded form lost +31.8 us in the thirty-first session's step);
  up_halves  the one-token experts' up kernel in one or two thread groups of L/32 (UP_HALVES) x UP_ROWS: 1/6, 2/12,
             2/8, 2/6 (2 / 12 kept: profiles/h200/up_halves_step_ab.json.gz, git history at 8717b5e);
  mla_ksplit the MLA split's latent columns in 1 / 4 pieces (DEFAULT_KSPLIT; 4 kept for the step's contiguous
             cache: profiles/h200/mla_ksplit_step_ab.json.gz (git history at 1c9f81d), where 2 pieces also ran);
  attnres_form  the CuTe AttnRes's form and shape inside the step: the rule of data/trunk_defaults.json, alpha
             threads at cluster 8 vec 4 (what the thirty-second session's H200 headline ran: 1.65 us a call against
             2.63 for twopass in the thirty-seventh's H100 step) and vec 8, twopass at cluster 8 vec 4 and cluster 2
             vec 8 (an arm's "policy:COMPONENT.KEY" replaces that op's rules of the auto table; not measured yet);
  proj_mma   (BATCH=2..16) the `proj_cute` switch's projections of several tokens on Triton (PROJ_MMA_MAX_TOKENS 0,
             the default) or on the CuTe tensor-core path (16), its x staged in shared memory or not (proj_mma.X_SMEM;
             not measured yet);
  proj_reduce  (BATCH=64, 8) the Triton projections' split-K partials summed by a second kernel under PDL (the
             default rule, proj_gemv.RED_MIN_BM / RED_MAX_TILES) or by each tile's last program (the rule before).
  mla_lazy   the MLA split's running max moved every block (DEFAULT_LAZY False) or only past LAZY_TAU (True).
  mla_fuse   the MLA split's partials merged by the merge kernel (DEFAULT_FUSE_MERGE False) or by the split's last
             programs (True).
  mla_contig (BATCH=8..32) the contiguous cache's streamed tiles (CONTIG_STREAMED True, the rule) or the tiles before
             (False).
Arms of lost forms ran on their own code (in git history, with their bundles): moe_glue (the glue by the last CTA of
the experts' down kernel) at 6659250, proj_form (a tensor-core GEMV) at af4128e, the glue fold's first two forms at
babf477 / 9f789eb, moe_early (the experts' up kernel after a ready word) at 89b2c36, down_early (the experts' down
kernel reading its ids, W2 words and scales before its pdl wait) at 79364b5, mla_early (the MLA split's rows requested
into L2 before its pdl wait x the cache write before the query step) at 2410a29, mla_stages (the split's num_stages 2
/ 3 / 4 on the step's contiguous cache, CONTIG_STAGES) and mla_merge (the merge's MERGE_BLOCK_C 32 / 16 / 64) at
727ca60, mla_small (the MLA cache write's work before its pdl wait, MLA_CACHE_EARLY; the query step's UNROLL / PRE
4/4, 6/6, 4/2, 2/2) at 2dcd8a4, l2_rows (the one-token experts' CTAs requesting their rows into L2 at their start,
moe_experts.L2_ROWS) at e84efea, w2_tail (each one-token up CTA requesting its share of the pair's W2 rows into L2
once its rows are read, W2_TAIL, or down launched right after up's wait reading its W2 before its own, DOWN_OVERLAP: a
tie; its bundle in git history at 45c8627) at 251d172, up_bulk (the up kernel's rows by four bulk copies
into shared memory on one mbarrier, moe_experts.UP_BULK) at 1b6db44, up_min_ctas (the up kernel bounded to 8 CTAs an
SM, UP_MIN_CTAS) at 58394f6, row_prefetch (the one-token experts' threads requesting their rows' lines into L1 after
the expert id, moe_experts.ROW_PREFETCH) and mla_bn (the MLA split's 64 positions a step on the contiguous cache,
mla_decode.UNPAGED_BLOCK_N) at f6c577b, rscatter (the experts' row sums by a butterfly per row against the
reduce-scatter, moe_experts.RSCATTER; profiles/h200/rscatter_step_ab.json.gz, git history at 9d3aa7c) and
mla_ksplit's 2 pieces at 5acb748.
The arms alternate `ROUNDS` times through `set_switches` (each timed by `k3lab.step.time_step`, the KDA states
restored first); each arm's output is compared with the first arm's on the same input and states, and one profiled
eager step per arm keeps its per-component GPU time and launches.

    python experiments/step_folds/step_ab.py $OUT FOLD    (FOLD: kda_chain, moe_glue_fold, proj_unroll, proj_short,
        short_k, mid_k, long_k, expert_rows, expert_rows2, expert_rows3, attnres_early, mla_parts, up_halves,
        mla_ksplit, attnres_form, proj_mma, shared_stream, proj_reduce, mla_lazy, mla_fuse; BATCH=N for another batch,
        e.g. BATCH=8 for proj_mma; ARMS=a,b to time only those arms of the fold, the first named the one the others
        are compared with)
        (PYTHONPATH=$PWD and the cute site)
        ->  $OUT/<fold>_step_ab.json
"""
import json
import os
import sys

import torch

import k3lab  # noqa: F401 - maps kernels/ to k3lab_kernels in a checkout that is not installed
from k3lab import dashboards, policy, step as S
from k3lab.harness import env as envmod, timing
from k3lab.harness.numerics import rel_norm_error

ROUNDS = 3
P = dict(preset="tp8", batch=int(os.environ.get("BATCH", "1")), context=8192, expert_dtype="mxfp4", pdl=True,
         proj_cute=True, kda_pdl=True, draft_depth=int(os.environ.get("DRAFT", "0")))
FOLDS = {"kda_chain": (("chained", {"KDA_DECAY_CHAIN_MAX_TOKENS": 16}),
                       ("own_launch", {"KDA_DECAY_CHAIN_MAX_TOKENS": 0})),
         # (git history at 6659250: "moe_glue": in_experts MOE_GLUE_IN_EXPERTS True / own_launch False)
         "moe_glue_fold": (("folded", {"MOE_GLUE_FOLD_MAX_TOKENS": 1}),
                           ("own_launch", {"MOE_GLUE_FOLD_MAX_TOKENS": 0})),
         # (git history at af4128e: "proj_form": simt / mma, k3lab_kernels.cute.proj_gemv:FORM)
         "proj_unroll": (("u4p4", {"k3lab_kernels.cute.proj_gemv:UNROLL": 4, "k3lab_kernels.cute.proj_gemv:PRE": 4}),
                         ("u8p4", {"k3lab_kernels.cute.proj_gemv:UNROLL": 8, "k3lab_kernels.cute.proj_gemv:PRE": 4}),
                         ("u8p8", {"k3lab_kernels.cute.proj_gemv:UNROLL": 8, "k3lab_kernels.cute.proj_gemv:PRE": 8})),
         "proj_short": (("all_8", {"k3lab_kernels.cute.proj_gemv:SHORT_K": 0}),
                        ("short_4", {"k3lab_kernels.cute.proj_gemv:SHORT_K": 2048})),
         # the short inputs' steps in flight / preloaded (SHORT_K 2048: the output projections, K 1536)
         "short_k": tuple((f"u{u}p{q}", {"k3lab_kernels.cute.proj_gemv:SHORT_K": 2048,
                                         "k3lab_kernels.cute.proj_gemv:UNROLL_SHORT": u,
                                         "k3lab_kernels.cute.proj_gemv:PRE_SHORT": q})
                          for u, q in ((4, 4), (2, 2), (3, 3), (4, 2), (6, 6))),
         # moe_out (K 3968) with the short inputs' 4 / 2 (SHORT_K 4096) or the long inputs' 8 / 8 (SHORT_K 2048)
         "mid_k": (("k2048", {"k3lab_kernels.cute.proj_gemv:SHORT_K": 2048}),
                   ("k4096", {"k3lab_kernels.cute.proj_gemv:SHORT_K": 4096})),
         # the long inputs' (K > SHORT_K) steps in flight / preloaded
         "long_k": tuple((f"u{u}p{q}", {"k3lab_kernels.cute.proj_gemv:UNROLL": u,
                                        "k3lab_kernels.cute.proj_gemv:PRE": q})
                         for u, q in ((8, 8), (16, 16), (12, 12), (16, 8), (8, 16), (8, 12), (6, 6), (8, 6))),
         # the one-token experts' rows a CTA (UP_ROWS intermediate rows of W1 and of W3; DOWN_ROWS latent rows)
         "expert_rows": tuple((f"up{u}_down{d}", {"k3lab_kernels.cute.moe_experts:UP_ROWS": u,
                                                  "k3lab_kernels.cute.moe_experts:DOWN_ROWS": d})
                              for u, d in ((4, 4), (2, 4), (6, 4), (4, 2), (4, 8))),
         "expert_rows2": tuple((f"up{u}_down{d}", {"k3lab_kernels.cute.moe_experts:UP_ROWS": u,
                                                   "k3lab_kernels.cute.moe_experts:DOWN_ROWS": d})
                               for u, d in ((4, 4), (4, 8), (6, 8))),
         "expert_rows3": tuple((f"up{u}_down{d}", {"k3lab_kernels.cute.moe_experts:UP_ROWS": u,
                                                   "k3lab_kernels.cute.moe_experts:DOWN_ROWS": d})
                               for u, d in ((6, 8), (6, 16), (8, 8), (8, 16))),
         # the CuTe AttnRes reading the blocks and the prefix before its pdl wait (EARLY, kept)
         "attnres_early": (("waits", {"k3lab_kernels.cute.attnres_norm:EARLY": False}),
                           ("early", {"k3lab_kernels.cute.attnres_norm:EARLY": True})),
         # the up kernel's thread groups (UP_HALVES: 2 groups of L/32 threads, no idle lane) x its rows a CTA
         "up_halves": tuple((f"h{h}_r{r}", {"k3lab_kernels.cute.moe_experts:UP_HALVES": h,
                                            "k3lab_kernels.cute.moe_experts:UP_ROWS": r})
                            for h, r in ((1, 6), (2, 12), (2, 8), (2, 6))),
         # the MLA split's latent columns in KS pieces (independent chains of score MMAs)
         "mla_ksplit": tuple((f"ks{k}", {"k3lab_kernels.triton.mla_decode:DEFAULT_KSPLIT": k}) for k in (1, 4)),
         # the CuTe AttnRes's rule replaced by one form and shape at every batch (the first arm: the table's rules)
         "attnres_form": (("rule", {"policy:trunk.attnres_norm": list(policy.table("trunk")["attnres_norm"])}),)
         + tuple((f"{a}_c{c}v{v}", {"policy:trunk.attnres_norm": [dict(max_batch=None, backend="cute", cluster=c,
                                                                          vec=v, alpha=a)]})
                 for a, c, v in (("threads", 8, 4), ("threads", 8, 8), ("twopass", 8, 4), ("twopass", 2, 8))),
         # the MLA split's pieces a sequence inside the step (the switch; auto: 132 at 8K on the H200)
         "mla_parts": tuple((f"p{p}", {"switch:mla_partitions": p}) for p in ("auto", 64, 32, 16)),
         # the shared experts' w1/w3 beside the routed experts on a side stream, their launch held to N CTAs
         "shared_stream": (("off", {"switch:shared_expert_stream": False, "k3lab.step:SHARED_STREAM_CTAS": 32}),)
         + tuple((f"on_c{c}", {"switch:shared_expert_stream": True, "k3lab.step:SHARED_STREAM_CTAS": c})
                 for c in (16, 32, 64)),
         # (BATCH=2..16) the several-token projections on Triton or on the CuTe tensor-core path
         "proj_mma": (("triton", {"PROJ_MMA_MAX_TOKENS": 0}),
                      ("mma", {"PROJ_MMA_MAX_TOKENS": 16, "k3lab_kernels.cute.proj_mma:X_SMEM": False}),
                      ("mma_smem", {"PROJ_MMA_MAX_TOKENS": 16, "k3lab_kernels.cute.proj_mma:X_SMEM": True})),
         # the Triton projections' split-K partials summed by a second kernel under PDL (RED_MIN_BM / RED_MAX_TILES,
         # the default since 0024ded / 8717b5e: 64-row dot tiles from a batch tile of 64, and from batch 2 where at most
         # 32 output tiles split K) or by each tile's last program behind a counter with the 32-row tiles (the rule
         # before; BATCH=64 and BATCH=8)
         "proj_reduce": (("kernel", {"k3lab_kernels.triton.proj_gemv:RED_MIN_BM": 64,
                                     "k3lab_kernels.triton.proj_gemv:RED_MAX_TILES": 32}),
                         ("last", {"k3lab_kernels.triton.proj_gemv:RED_MIN_BM": 1 << 30,
                                   "k3lab_kernels.triton.proj_gemv:RED_MAX_TILES": 0})),
         # the MLA split's lazy rescale forced off / on (DEFAULT_LAZY; the rule `default_lazy` turns it on for
         # verifies of >= 4 positions from batch 32; docs/NOTES_mla.md, forty-sixth to fifty-third sessions)
         "mla_lazy": (("eager", {"k3lab_kernels.triton.mla_decode:DEFAULT_LAZY": False}),
                      ("lazy", {"k3lab_kernels.triton.mla_decode:DEFAULT_LAZY": True})),
         "mla_fuse": (("two", {"k3lab_kernels.triton.mla_decode:DEFAULT_FUSE_MERGE": False}),
                      ("fused", {"k3lab_kernels.triton.mla_decode:DEFAULT_FUSE_MERGE": True})),
         # the step's contiguous MLA cache on streamed tiles (32 positions, 3 stages: `streamed_rows`, the rule) or on
         # the paged-without-preload tiles before it (64 positions from batch 16, 2 stages)
         "mla_contig": (("streamed", {"k3lab_kernels.triton.mla_decode:CONTIG_STREAMED": True}),
                        ("before", {"k3lab_kernels.triton.mla_decode:CONTIG_STREAMED": False})),
         }


def _set(key, value):
    """An arm's setting: a name of k3lab.step, "module:NAME" of another module (a kernel's module setting), or
    "policy:COMPONENT.KEY" (that op's rules of the auto table, k3lab.policy, read when the step's graph is captured)."""
    if key.startswith("policy:"):
        comp, op = key[len("policy:"):].split(".")
        policy.table(comp)[op] = value
    elif ":" in key:
        import importlib

        mod, name = key.split(":")
        setattr(importlib.import_module(mod), name, value)
    else:
        setattr(S, key, value)


def main(out, fold):
    ARMS = FOLDS[fold]
    if os.environ.get("ARMS"):
        names = dict(ARMS)
        want = [a.strip() for a in os.environ["ARMS"].split(",") if a.strip()]
        bad = [a for a in want if a not in names]
        if bad or not want:
            raise SystemExit(f"ARMS: {bad or want} not among {fold}'s arms {list(names)}")
        ARMS = tuple((a, names[a]) for a in want)
    pr = timing.probes()
    view, sw = dashboards.view_from_params(P), dashboards.switches_from_params(P)
    res = dict(probes=pr, env=envmod.fingerprint(), params=P, fold=fold, arms={a[0]: a[1] for a in ARMS},
               times={a[0]: [] for a in ARMS}, profile={}, err={})
    st = S.DecodeStep(view, sw, device="cuda")
    kda = [L.state for L in st.layers if L.kind == "kda"]
    start = [(s.state.clone(), s.conv_state.clone()) for s in kda]
    x = torch.randn(tuple(st.x_in.shape), device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(st.dtype)
    first, first_layers = None, None
    for rnd in range(ROUNDS):
        for name, consts in ARMS:
            for k, v in consts.items():
                if not k.startswith("switch:"):
                    _set(k, v)
            st.set_switches(sw.replace(**{k[7:]: v for k, v in consts.items() if k.startswith("switch:")}))
            for s, (s0, c0) in zip(kda, start):
                s.state.copy_(s0)
                s.conv_state.copy_(c0)
            if rnd == 0:
                y = st.run(x).float()
                torch.cuda.synchronize()
                first = y if first is None else first
                # each layer's output against the first arm's: where a difference starts (a layer's inputs are
                # equal across arms only up to the first layer that differs; routing amplifies what follows)
                layers = [L.buf["x_out"].double().clone() for L in st.layers]
                first_layers = layers if first_layers is None else first_layers
                res["err"][name] = dict(vs_first=rel_norm_error(y.double(), first.double()),
                                        finite=bool(torch.isfinite(y).all()),
                                        layers_vs_first=[rel_norm_error(a, b) for a, b in zip(layers, first_layers)])
            t = S.time_step(st, reps=20, warmup=3)
            res["times"][name].append(dict(median_us=t.median_us, samples_us=t.samples_us))
            if rnd == 0:
                att = S.profile_step(st)
                res["profile"][name] = {k: {kk: vv for kk, vv in v.items() if not isinstance(vv, list)}
                                        for k, v in att.items()}
            print(f"round {rnd} {name:12s} {t.median_us:8.1f} us", flush=True)
            with open(f"{out}/{fold}_step_ab.json", "w") as f:  # after every arm: a cut run keeps what it has
                json.dump(res, f, default=str)
    for k, v in FOLDS[fold][0][1].items():  # the defaults back (the fold's first arm, named in ARMS or not)
        if not k.startswith("switch:"):
            _set(k, v)
    print("\n| arm | step us (each round) | output vs the first arm |")
    print("|---|---|---|")
    for name, _ in ARMS:
        print(f"| {name} | " + " / ".join(f"{x['median_us']:.1f}" for x in res["times"][name])
              + f" | {res['err'].get(name, {}).get('vs_first', float('nan')):.2e} |")
    for name, _ in ARMS:
        print(name, "layers vs the first arm:", " ".join(f"{v:.1e}" for v in res["err"][name]["layers_vs_first"]))
    for name, _ in ARMS:
        pf = res["profile"].get(name, {})
        l01 = {k.split(".")[-1]: (v["launches"], round(v["kernel_us"], 2))
               for k, v in pf.items() if k.startswith("L01")}
        print(name, "L01:", l01)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in FOLDS:
        sys.exit(f"usage: step_ab.py OUT {{{'|'.join(FOLDS)}}}")
    main(sys.argv[1], sys.argv[2])
