"""Test setup shared by both test folders (pyproject.toml's testpaths: tests/ for the library,
benchmarks/tests/ for the benchmarks); each folder's own fixtures stay in it.

- Without CUDA, Triton kernels run in Triton's interpreter: TRITON_INTERPRET must be set before
  triton is first imported, so it is set here, at collection time.
- Triton configs are pinned (no per-kind autotuning compiles): a GPU test run stays within one
  device call; the benchmark suite (python -m benchmarks.suite) exercises the autotuned configs.
- Checks too long for CI's time budget are listed in LONG_RUN (one place for both folders): marked
  `long` and skipped unless ``EFFATTN_LONG=1`` (README.md, "Tests").
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("EFFATTN_TRITON_AUTOTUNE", "0")

# Under pytest-xdist (the README's test command runs `-n auto --dist loadfile`) the workers share the cores this process
# may use: each takes its share of torch threads instead of all of them, so they do not oversubscribe.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# The checks CI leaves out for time (2 cores, the whole suite under 15 minutes): node ids, a test's id
# without parameters for all of them, or a module. Each kind of check keeps a representative in CI
# (named in the comment). ``EFFATTN_LONG=1`` runs them with the rest; with ``-m long`` alone.
_BUILD = "tests/backends/cuda/test_cuda_build"
_ORACLE_CASES_KEPT = ("causal-B1-H2-L67-D32", "causal-Lq>Lk-q50-k19-emptyrows", "dv!=d-D24-Dv8",
                      "layout-perhead-bs16-partial", "all-gqa-window-layout-kpm")
_ORACLE_CASES_LONG = {
    "bfloat16": ("dense-B2-H2-L40-D16", "causal-Lq<Lk-q19-k50", "noncausal-Lq>Lk-q33-k70", "window-int-noncausal-w5",
                 "window-int-causal-w7", "window-pair-3-9", "window-causal-right-ignored-6-4", "window-Lq<Lk-decode",
                 "gqa-H4-Hkv2-causal", "mqa-H4-Hkv1", "headdim-odd-D5-Dv3", "headdim-1", "kpm-B2",
                 "layout-shared-bs16", "layout-gqa-perhead-causal", "scale-custom"),
    # fp16 keeps the window and GQA cases too
    "float16": ("dense-B2-H2-L40-D16", "causal-Lq<Lk-q19-k50", "noncausal-Lq>Lk-q33-k70", "window-int-noncausal-w5",
                "window-causal-right-ignored-6-4", "mqa-H4-Hkv1", "headdim-odd-D5-Dv3", "headdim-1", "kpm-B2",
                "layout-shared-bs16", "scale-custom"),
}
LONG_RUN = (
    # nvcc builds (1-3 CPU minutes per unit and arch): CI builds attention/decode.cu for sm_80 and
    # sm_90a with its spill, register and SASS checks (test_cuda_build_more.py)
    f"{_BUILD}.py::test_no_spills_registers_under_cap_and_kernel_budget",
    f"{_BUILD}.py::test_each_instance_unit_builds_its_own_kernel_without_bias_terms",
    f"{_BUILD}.py::test_sass_uses_tensor_cores_ldmatrix_and_async_copies",
    f"{_BUILD}.py::test_hopper_forward_is_wgmma_on_sm90a_only",
    f"{_BUILD}.py::test_only_dropout_instances_carry_dropout_code_and_dense_is_short",
    f"{_BUILD}.py::test_mma_sync_forward_two_barriers_per_key_tile",
    f"{_BUILD}_bwd.py",
    f"{_BUILD}_more.py::test_no_spills_registers_under_cap_and_kernel_budget[linear/linear.cu]",
    f"{_BUILD}_more.py::test_no_spills_registers_under_cap_and_kernel_budget[attention/relkeys.cu]",
    f"{_BUILD}_more.py::test_linear_kernels_counts_and_sass",
    f"{_BUILD}_more.py::test_relative_keys_forward_lives_in_its_own_unit",
    f"{_BUILD}_more.py::test_no_spills_registers_under_cap_and_kernel_budget[attention/relkeys_bwd.cu]",
    f"{_BUILD}_more.py::test_relative_keys_backward_lives_in_its_own_unit",
    f"{_BUILD}_more.py::test_no_spills_registers_under_cap_and_kernel_budget[attention/paged_prefill.cu]",
    f"{_BUILD}_more.py::test_paged_prefill_is_the_forward_with_the_paged_row_policy",
    f"{_BUILD}.py::test_hopper_forward_pipeline_in_its_sass",
    "tests/backends/cuda/test_cuda_hopper_tma.py::test_tma_forward_sass_loads_with_tma_waits_on_mbarriers_and_moves_registers",
    # the Hopper TMA forward's 128-key tiles at every residue of Lk: CI runs the tile's edges and halves
    "tests/backends/cuda/test_cuda_hopper_tma.py::test_128_key_tiles_at_every_residue[all]",
    # the offline table's tool rerun on three units (nvcc; 18 s at load 1.5): CI reads the committed table
    "tests/backends/cuda/test_cuda_kernel_table.py::test_regenerated_rows_equal_the_committed_ones",
    # mutants (a kernel rebuild and a pytest process each): CI runs decode-wait-count
    "tests/backends/cuda/test_cuda_mutations.py::test_fast_subset_is_caught[barrier-dq]",
    # the sanitizer build's second schedule: CI runs lockstep
    "tests/backends/cuda/test_cuda_emulation.py::test_attention_kernels_under_address_and_ub_sanitizers[warp-serial]",
    # Triton's compiler offline (minutes of CPU in all): CI compiles the attention kernels for sm_90 and
    # sm_80 (tests/backends/triton/test_triton_attention.py), these the paged and linear ones for sm_90
    "tests/core/test_paged.py::test_paged_kernels_compile_for_sm90_offline",
    "tests/backends/triton/test_triton_linear.py::test_kernels_compile_for_sm90_offline",
    "tests/core/test_score.py::test_score_kernels_compile_for_sm90_offline",
    # constant score tiles on packed sequences, one kind at a time: CI runs all kinds at once (causal)
    "tests/core/test_score_tiles.py::test_constant_tiles_on_packed_sequences[relative-full]",
    "tests/core/test_score_tiles.py::test_constant_tiles_on_packed_sequences[span-bidirectional-window]",
    # the Triton kernels in the interpreter against the oracle, bf16 and fp16 (~2 s a case): CI runs every
    # case in fp32 and the cases below in both (masks, GQA, layouts, padding, empty rows, Dv != D)
    *(f"tests/core/test_attention.py::test_matches_oracle[triton-{dt}-{case}]"
      for dt in ("bfloat16", "float16") for case in _ORACLE_CASES_LONG[dt]),
    *(f"tests/core/test_attention.py::test_matches_oracle[triton-float32-{case}]" for case in _ORACLE_CASES_LONG["float16"]),
    # poisoned keys the masks hide: CI runs NaN under each mask, the long run inf too (Triton's two rows)
    *(f"tests/contract/test_fuzz_regressions.py::test_nan_in_ignored_key_does_not_poison_row[{m}-inf-triton/{r}]"
      for m in ("padding", "window", "layout") for r in ("score", "prefill")),
    *(f"tests/contract/test_fuzz_regressions.py::test_paged_window_hidden_key_does_not_poison_row[{c}-inf]"
      for c in ("packed", "unpacked", "no-window")),
    # constant score tiles (interpreter): CI keeps relative causal / past window, span bidirectional window,
    # softcap + sinks and every kind at once
    *(f"tests/core/test_score_tiles.py::test_constant_tiles_taken_and_bitwise_equal[{c}]"
      for c in ("relative-full", "span-causal", "span-bidirectional-full")),
    # per-head span tile skipping: CI runs the causal mode
    "tests/core/test_score.py::test_span_per_head_tile_skipping[mode1-triton]",
    "tests/core/test_score.py::test_span_per_head_tile_skipping[mode2-triton]",
    # window edges at every tile residue: CI runs them through the fused backward (the default), the long run
    # through the two passes too
    "tests/backends/cuda/test_cuda_attention.py::test_window_edges_at_every_tile_residue_forward_and_backward[two-pass-bwd]",
    "tests/backends/cuda/test_cuda_attention.py::test_one_sided_window_edges_at_every_tile_residue[two-pass-bwd]",
    # the linear kernels' AddressSanitizer / UBSan build: CI runs the attention kernels' (lockstep)
    "tests/backends/cuda/test_cuda_linear.py::test_linear_kernels_under_address_and_ub_sanitizers",
    # the GPU suite's precompile plan against every autotune candidate: CI runs the suite's smoke run
    "benchmarks/tests/test_suite.py::test_precompile_plan_lists_every_autotune_candidate_without_a_gpu",
    # LSH on the block-sparse Triton kernels in the interpreter: CI runs 4 of the 7 cases (neighbours on
    # both sides, causal + padding at chunk 64, layout blocks under the tile; no positions feature lost)
    *(f"tests/core/test_lsh.py::test_triton_rows_on_the_block_sparse_kernels_match_reference[{c}]"
      for c in ("B1-H1-L64-D16-R3-cl32-b1a0-causal", "B1-H1-L64-D8-R2-cl32-b1a0-pad", "B1-H1-L64-D16-R2-cl64-b1a0-causal")),
    # the Hopper backward: its sm_90a nvcc build (about a minute per unit), and 8 of its 12 float64 cases (CI keeps
    # head dims 64 and 128, causal with GQA, causal with empty rows, a window with empty rows, a query offset,
    # both dtypes)
    "tests/backends/cuda/test_cuda_hopper_bwd.py::test_hopper_backward_compiles_to_hgmma_without_spills",
    *(f"tests/backends/cuda/test_cuda_hopper_bwd.py::test_hopper_backward_against_float64[{c}]"
      for c in ("causal-gqa-lq-lt-lk-d64-fp16", "dense-d128-dv96-bf16", "dense-d128-dv96-fp16",
                "window-d48-lq-gt-lk-fp16", "causal-emptyrows-d128-bf16", "dense-gqa-exact-tiles-d64-fp16",
                "dense-gqa-exact-tiles-d64-bf16", "causal-positions-d64-fp16")),
    # the Gluon forward trial compiled offline for sm_90 (a tool, not a backend path)
    "tests/backends/triton/test_triton_host.py::test_gluon_forward_trial_compiles_for_sm90_offline",
    # 16k keys through the float64 reference (a memory bound): CI keeps the blocks path's at 16k
    # (tests/backends/torch/test_cpu_paths.py)
    "tests/core/test_attention.py::test_reference_backend_memory_is_bounded_at_16k",
)
LONG_ON = os.environ.get("EFFATTN_LONG") == "1"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks LONG_RUN's tests `long` (before -m / -k select: `-m long` picks them) and skips them
    without EFFATTN_LONG=1; an entry that names no test of a collected module is an error (a renamed
    test would otherwise return to CI silently)."""
    used, files = set(), {item.nodeid.split("::", 1)[0] for item in items}
    skip = pytest.mark.skip(reason="long run (EFFATTN_LONG=1; README.md, Tests)")
    for item in items:
        hit = [e for e in LONG_RUN if e in (item.nodeid, item.nodeid.split("[", 1)[0], item.nodeid.split("::", 1)[0])]
        if hit:
            used.update(hit)
            item.add_marker(pytest.mark.long)
            if not LONG_ON:
                item.add_marker(skip)
    whole = not any("::" in str(a) for a in config.args)      # a run of node ids collects some tests only
    stale = [e for e in LONG_RUN if whole and e.split("::", 1)[0] in files and e not in used]
    if stale:
        raise pytest.UsageError(f"conftest.py LONG_RUN names tests that do not exist: {stale}")


@pytest.fixture
def one_torch_thread():
    """One torch thread for tests of many tiny ops (on a loaded 2-core machine two threads spend most
    of their time synchronizing); the previous count is restored."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def pytest_runtest_logreport(report):
    """With ``EFFATTN_FAILURE_LOG=FILE`` each failure's report is appended to FILE as it happens, so a
    run killed by a time limit (a lent GPU's call) still tells which test failed and why."""
    path = os.environ.get("EFFATTN_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
