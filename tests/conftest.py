"""Minimal: without a CUDA GPU, run Triton kernels in the interpreter (must be set before triton is
imported anywhere); tests marked `gpu` are skipped cleanly without CUDA."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    # CI's time: the workers share the machine's cores (-n auto: one worker a core), so each runs torch on one thread
    # (and so do the notebook kernels it starts); two threads each oversubscribed CI's 2 cores (660 -> 400 s;
    # docs/NOTES_step.md, CI's time)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _patch_language_once_per_launch():
    """CI time: Triton's interpreter patches triton.language for a launch (and restores it after), then again, with
    inspect.getmembers over the modules, at every call of a @triton.jit function inside it (each program's call of
    the kernel itself and every helper), where it is patched already: ~20 % of an interpreted kernel's time. Inside a
    launch, a call whose language modules are patched already (by the launch, or by an earlier call in it: Triton's
    call leaves what it patched patched, e.g. triton.language.core for tl.sum) runs without that scan; anything else
    runs Triton's own code. A speed-up only: where the interpreter's internals differ, nothing is changed."""
    try:
        from triton.runtime import interpreter as ti
        grid_call, fn_call, error = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__, ti.InterpreterError
    except (ImportError, AttributeError):  # pragma: no cover - another Triton
        return
    launches: list = []  # the language modules each launch in progress patched
    langs: dict = {}  # fn -> the ids of the language modules its globals name (the module's imports, made once)

    def langs_of(fn):
        r = langs.get(fn)
        if r is None:
            r = langs[fn] = frozenset(id(v) for v in getattr(fn, "__globals__", {}).values()
                                      if v is ti.tl or v is ti.tl.core)
        return r

    def launch(self, *args, **kwargs):
        launches.append(set(langs_of(self.fn)))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    def call(self, *args, **kwargs):
        mods = langs_of(self.fn)
        if not (launches and mods and mods <= launches[-1]):
            if launches and mods:  # Triton's call patches these modules and leaves them patched: skip them next time
                launches[-1] |= mods
            return fn_call(self, *args, **kwargs)
        fn = self.rewrite()  # what Triton's call does once the language is patched
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    ti.GridExecutor.__call__, ti.InterpretedFunction.__call__ = launch, call


def _memoize_np_dtype():
    """CI time: the interpreter's `_get_np_dtype` builds its 19-entry table of Triton -> numpy types at every call
    (~27 us, hundreds of thousands of calls a test file: ~6 % of an interpreted kernel's time). The same answers from
    a table kept between calls, keyed by the element type (a block type's answer is its element type's, as in Triton's
    function; pointers go straight to it); a type Triton's function does not know still raises there."""
    try:
        from triton.runtime import interpreter as ti
        orig, block, pointer = ti._get_np_dtype, ti.tl.block_type, ti.tl.pointer_type
    except (ImportError, AttributeError):  # pragma: no cover - another Triton
        return
    known: dict = {}

    def np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, block) else tt_dtype
        if isinstance(key, pointer):  # unhashable; Triton's function answers it first thing
            return orig(key)
        r = known.get(key)
        if r is None:
            r = known[key] = orig(key)
        return r

    ti._get_np_dtype = np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()
    _memoize_np_dtype()


# CI's time budget (`.ci/run`, 2 cores, ~10 minutes): the default run's heaviest cases beyond one representative of
# each kernel, path and switch, marked `slow` here (`python3 -m pytest -q -m slow` runs them). Each line: the node
# id's tail, then what the default run keeps of it. Durations from `pytest --durations` on 2 cores.
CI_BUDGET_SLOW = (
    "test_triton_compiles.py::test_kda_prefill_compiles_for_hopper",  # 35 s; every other op's grid compiles
    "test_step.py::test_pdl_switch_same_output_and_recorded",  # 63 s; pdl is timed and recorded by every H200 step run
    "test_step.py::test_tp_switches_numerics_against_fp64",  # 43 s; test_tp_switches_equal_the_plain_path stays
    "test_moe_cute_emulated.py::test_one_token[True-True-shape0-None]",  # 37 s; the ODD case stays
    "test_kda_triton.py::test_verify_then_commit_every_accept[4]",  # 22 s; [2] stays
    "test_kda_triton.py::test_prefill_bf16_inverse_loses_information",
    "test_kda_triton.py::test_prefill[fp32-seq-70]",  # [fp32-grouped-70] and every length-1 case stay
    "test_kda_triton.py::test_prefill[bf16-grouped-70]",
    "test_kda_triton.py::test_prefill[bf16-seq-70]",
    "test_kda_triton.py::test_verify_tiles_small[4-ragged]",  # [4-uniform], [8-*] stay
    "test_kda_triton.py::test_decode_tiles_small[4-fp32]",  # [4-bf16], [8-*] stay
    "test_kda_triton.py::test_verify_checkpoint_checker[8-2]",  # [8-1] and [4-*] stay
    "test_kda_triton.py::test_verify_checkpoint_checker[8-3]",
    "test_kda_triton.py::test_verify_checkpoint_checker[8-4]",
    "test_kda_triton.py::test_verify_checkpoint_checker[8-8]",
    "test_kda_cute_emulated.py::test_verify_checkpoint[16-2-2-3-2-True]",  # 18 s; [128-4-1-4-2-False] stays
    "test_kda_cute_emulated.py::test_verify_checkpoint[64-8-2-4-4-True]",
    "test_kda_cute_emulated.py::test_verify_large_grid[32-4-2-1-3-True]",  # test_verify_checkpoint_large_grid stays
    "test_kda_cute_emulated.py::test_verify[32-4-1-1-4-False]",  # [16-2-1-1-2-False] stays
    "test_kda_cute_emulated.py::test_verify[64-8-2-1-2-True]",
    "test_attnres_cute_emulated.py::test_alpha_threads_large[5-8-4-9-add]",  # default options, odd widths stay
    "test_attnres_cute_emulated.py::test_alpha_threads_large[3-4-8-9-none]",
    "test_attnres_cute_emulated.py::test_alpha_threads_large[5-8-4-1-none]",
    "test_attnres_cute_emulated.py::test_blocks_and_updates[9-fresh]",  # [9-add] and 0 / 1 blocks stay
    "test_attnres_cute_emulated.py::test_blocks_and_updates[9-none]",
    "test_attnres_cute_emulated.py::test_pdl[fresh]",  # [add] stays
    "test_attnres_cute_emulated.py::test_options[8-2]",  # [8-8], [4-8] stay
    "test_attnres_cute_emulated.py::test_options[4-4]",
    "test_mla_combine_cute_emulated.py::test_block_r[8]",  # [1] stays
    "test_mla_combine_cute_emulated.py::test_block_r[2]",
    "test_moe_kernels.py::test_tc_path[6-ragged-1]",  # test_tc_path_leaders_list runs ragged routing on tc
    "test_moe_grouped_emulated.py::test_grouped[False-False-shape1-False]",  # 15 s; [False-False-shape1-True] stays
    "test_proj_mma_emulated.py::test_rounds_remainders_and_clusters[1-40-72-8-64--True]",  # 11 s; [...--False] stays
    "test_proj_mma_emulated.py::test_rounds_remainders_and_clusters[9-17-50-4-64-x_smemFalse-True]",  # 9 s; -False
    "test_proj_mma_emulated.py::test_rounds_remainders_and_clusters[16-40-23-2-32-x_smemFalse-True]",  # 8 s; -False
    "test_proj_mma_emulated.py::test_rounds_remainders_and_clusters[9-17-50-4-16-x_smemFalse-True]",  # 8 s; -False
    # fifty-sixth session (CI 963 s against its 10 minutes):
    "test_trunk.py::test_proj_partials_summed_by_a_second_kernel[bf16-130]",  # 10 s; [bf16-33], [fp8-130] stay
    "test_trunk.py::test_proj_partials_summed_by_a_second_kernel[bf16-40]",
    "test_trunk.py::test_proj_partials_summed_by_a_second_kernel[fp8-40]",
    "test_trunk.py::test_proj_partials_summed_by_a_second_kernel[fp8-33]",
    "test_attnres_cute_emulated.py::test_alpha_twopass[5-2-8-9-add]",  # 12 s; cluster 2 [5-2-8-1-none] and
    "test_attnres_cute_emulated.py::test_alpha_twopass[3-4-8-9-none]",  # nine blocks [2-8-4-9-fresh] stay
    "test_attnres_cute_emulated.py::test_alpha_twopass[5-2-8-0-fresh]",
    "test_attnres_cute_emulated.py::test_pdl_early[9-none]",  # [9-add], [1-fresh], [0-add] stay
    "test_mla_query.py::test_cute_emulated[b4-q1280-cluster4-pdl]",  # 10 s; pdl [b3-q264-cluster2] and [k3-head] stay
    "test_mla_cute_emulated.py::test_bit_equal_to_triton[bf16-tensor-1]",  # pages 0 / 16 stay for every format;
    "test_mla_cute_emulated.py::test_bit_equal_to_triton[bf16-tensor-64]",  # pages 1 / 64 stay in
    "test_mla_cute_emulated.py::test_bit_equal_to_triton[fp8-tensor-1]",  # test_batch3_ragged_T4 (against fp64)
    "test_mla_cute_emulated.py::test_bit_equal_to_triton[fp8-tensor-64]",
    "test_mla_cute_emulated.py::test_bit_equal_to_triton[fp8-token-1]",
    "test_mla_cute_emulated.py::test_bit_equal_to_triton[fp8-token-64]",
    "test_proj_mma_emulated.py::test_rounds_remainders_and_clusters[9-17-50-4-16--True]",  # 5 s; [..--False] stays
    "test_proj_mma_emulated.py::test_rounds_remainders_and_clusters[16-40-23-1-16--True]",  # 5 s; [..--False] stays
    "test_proj_mma_emulated.py::test_rounds_remainders_and_clusters[16-40-23-1-32-x_smemFalse-True]",  # 5 s; -False
    "test_kda_triton.py::test_commit_checkpoint_checker[8-8-8]",  # 4 s; [8-8-3], [8-8-4], [16-8-8] stay
    # sixtieth session (a clean clone's .ci/run here 584 s):
    "test_moe_grouped_emulated.py::test_up_lsplit[False]",  # 40 s; test_more_than_one_round_of_pairs (129 pairs:
    # the rule's UP_LSPLIT off) shares by tiles
    "test_moe_grouped_emulated.py::test_up_lsplit[True]",  # 30 s; test_grouped[False-False-shape1-False] (27 pairs:
    # the rule's UP_LSPLIT on, groups of 9 joined through the workspace) stays (this sandbox drifts by ~15 %)
    # sixty-first session (a clean clone's .ci/run here 569 s; the CI machine's last 617 s):
    "test_kda_triton.py::test_verify_then_commit_every_accept[2]",  # 10 s; test_commit_equals_decode_of_accepted and
    # test_kda_component's checkpoint verify-and-commit through the checker stay
    "test_mla_decode_cute_emulated.py::test_decode[page16-ragged-cl4-direct]",  # 8 s; page 16 ragged stays pipelined
    # (test_decode_pipelined[page16-ragged-cl2-p2]), cluster 4 direct in test_decode[page1-short-cl4-p2]
    "test_mla_decode_cute_emulated.py::test_decode_pipelined[page1-short-cl4-p2]",  # 6 s; its direct twin stays
    "test_attnres_cute_emulated.py::test_pdl_early[9-add]",  # 7 s; test_alpha_twopass_pdl_early[9-add], [0-add] and
    # [1-fresh] stay
    "test_moe_cute_emulated.py::test_one_token[False-False-shape1-8]",  # 6 s; the ODD shape at its default rows stays
    "test_mla_combine_cute_emulated.py::test_combine[batch=2,partitions=2,dcp=2,heads=3]",  # 6 s; pieces x shards
    # stay in the Triton combine's tests (auto runs Triton), the CuTe one keeps 1 / 5 / 3 partials
    "test_attnres_cute_emulated.py::test_blocks_and_updates[1-none]",  # update "none" stays in test_alpha_twopass at
    "test_attnres_cute_emulated.py::test_blocks_and_updates[0-none]",  # 0 and 1 blocks
    # sixty-second session (a clean clone's .ci/run here 580 s; the CI machine's last 596 s):
    "test_attnres_cute_emulated.py::test_alpha_twopass[2-8-4-9-fresh]",  # 7 s; twopass over nine blocks stays in
    # [1-8-8-9-fresh] and test_alpha_twopass_pdl_early[9-add], cluster 8 / vec 4 in [2-8-4-0-none]
    "test_attnres_cute_emulated.py::test_alpha_twopass[2-8-4-1-add]",
    "test_attnres_cute_emulated.py::test_alpha_twopass[3-4-8-1-fresh]",  # 3 s; cluster 4 stays in [3-4-8-0-add]
    "test_attnres_cute_emulated.py::test_alpha_threads_large[5-8-4-0-fresh]",  # 5 s; four batches of it stay
    "test_attnres_cute_emulated.py::test_blocks_and_updates[1-fresh]",  # 3 s; [1-add], [0-fresh], [9-add] stay
    "test_kda_cute_emulated.py::test_decode[32-1-1]",  # 3 s; tiles 16 and 128 (the rule's two) stay
    "test_mla_decode_cute_emulated.py::test_decode_growing_scores[False]",  # 9 s; [True] (the pipelined loop) stays
    # (the sixty-second session had moved both: [True] back in the sixty-third), the plain loop's rescale over five
    # chunks in test_decode[page64-ring-cl1]
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if item.nodeid.endswith(CI_BUDGET_SLOW):
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
