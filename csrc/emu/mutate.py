"""Mutation run of the CUDA kernels: does the emulation test suite catch each of a fixed list of
one-line bugs?

Each mutation replaces one exact piece of one file under csrc/ in a scratch copy of csrc/, builds
that copy's emulated kernels (effattn/backends/cuda/_ext.py: only the translation units that
include the mutated file are recompiled; the torch binding is reused), and runs the tests that
should catch it, in a fresh pytest process pointed at the copy (``EFFATTN_CSRC``). A mutation is
caught when a test fails; the report names the first failing test and its message.

- A pattern that does not occur exactly once in its file is an error of the list (exit 2): the
  sources moved on and the list must follow them, never silently skip.
- A mutation whose copy does not compile is an error too (it would fail every test for the wrong
  reason).
- ``gpu_only`` mutations change code that only nvcc compiles (inline PTX, the real launch path):
  the emulation cannot see them. They are checked for their pattern only and reported as such;
  a GPU session runs tests/backends/cuda/test_cuda_gpu.py on them by hand.

A mutation the harness cannot judge (its pattern, a compile error, tests past --timeout, pytest
stopping for another reason than a failed test) is reported as an error and the run goes on.

Usage (from the repository root, with g++):
  python3 csrc/emu/mutate.py              every mutation, one after another
  python3 csrc/emu/mutate.py --fast       the subset CI runs (tests/backends/cuda/test_cuda_mutations.py)
  python3 csrc/emu/mutate.py ID [ID ...]  the named ones; --list prints the list
  --log FILE     append each result to a JSON-lines file; --resume then skips the mutations it holds a
                 result of (not an error) for today's kernel sources, the same mutation and the same
                 test ids, so a long run can be stopped and continued, or run in parts (a mutation whose
                 test was fixed is rerun by naming it)
  --report PATH  a markdown report (rewritten after each mutation): per mutation caught / survived /
                 GPU-only / error, the first failing test and its message, seconds, the load; without
                 IDs it lists the whole list, with what --log holds from earlier parts
  --report-only  write the report from --log, run nothing
  e.g. nice -n 10 python3 csrc/emu/mutate.py --log /tmp/mut.jsonl --resume --report csrc/emu/MUTATIONS.md
  (a second run on the same log with --resume and the IDs in reverse order shares the work: each
  skips what the log holds when a mutation's turn comes)
Exit status: 0 when every mutation that is not GPU-only is caught, 1 when one survives, 2 on an
error of the list or the harness.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")

ATT = "tests/backends/cuda/test_cuda_attention.py"
DEC = "tests/backends/cuda/test_cuda_decode.py"
RES = "tests/backends/cuda/test_cuda_resources.py"

# tests of the mma.sync kernels that every mutation of them should trip over, fast (about 10 s)
RESIDUES = f"{ATT}::test_window_edges_at_every_tile_residue_forward_and_backward"
ONE_SIDED = f"{ATT}::test_one_sided_window_edges_at_every_tile_residue"
SHARED = (f"{ATT}::test_shared_cases_against_float64", "-k",
          "lockstep and fp16 and (gqa or kpm-B2 or causal-B1 or dense or all-gqa or dv)")
BARRIERS = (f"{ATT}::test_barrier_removal_is_caught_under_the_default_schedule",)
DROPOUT = (f"{ATT}::test_dropout_gradients_follow_the_forwards_keep_mask",)
# the forward's keep-mask against a Philox model (no Triton needed)
PHILOX = (f"{ATT}::test_dropout_keep_mask_equals_a_philox_model_without_triton",)
DECODE_CASES = (f"{DEC}::test_decode_against_float64",)
PAGED_CASES = ("tests/backends/cuda/test_cuda_paged.py::test_paged_decode_against_float64_and_the_contiguous_kernel",
               "tests/backends/cuda/test_cuda_paged_prefill.py::test_paged_prefill_against_float64_and_the_contiguous_forward",
               "-k", "gqa4")
FUSED = ("tests/backends/cuda/test_cuda_fused_bwd.py::test_fused_backward_against_float64", "-k", "fp16")
DECODE_D256 = (f"{RES}::test_decode_d256_single_stage_under_a_99_kb_device",)
# LSH attention's per-row positions (AttnParams::q_pos) against float64: a layout (64-row forward, two backward
# passes) and none (128-row forward)
LSH_POSITIONS = ("tests/backends/cuda/test_cuda_lsh.py::test_positions_against_float64", "-k",
                 "fp16 and (layout-cl32 or nolayout-causal)")
# the Hopper forward's pipeline over several key tiles (the TMA kernel; TMA_RING also runs the cp.async one)
PIPELINE = "tests/backends/cuda/test_cuda_wgmma.py::test_hopper_pipeline_over_many_key_tiles"
# the warp-specialized Hopper forward (TMA, mbarrier ring) against float64 and bitwise its cp.async kernel
TMA_RING = ("tests/backends/cuda/test_cuda_hopper_tma.py::test_tma_forward_and_the_cp_async_kernel_against_float64",
            "-k", "dense-5-tiles or causal-kpm")
# the TMA Hopper forward's kAny instance at 128-key tiles: layouts of blocks 64 (two per key tile) and 96 (with key
# padding, NaN values at the padded keys)
TMA_ANY = ("tests/backends/cuda/test_cuda_hopper_tma.py::test_kany_at_128_key_tiles_against_float64", "-k",
           "bs64 or bs96")
# the Hopper backward against float64 (head dim 64: the warpgroups' dQ partials over their keys; GQA, causal)
HOPPER_BWD = ("tests/backends/cuda/test_cuda_hopper_bwd.py::test_hopper_backward_against_float64", "-k",
              "causal-gqa and bf16")
# the 128 x 64 forward tile at head dim 128 (the record, bitwise its 128 x 32 and the general instance, float64)
LONG_KEYS = ("tests/backends/cuda/test_cuda_fwd_rows.py::test_head_dim_128_on_128_x_64_tiles", "-k", "causal")
# a layout of 128-row blocks on 128-row forward tiles (its 64-row tile lists, bitwise the 64-row tiles, float64)
LAYOUT_ROWS = ("tests/backends/cuda/test_cuda_fwd_rows.py::test_layout_tiles_of_128_rows_where_blocks_allow", "-k",
               "bs128-d64")
# layouts of 64-row blocks on 128-row forward tiles (their union lists; partial tiles read the layout per element)
LAYOUT64 = ("tests/backends/cuda/test_cuda_fwd_rows.py::test_layouts_of_64_row_blocks_on_128_row_tiles", "-k",
            "fixed or empty")
# head dim 256 (64 x 32 tiles, TileCopy's two swizzles a thread's copies alternate) and a layout against float64
D256 = "tests/backends/cuda/test_cuda_fwd_rows.py::test_layouts_and_head_dim_256_keep_64_rows"
# the forward's generated instances: which one a call runs, bitwise against the general one
INSTANCES = "tests/backends/cuda/test_cuda_instances.py::test_each_call_runs_its_instance_with_the_general_instances_bits"
# ... and the backward's (fused and two passes)
BWD_INSTANCES = ("tests/backends/cuda/test_cuda_instances.py::"
                 "test_each_backward_runs_its_instance_with_the_general_instances_bits")
# the score terms' constant tiles (const_bias): bitwise against the per-element path, a relative table
TILES = ("tests/backends/cuda/test_cuda_score_tiles.py::test_constant_tiles_bitwise_equal_to_per_element", "-k",
         "relative and not past and causal")


class Mutation(NamedTuple):
    id: str
    file: str                  # relative to csrc/
    old: str                   # must occur exactly once in the file
    new: str
    tests: Tuple[str, ...]     # pytest arguments (node ids, -k expressions)
    what: str
    gpu_only: bool = False


MUTATIONS: List[Mutation] = [
    Mutation("window-left-full-tile", "attention/common.cuh",
             "flo = imax(r1 + p.off - p.left, 0);", "flo = imax(r1 + p.off - p.left - 1, 0);", (ONE_SIDED,),
             "forward / dQ: the left window bound lowered by one in the full-tile test (a one-key leak at one "
             "residue of the tile; the coupled windows of RESIDUES give the 128-row forward no full tile)"),
    Mutation("window-right-full-tile", "attention/common.cuh",
             "fhi = imax(imin(m0 + p.off + p.right + 1, p.Lk), 0);",
             "fhi = imax(imin(m0 + p.off + p.right + 2, p.Lk), 0);", (ONE_SIDED, RESIDUES),
             "forward / dQ: the right window bound raised by one in the full-tile test"),
    Mutation("window-left-full-tile-by-key", "attention/common.cuh",
             "fhi = imax(imin(n0 - p.off + p.left + 1, p.Lq), 0);",
             "fhi = imax(imin(n0 - p.off + p.left + 2, p.Lq), 0);", (RESIDUES,),
             "dK/dV: the query rows that see a whole key tile counted one too far"),
    Mutation("causal-offset", "attention/common.cuh",
             "int pos = i + p.off;", "int pos = i + p.off + 1;", SHARED,
             "the diagonal of causal / window masks shifted by one key"),
    Mutation("padding-mask-ignored", "attention/fwd.cuh",
             "if (KIND == kAny && kpm && (kj >= p.Lk || kpm[kj * p.kpm_l])) x = -INFINITY;",
             "if (KIND == kAny && kpm && kj >= p.Lk) x = -INFINITY;", SHARED,
             "forward: key padding ignored (keys past Lk still masked)"),
    Mutation("gqa-head-index", "attention/fwd.cuh",
             "const int hk = f.h / p.G;", "const int hk = f.h % p.G;", SHARED,
             "forward: a query head reads the wrong KV head under GQA"),
    Mutation("wrong-scale-dk", "attention/bwd.cuh",
             "prim::from_float<BF16>(dk[j][2 * r + e] * p.scale);", "prim::from_float<BF16>(dk[j][2 * r + e]);",
             SHARED, "dK without the softmax scale"),
    Mutation("lse-off", "attention/fwd.cuh",
             "p.lse[q_row(p, b, h, i)] = empty ? -INFINITY : (m + log2f(l)) * 0.6931471805599453f;",
             "p.lse[q_row(p, b, h, i)] = empty ? -INFINITY : (m + log2f(l) + 0.01f) * 0.6931471805599453f;", SHARED,
             "the forward's log-sum-exp off by 0.007 (the backward reads it too)"),
    Mutation("online-softmax-rescale", "attention/fwd.cuh",
             "      acc[j][2 * r] *= alpha[r];\n", "", (f"{ATT}::test_running_max_grows_at_every_key_tile",),
             "forward: half of the output accumulators not rescaled when the row maximum grows"),
    Mutation("delta-sign", "attention/bwd.cuh",
             "return {pd, ok && rule != kPosSelf ? pt * (dp - delta) * dcap : 0.f};",
             "return {pd, ok && rule != kPosSelf ? pt * (dp + delta) * dcap : 0.f};", SHARED,
             "dK/dV and the fused backward: dS^T with the wrong sign of Delta"),
    Mutation("dropout-counters-dkdv", "attention/bwd.cuh",
             "const bool keep = dropout_keep(p, bh, i, kj);", "const bool keep = dropout_keep(p, bh, kj, i);",
             DROPOUT, "dK/dV: the dropout counters of row and key swapped (not the forward's keep-mask)"),
    Mutation("dropout-counters-dq", "attention/bwd.cuh",
             "if (DROP && p.dropout) d = dropout_keep(p, bh, i, kj) ? d * p.inv_keep : 0.f;",
             "if (DROP && p.dropout) d = dropout_keep(p, bh, i, kj + 1) ? d * p.inv_keep : 0.f;", DROPOUT,
             "dQ: the dropout key counter one off"),
    Mutation("dropout-counter-order", "attention/common.cuh",
             "uint32_t(p.drop_q0 + p.q0 + i), uint32_t(p.drop_k0 + p.k0 + j)",
             "uint32_t(p.drop_k0 + p.k0 + j), uint32_t(p.drop_q0 + p.q0 + i)", PHILOX,
             "forward and backward alike: the Philox counters of row and key swapped (the backward still "
             "regenerates the forward's mask; only the Philox model or the Triton kernels tell)"),
    Mutation("barrier-fwd-k", "attention/fwd.cuh",
             "    prim::sync_block();                                  // K ready: every thread's; every warp is done "
             "with V(t-1)\n", "", BARRIERS,
             "forward: no \"K ready\" barrier (K(t) read before every thread's copies landed; V(t) issued over "
             "V(t-1) while warps still read it)"),
    Mutation("barrier-fwd-v", "attention/fwd.cuh",
             "    prim::sync_block();                                  // V ready: every thread's; every warp is done "
             "with K(t)\n", "", BARRIERS,
             "forward: no \"V ready\" barrier (V(t) read before every thread's copies landed; K(t+1) issued over "
             "K(t) while warps still read it)"),
    Mutation("fwd-v-wait", "attention/fwd.cuh",
             "prim::cp_async_wait<0>();                            // V(t): this thread's copies have landed",
             "prim::cp_async_wait<1>();                            // V(t): this thread's copies have landed",
             BARRIERS, "forward: V(t) not waited for before the \"V ready\" barrier (reads the tile in flight)"),
    Mutation("fwd-long-keys-second-half", "attention/fwd.cuh",
             "mma_rows_rows_mb<HD, KS, BF16, MB>(s, sQ, warp * WM, sK + KS * HD, kd);",
             "mma_rows_rows_mb<HD, KS, BF16, MB>(s, sQ, warp * WM, sK, kd);", LONG_KEYS,
             "forward, 128 x 64 tile: the second softmax step's S from the first 32 keys of K"),
    Mutation("fwd-long-keys-pv-rows", "attention/fwd.cuh",
             "mma_a_rows_mb<HD, ND, BF16, MB>(acc, pa[kk], sV, nl / 16 + kk, p.Dv);",
             "mma_a_rows_mb<HD, ND, BF16, MB>(acc, pa[kk], sV, kk, p.Dv);", LONG_KEYS,
             "forward, 128 x 64 tile: the second step's P times the first 32 rows of V"),
    Mutation("fwd-layout-list-row", "attention/fwd.cuh",
             "w.lists = p.lists + int64_t((p.Lq + 63) / 64) * p.list_t;", "w.lists = p.lists;",
             LAYOUT_ROWS, "forward, a layout on 128-row tiles: tile mt reads the lists of 64-row tile mt"),
    Mutation("fwd-layout-wide-check", "attention/fwd.cuh",
             "w.lay_check = p.lay_check || p.lay_bs % 128 != 0;", "w.lay_check = p.lay_check;", LAYOUT64,
             "forward, 64-row blocks on 128-row tiles: partial tiles do not read the layout per element"),
    Mutation("fwd-layout-wide-half", "attention/fwd.cuh",
             "return key_seen(p, lay, kpm, m0, m0 + BM, j);", "return key_seen(p, lay, kpm, m0, m0 + 64, j);", LAYOUT64,
             "forward, 64-row blocks on 128-row tiles: the keys a tile sees from its first 64-row half only (V rows "
             "only the second half sees zeroed)"),
    Mutation("fwd-copy-step", "common/tiles.cuh",
             "const int64_t step = int64_t(RS) * ld;", "const int64_t step = int64_t(RS + 1) * ld;", SHARED,
             "forward K / V copies (TileCopy): a thread's later copies from the wrong rows"),
    Mutation("fwd-copy-swizzle", "common/tiles.cuh",
             "prim::cp_async_16(tile + dst[k % kPeriod] + k * RS * HD,", "prim::cp_async_16(tile + dst[0] + k * RS * HD,",
             (D256,), "forward K / V copies (TileCopy) at head dim 256: odd copies at the even ones' swizzle"),
    Mutation("barrier-dkdv", "attention/bwd.cuh",
             "      prim::sync_block();                                // every warp is done with sQ, sdO, stats\n",
             "", BARRIERS, "dK/dV: no barrier before the next query tile overwrites Q, dO and the row statistics"),
    Mutation("barrier-dq", "attention/bwd.cuh",
             "    prim::sync_block();                                  // every warp is done with sK, sV\n", "",
             BARRIERS, "dQ: no barrier before the next key tile overwrites K and V"),
    Mutation("barrier-fused-ds", "attention/bwd_fused.cuh",
             "    prim::sync_block();                      // dS is whole, this stage's Q and dO are read, the turn "
             "is ours\n", "", BARRIERS + FUSED,
             "fused backward: no barrier between the dS tile's writes and dQ = dS K (and before the next step's "
             "copies overwrite Q, dO)"),
    Mutation("fused-dq-partial-rows", "attention/bwd_fused.cuh",
             "add_dq_fragment<NQ>(p, b, h, m0 + r0 + g, c0, t4, dq);", "add_dq_fragment<NQ>(p, b, h, m0 + g, c0, t4, dq);", FUSED,
             "fused backward: every warp adds its dQ partial into the first warp's rows of the accumulator"),
    Mutation("fused-semaphore-index", "attention/bwd_fused.cuh",
             "sem = p.dq_sem + (int64_t(seg) * p.H + h) * n_mt + mt;",
             "sem = p.dq_sem + (int64_t(seg) * p.H + h) * n_mt;", FUSED,
             "dQ turns (DqTurn, the fused and the Hopper backward): one semaphore for all query tiles of a head (the "
             "turns no longer match: a deadlock on a GPU, an emulator failure here)"),
    Mutation("barrier-fused-stage", "attention/bwd_fused.cuh",
             "    prim::sync_block();\n    dqt.pass_on(tid);", "    dqt.pass_on(tid);",
             BARRIERS + FUSED, "fused backward: no barrier at a step's start (Q / dO of other threads' copies unseen, "
             "dS of the previous step overwritten while warps still read it for dQ)"),
    Mutation("fused-prefetch-stage", "attention/bwd_fused.cuh",
             "if (u + 1 < total) issue(u + 1, stage ^ 1);", "if (u + 1 < total) issue(u + 1, stage);", FUSED,
             "fused backward: the next step's Q / dO copied into the buffers this step reads"),
    Mutation("fused-window-as-causal", "attention/bwd_fused.cuh",
             "visible_kind<KIND == kCausal ? kCausal : kWindow>", "visible_kind<kCausal>", FUSED,
             "fused backward: the window and padding instances test partial tiles with the causal rule"),
    Mutation("bwd-dropout-code-always", "attention/bwd.cu",
             "bool drop = p.dropout != 0;", "bool drop = true;", (BWD_INSTANCES,),
             "backward dispatch: calls without dropout run the instance with the Philox code"),
    Mutation("bwd-dense-drops-masks", "attention/bwd.cuh",
             "const bool masked = KIND != kDense && sched.masked(it);   // kDense: every tile is full",
             "const bool masked = KIND == kAny && sched.masked(it);   // kDense: every tile is full",
             (BWD_INSTANCES, "-k", "layout"),
             "dK/dV pass: the layout instance (the only kind but kAny with its own two passes: dense, causal and "
             "window calls take kAny's) takes every query tile as full"),
    Mutation("fused-stage-wait", "attention/bwd_fused.cuh",
             "prim::cp_async_wait<1>();                // step u's group (and K, V) landed",
             "prim::cp_async_wait<2>();                // step u's group (and K, V) landed", FUSED,
             "fused backward: a wait count one too high (reads the Q / dO tile still in flight)"),
    Mutation("decode-padding-ignored", "attention/decode_kernels.cuh",
             "if (kpm && (kj >= p.Lk || kpm[kj * p.kpm_l])) x = -INFINITY;", "if (kpm && kj >= p.Lk) x = -INFINITY;",
             DECODE_CASES + ("-k", "key-padding"), "decode: key padding ignored"),
    Mutation("decode-wait-count", "attention/decode_kernels.cuh",
             "prim::cp_async_wait<1>();                     // tile it has landed",
             "prim::cp_async_wait<2>();                     // tile it has landed",
             DECODE_CASES + ("-k", "dense or causal"), "decode: a wait count one too high (reads the tile in flight)"),
    Mutation("decode-single-stage-wait", "attention/decode_kernels.cuh",
             "prim::cp_async_wait<0>();                     // one stage",
             "prim::cp_async_wait<1>();                     // one stage", DECODE_D256,
             "decode, single-buffered (head dim 256 on a 99 KB GPU): the tile's copies not waited for"),
    Mutation("dense-routed-to-any", "attention/common.cuh",
             "  return kDense;\n}", "  return kAny;\n}", (INSTANCES,),
             "forward dispatch: a dense call runs the general instance (every mask and padding test compiled in)"),
    Mutation("dropout-code-always", "attention/fwd.cu",
             "bool drop = p.dropout != 0;", "bool drop = true;", (INSTANCES,),
             "forward dispatch: calls without dropout run the instance with the Philox code"),
    Mutation("causal-kind-diagonal", "attention/common.cuh",
             "return i < p.Lq && j < p.Lk && j <= i + p.off;", "return i < p.Lq && j < p.Lk && j <= i + p.off + 1;",
             SHARED, "the causal instance's diagonal one key too far (its own test, not `visible`'s)"),
    Mutation("const-tile-fwd", "attention/fwd.cuh",
             "x += cfast ? cb : bias_terms(p, br, i, kj)", "x += cfast ? 0.f : bias_terms(p, br, i, kj)", TILES,
             "forward: a constant tile's terms dropped (the constant path is taken and must add them)"),
    Mutation("const-tile-dkdv", "attention/bwd.cuh",
             "TERMS ? (cfast ? cb : s_bias[", "TERMS ? (cfast ? 0.f : s_bias[", TILES,
             "dK/dV pass: a constant tile's terms dropped"),
    Mutation("const-tile-dq", "attention/bwd.cuh",
             "x += cfast ? cb : bias_terms(p, br, i, kj)", "x += cfast ? 0.f : bias_terms(p, br, i, kj)", TILES,
             "dQ pass: a constant tile's terms dropped"),
    Mutation("const-tile-clip", "attention/common.cuh",
             "if (br.rel && rel_index(p, d_lo) != rel_index(p, d_hi)) return false;", "", TILES,
             "a tile that reads several table entries taken as constant (the first element's entry)"),
    Mutation("paged-page-index", "attention/paged.cuh",
             "return base + int64_t(bt[t / page_size]) * page_stride",
             "return base + int64_t(bt[(t + 1) / page_size]) * page_stride",
             PAGED_CASES, "paged decode and prefill: rows read from the next key's page"),
    Mutation("relk-skew-off-by-one", "attention/fwd.cuh",
             "const float v = w[ri * NB + ri + SH - c];", "const float v = w[ri * NB + ri + SH + 1 - c];",
             ("tests/backends/cuda/test_cuda_relative.py::test_relative_forward_against_float64", "-k", "txl"),
             "relative keys: the relative shift one distance off"),
    Mutation("relk-bwd-band-skew", "attention/relkeys_bwd.cuh",
             "w[ri * WB + ri + BN - 1 - jl] = s[j][e];", "w[ri * WB + ri + BN - jl] = s[j][e];",
             ("tests/backends/cuda/test_cuda_relative.py::test_relative_backward_against_float64", "-k", "txl"),
             "relative keys, backward: dT skewed into the band one distance off (the query's gradient)"),
    Mutation("relk-bwd-distance-band", "attention/relkeys_bwd.cuh",
             "const int jb0 = i0 + p.off - (d0 + BD - 1);", "const int jb0 = i0 + p.off - (d0 + BD);",
             ("tests/backends/cuda/test_cuda_relative.py::test_relative_backward_against_float64", "-k", "txl"),
             "relative keys, backward: the distance pass's key band one key off (r's gradient)"),
    Mutation("lsh-bwd-self-score-gradient", "attention/bwd.cuh",
             "return {pd, ok && rule != kPosSelf ? pt * (dp - delta) * dcap : 0.f};",
             "return {pd, ok ? pt * (dp - delta) * dcap : 0.f};", LSH_POSITIONS,
             "positions (LSH), dK/dV pass: the constant self score passes a gradient to k (a row that sees only "
             "itself, with a gradient into its lse)"),
    Mutation("lsh-causal-compare-flipped", "attention/common.cuh",
             "if (kp < 0 || (p.pos_causal && kp > qp)) return kPosHidden;",
             "if (kp < 0 || (p.pos_causal && kp < qp)) return kPosHidden;", LSH_POSITIONS,
             "positions (LSH): causal hides the earlier keys instead of the later ones"),
    Mutation("lsh-self-score-dropped", "attention/common.cuh",
             "return kp == qp ? kPosSelf : kPosScore;", "return kPosScore;", LSH_POSITIONS,
             "positions (LSH): a query's own key scores q.k instead of the self-attention penalty"),
    Mutation("swizzle-dropped", "common/tiles.cuh",
             "return row * HD + ((chunk ^ ((row / kRowsPerLine) & kXorMask)) << 3);", "return row * HD + (chunk << 3);",
             (f"{ATT}::test_ldmatrix_one_wavefront_per_phase_in_every_kernel",),
             "tiles without the XOR swizzle: still correct, 8-way bank conflicts (a speed bug)"),
    Mutation("hopper-k-buffer", "attention/fwd_sm90.cuh",
             "kv_copy.load(sK + ((it + 1) & 1) * BN * HD,", "kv_copy.load(sK + (it & 1) * BN * HD,", (PIPELINE,) + TMA_RING,
             "Hopper forward: K(t + 1) copied into the buffer S(t) reads"),
    Mutation("hopper-v-buffer", "attention/fwd_sm90.cuh",
             "TKV::desc_mn(aV + (it & 1) * kKVBytes, kk)", "TKV::desc_mn(aV + ((it + 1) & 1) * kKVBytes, kk)",
             (PIPELINE,) + TMA_RING, "Hopper forward: P V(t) reads the other V buffer (V(t + 1), in flight)"),
    Mutation("hopper-wait-s", "attention/fwd_sm90.cuh",
             "prim::wgmma_wait<1>();                             // S(t) has retired",
             "prim::wgmma_wait<2>();                             // S(t) has retired", (PIPELINE,) + TMA_RING,
             "Hopper forward: the softmax reads S(t) before its wgmma retired"),
    Mutation("hopper-barrier", "attention/fwd_sm90.cuh",
             "    prim::sync_block();                                  // ... and every thread's\n", "", (PIPELINE,) + TMA_RING,
             "Hopper forward: no barrier at a step's start (copies of other threads unseen, buffers still read)"),
    Mutation("hopper-tma-full-wait", "attention/fwd_sm90_tma.cuh",
             "if (it < n_tiles) prim::mbar_wait(full + (it & 1), (it >> 1) & 1);", "", TMA_RING,
             "TMA Hopper forward: the consumers do not wait on the stage's full barrier (K, V read before they land)"),
    Mutation("hopper-tma-expect-bytes", "attention/fwd_sm90_tma.cuh",
             "prim::mbar_arrive_expect_tx(full + s, 2 * Cfg::kKVBytes);",
             "prim::mbar_arrive_expect_tx(full + s, Cfg::kKVBytes);", TMA_RING,
             "TMA Hopper forward: expect_tx of the K tile's bytes only (the phase would complete before V landed)"),
    Mutation("hopper-tma-empty-parity", "attention/fwd_sm90_tma.cuh",
             "prim::mbar_wait(empty + s, ((it >> 1) & 1) ^ 1);", "prim::mbar_wait(empty + s, (it >> 1) & 1);",
             TMA_RING, "TMA Hopper forward: the producer waits on the wrong parity of a stage's empty barrier"),
    Mutation("hopper-tma-empty-stage", "attention/fwd_sm90_tma.cuh",
             "prim::mbar_arrive(empty + ((it - 1) & 1));", "prim::mbar_arrive(empty + (it & 1));", TMA_RING,
             "TMA Hopper forward: the consumers release the stage still in use, not the retired one"),
    Mutation("hopper-bwd-wait-dp", "attention/bwd_sm90.cuh",
             "    prim::wgmma_wait<0>();\n    keep_all(st);", "    prim::wgmma_wait<1>();\n    keep_all(st);", HOPPER_BWD,
             "Hopper backward: P^T and dS^T computed before the wgmma of dP^T retired"),
    Mutation("hopper-bwd-proxy-fence", "attention/bwd_sm90.cuh",
             "    prim::fence_proxy_async();               // this thread's dS stores visible to wgmma\n",
             "", HOPPER_BWD,
             "Hopper backward: dQ's wgmma reads the dS tile (plain st.shared through prim::st_shared) without "
             "fence.proxy.async; the emulation's proxy rule (emu/wgmma.h) aborts the run"),
    Mutation("hopper-bwd-sem-turn", "attention/bwd_fused.cuh",
             "if (held && tid == 0) prim::sem_release(held, held_turn + 1);",
             "if (held && tid == 0) prim::sem_release(held, held_turn);", HOPPER_BWD,
             "dQ turns (DqTurn, the Hopper and the fused backward): a block does not pass its dQ turn on (the next key "
             "tile would wait forever)"),
    Mutation("hopper-bwd-tma-expect-bytes", "attention/bwd_sm90.cuh",
             "prim::mbar_arrive_expect_tx(full + s, 2 * Cfg::kQBytes);",
             "prim::mbar_arrive_expect_tx(full + s, Cfg::kQBytes);", HOPPER_BWD,
             "Hopper backward: expect_tx of Q's bytes only (a stage's phase would complete before dO landed)"),
    Mutation("hopper-bwd-tma-empty-parity", "attention/bwd_sm90.cuh",
             "prim::mbar_wait(empty + s, ((u / S) & 1) ^ 1);", "prim::mbar_wait(empty + s, (u / S) & 1);", HOPPER_BWD,
             "Hopper backward: the producer waits on the wrong parity of a stage's empty barrier"),
    Mutation("hopper-bwd-tma-full-wait", "attention/bwd_sm90.cuh",
             "    prim::mbar_wait(full + stage, (u / S) & 1);   // step u's Q, dO, lse, Delta have landed\n", "",
             HOPPER_BWD,
             "Hopper backward: the consumers do not wait on the stage's full barrier (Q, dO, lse, Delta read before "
             "they land)"),
    Mutation("hopper-bwd-stats-arrive", "attention/bwd_sm90.cuh",
             "      } else {\n        prim::mbar_arrive(full + s);\n      }\n", "      }\n", HOPPER_BWD,
             "Hopper backward: only the producer's lane 0 arrives on full (a phase of 32 arrivals never completes: "
             "the other lanes' lse, Delta unpublished)"),
    Mutation("hopper-bwd-dq-keys", "attention/bwd_sm90.cuh",
             "const int kk0 = kSplitKeys ? wg * (BN / 32) : 0;", "const int kk0 = 0;", HOPPER_BWD,
             "Hopper backward, head dim 64: both warpgroups' dQ partials reduce over the first 64 keys"),
    Mutation("hopper-bwd-unseen-keys", "attention/bwd_sm90.cuh",
             "if (KIND != kDense && (p.left >= 0 || p.right >= 0))", "if (false)",
             ("tests/backends/cuda/test_cuda_hopper_bwd.py::test_keys_no_row_sees_holding_nan_change_nothing",),
             "Hopper backward: K rows of keys no row sees not zeroed (dQ = dS K adds 0 * NaN)"),
    Mutation("hopper-pingpong-sync", "attention/fwd_sm90.cuh",
             "EFFATTN_DEVICE void wait_turn() const { prim::named_sync(kFirst + w, kThreads); }",
             "EFFATTN_DEVICE void wait_turn() const {}", TMA_RING,
             "TMA Hopper forward: a consumer warpgroup issues its wgmmas without waiting for its turn (the ping-pong's "
             "bar.sync removed: the other's bar.arrive counted twice in one phase)"),
    Mutation("hopper-pingpong-last-arrive", "attention/fwd_sm90.cuh",
             "if (w == 0 || !last) prim::named_arrive(", "if (true) prim::named_arrive(", TMA_RING,
             "TMA Hopper forward: warpgroup 1 passes the turn after its last issue too (an arrival no bar.sync "
             "consumes)"),
    Mutation("hopper-tma-key-box", "attention/fwd_sm90.cu",
             "head_rows_map(tp.k, p.k, p.k_l, p.k_h, p.k_b, p.k0, p.D, p.Lk, hkv, p.B, Cfg::BN)",
             "head_rows_map(tp.k, p.k, p.k_l, p.k_h, p.k_b, p.k0, p.D, p.Lk, hkv, p.B, 64)", TMA_RING,
             "TMA Hopper forward: K's box of 64 rows under 128-key tiles (half of K(t) never lands)"),
    Mutation("hopper-tma-any-key-tile", "attention/fwd_sm90_tma.cuh",
             "constexpr int kFwdTmaKeyTile = 128;", "constexpr int kFwdTmaKeyTile = 64;", TMA_ANY,
             "TMA Hopper forward: the kernel (and its maps) at 64-key tiles while the host builds a layout's lists "
             "for 128-key tiles (kAny reads the wrong key tiles)"),
    Mutation("hopper-tma-unseen-keys", "attention/fwd_sm90_tma.cuh",
             "if (it > 0 && (KIND != kDense && sched.masked(it - 1) || kpm)) {", "if (false) {", TMA_ANY,
             "TMA Hopper forward: V rows of keys no row sees not zeroed (P V adds 0 * NaN at padded keys)"),
    Mutation("launch-optin-threshold", "attention/launch.cuh",
             "if (smem > 48 * 1024) {", "if (smem > 96 * 1024) {", (),
             "the real launcher asks for opt-in shared memory only above 96 KB: kernels of 48-96 KB fail to "
             "launch on a GPU", gpu_only=True),
    Mutation("ptx-wait-group", "common/prims.cuh",
             'asm volatile("cp.async.wait_group %0;\\n" ::"n"(N));',
             'asm volatile("cp.async.wait_group %0;\\n" ::"n"(N + 1));', (),
             "the PTX wait_group one too high: a race only real asynchronous copies show", gpu_only=True),
]
BY_ID: Dict[str, Mutation] = {m.id: m for m in MUTATIONS}
# what CI runs: a removed barrier (bwd.cu rebuilt) and the decode's wait count (decode.cu), about 50 s of
# CPU each; a mutation of common.cuh rebuilds every attention unit (the window bounds: the full run)
FAST = ("barrier-dq", "decode-wait-count")


class ListError(Exception):
    """The mutation list no longer fits the sources, or the harness could not run."""


def apply(m: Mutation, csrc: str) -> None:
    """Applies `m` to the copy of csrc/ at `csrc`; ListError unless its pattern occurs exactly once."""
    path = os.path.join(csrc, m.file)
    if not os.path.exists(path):
        raise ListError(f"{m.id}: {m.file} does not exist under csrc/")
    with open(path) as f:
        text = f.read()
    n = text.count(m.old)
    if n != 1:
        raise ListError(f"{m.id}: its pattern occurs {n} times in csrc/{m.file} (must be exactly once): "
                        f"{m.old.strip()!r}")
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))


def _env(csrc: str) -> dict:
    # EFFATTN_LONG=1: a test of the long run (conftest.py's LONG_RUN) that a mutation names runs, not skips
    env = dict(os.environ, EFFATTN_CSRC=csrc, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               COLUMNS="400", EFFATTN_LONG="1")  # COLUMNS: pytest's summary lines keep the failure's message
    env.pop("EFFATTN_CUDA_EMU", None)
    return env


def build(csrc: str) -> None:
    """Builds the emulated kernels of the copy at `csrc` (ListError with the compiler's message)."""
    res = subprocess.run([sys.executable, "-c", "from effattn.backends.cuda import _ext; _ext.build_kernels()"],
                         cwd=ROOT, env=_env(csrc), capture_output=True, text=True)
    if res.returncode:
        raise ListError(f"the mutated sources do not compile:\n{res.stderr[-3000:]}")


_FAILED = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$", re.M)
_COUNTS = re.compile(r"(\d+) (passed|skipped|deselected|xfailed|xpassed)")
CAUGHT, SURVIVED, GPU_ONLY, ERROR = "caught", "survived", "gpu-only", "error"


class Result(NamedTuple):
    mutation: Mutation
    status: str                # CAUGHT, SURVIVED, GPU_ONLY or ERROR (the harness could not judge it)
    detail: str                # the failing test's message, or why it is an error
    seconds: float
    test: str = ""             # the first test that failed (CAUGHT)
    load: float = -1.0         # the 1-minute load average when the mutation started


def run_one(m: Mutation, timeout: float = 1800) -> Result:
    """Applies, builds and tests `m`; ListError when its pattern does not apply, its copy does not
    compile, its tests run past `timeout` seconds or pytest stops for another reason than a failure."""
    start, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix=f"effattn-mutant-{m.id}-") as tmp:
        csrc = os.path.join(tmp, "csrc")
        shutil.copytree(CSRC, csrc, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
        apply(m, csrc)
        if m.gpu_only:
            return Result(m, GPU_ONLY, "pattern applies; the emulation does not compile this code",
                          time.perf_counter() - start, load=load)
        build(csrc)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rfEs", "--no-header", "-p", "no:randomly", *m.tests]
        try:
            res = subprocess.run(cmd, cwd=ROOT, env=_env(csrc), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ListError(f"{m.id}: its tests ran past {timeout:.0f} s") from None
    seconds = time.perf_counter() - start
    out = res.stdout + res.stderr
    if res.returncode == 0:
        counts = dict((w, int(n)) for n, w in _COUNTS.findall(out.strip().splitlines()[-1] if out.strip() else ""))
        if not counts.get("passed"):
            raise ListError(f"{m.id}: no test ran (every one skipped or deselected):\n{out[-2000:]}")
        skipped = f", {counts['skipped']} skipped" if counts.get("skipped") else ""
        return Result(m, SURVIVED, f"every test passed ({counts['passed']}{skipped})", seconds, load=load)
    if res.returncode != 1:     # 2: interrupted / collection error, 4: usage, 5: no tests ran, < 0: a signal
        raise ListError(f"{m.id}: pytest exited with {res.returncode} (not a test failure):\n{out[-3000:]}")
    hit = _FAILED.search(out)
    if hit is None:
        raise ListError(f"{m.id}: pytest failed without a FAILED / ERROR line:\n{out[-3000:]}")
    return Result(m, CAUGHT, (hit.group(3) or "").strip()[:300], seconds, hit.group(2), load)


def run(ids: Sequence[str], out=sys.stdout, timeout: float = 1800, on_result=None, skip=None) -> List[Result]:
    """Runs the mutations `ids` one after another, printing a line per mutation (and passing each
    result to `on_result`; those `skip(id)` is true of when their turn comes are left out). A mutation
    the harness cannot judge (`ListError`) is an ERROR result and the run goes on to the next one."""
    results = []
    for i in ids:
        if skip is not None and skip(i):
            continue
        m = BY_ID[i]
        try:
            r = run_one(m, timeout)
        except ListError as e:
            r = Result(m, ERROR, str(e), 0.0, load=os.getloadavg()[0])
        results.append(r)
        where = f"{r.test}: " if r.test else ""
        print(f"{r.status:8s} {m.id:30s} {r.seconds:6.1f} s  load {r.load:4.1f}  {where}{r.detail.splitlines()[0]}",
              file=out, flush=True)
        if on_result is not None:
            on_result(r)
    return results


# ---- the log (resume) and the markdown report ------------------------------------------------------

def _git(*args: str) -> str:
    res = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else ""


def _digest_files(paths: Sequence[str]) -> str:
    digest = hashlib.sha1()
    for path in sorted(set(paths)):
        digest.update(os.path.relpath(path, ROOT).encode() + b"\0")
        if os.path.exists(path):
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def sources_key() -> str:
    """A hash of csrc/'s kernel sources (what every mutant is built from)."""
    return _digest_files([os.path.join(d, f) for d, _, fs in os.walk(CSRC) for f in fs
                          if f.endswith((".h", ".cuh", ".cu", ".cpp"))])


def key(m: Mutation, sources: str) -> str:
    """What a logged result of `m` stands for: the kernel sources, the mutation and the tests it names
    (the commit of the run is logged beside it: a test file changed since shows there)."""
    return hashlib.sha1(repr((sources, m.file, m.old, m.new, m.tests)).encode()).hexdigest()[:16]


def read_log(path: Optional[str]) -> Dict[str, dict]:
    """The latest logged record of each mutation id in the JSON-lines log at `path`."""
    records: Dict[str, dict] = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    records[rec["id"]] = rec
    return records


def record(r: Result, sources: str) -> dict:
    return {"id": r.mutation.id, "status": r.status, "test": r.test, "detail": r.detail,
            "seconds": round(r.seconds, 1), "load": round(r.load, 2), "key": key(r.mutation, sources),
            "commit": _git("rev-parse", "--short=12", "HEAD"),
            "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def report(ids: Sequence[str], records: Dict[str, dict], sources: str, command: str) -> str:
    """The markdown report of the mutations `ids` from their logged `records` (a record made from
    other sources, or before its tests changed, counts as not run)."""
    rows, count = [], {CAUGHT: 0, SURVIVED: 0, GPU_ONLY: 0, ERROR: 0, "not run": 0}
    recs = []
    for n, i in enumerate(ids, 1):
        m = BY_ID[i]
        rec = records.get(i)
        if rec is None or rec["key"] != key(m, sources):
            rec = None
        status = rec["status"] if rec else "not run"
        count[status] += 1
        if rec:
            recs.append(rec)
        by = f"`{rec['test'].split('/')[-1]}`: {_cell(rec['detail'])[:160]}" if rec and rec["test"] else \
            _cell(rec["detail"])[:200] if rec else ""
        secs = f"{rec['seconds']:.0f}" if rec and status != GPU_ONLY else ""
        load = f"{rec['load']:.1f}" if rec else ""
        rows.append(f"| {n} | `{i}` | `{m.file}` | {'**' + status + '**' if status in (SURVIVED, ERROR) else status} "
                    f"| {by} | {secs} | {load} | {rec['commit'] if rec else ''} | {_cell(m.what)} |")
    judged = len(ids) - count[GPU_ONLY] - count["not run"]
    whens = sorted(r["when"] for r in recs)
    commits = sorted({r["commit"] for r in recs})
    loads = [r["load"] for r in recs]
    total = sum(r["seconds"] for r in recs)
    head = [
        "# Mutation run of the CUDA kernels (`csrc/emu/mutate.py`)",
        "",
        f"Written by `{command}` from the results its runs logged (`--log`; the list and the harness: "
        f"csrc/README.md, \"Mutation run\").",
        "",
        f"- Run: {whens[0] + ' to ' + whens[-1] if whens else 'nothing run yet'}, commit(s) {', '.join(commits) or '-'}, "
        f"kernel sources' hash `{sources}`.",
        f"- Machine: {os.cpu_count()} cores shared with other jobs; the 1-minute load average when each mutation "
        f"started: {min(loads):.1f} to {max(loads):.1f} (column *load*). Seconds are wall time under that load "
        f"(copy, rebuild of the units that include the mutated file, the tests): {total / 60:.0f} min summed over the "
        f"mutations (runs sharing a log go side by side)."
        if loads else "- Machine: -",
        f"- Result: {count[CAUGHT]} of {judged} emulated mutations caught, {count[SURVIVED]} survived, "
        f"{count[ERROR]} errors of the harness; {count[GPU_ONLY]} GPU-only (pattern checked, nvcc-only code: "
        f"tests/backends/cuda/test_cuda_gpu.py on a GPU); {count['not run']} not run.",
        "",
        "| # | mutation | file (csrc/) | result | caught by (first failing test: message) | s | load | commit | the bug |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + rows) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ids", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--fast", action="store_true", help=f"only the CI subset {FAST}")
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    ap.add_argument("--log", help="append each result to this JSON-lines file (what --resume and --report read)")
    ap.add_argument("--resume", action="store_true",
                    help="skip the mutations --log already holds a result of for today's sources and test ids")
    ap.add_argument("--report", help="write a markdown report of the selected mutations here (after each one)")
    ap.add_argument("--report-only", action="store_true", help="write --report from --log and run nothing")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one mutation's tests may run (1800)")
    args = ap.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.id:30s} {m.file:32s} {'GPU-only ' if m.gpu_only else ''}{m.what}")
        return 0
    unknown = [i for i in args.ids if i not in BY_ID]
    if unknown:
        print(f"unknown mutations {unknown}; known: {sorted(BY_ID)}", file=sys.stderr)
        return 2
    if (args.resume or args.report_only) and not args.log or args.report_only and not args.report:
        print("--resume needs --log; --report-only needs --log and --report", file=sys.stderr)
        return 2
    ids = list(FAST) if args.fast else (args.ids or [m.id for m in MUTATIONS])
    sources = sources_key()
    records = read_log(args.log)
    # the report covers the selection, or the whole list when the log holds more (a run resumed in parts)
    shown = [m.id for m in MUTATIONS] if args.report and not args.ids and not args.fast else ids
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python3 csrc/emu/mutate.py"] + [os.path.basename(a) if os.sep in a else a for a in given])

    def on_result(r: Result) -> None:
        rec = record(r, sources)
        records[rec["id"]] = rec
        if args.log:
            with open(args.log, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if args.report:
            with open(args.report, "w") as f:
                f.write(report(shown, records, sources, command))

    def done(i: str) -> bool:
        """Whether the log holds a result of `i` for today's sources and test ids (re-read before each
        mutation: another run on the same log, e.g. one going through the list from its end, may have
        done it meanwhile)."""
        if not args.resume:
            return False
        records.update(read_log(args.log))
        rec = records.get(i)
        return rec is not None and rec["key"] == key(BY_ID[i], sources) and rec["status"] != ERROR

    skipped = sum(map(done, ids))
    if skipped:
        print(f"resuming: {skipped} of the {len(ids)} mutations already in {args.log}", flush=True)
    if not args.report_only:
        run(ids, timeout=args.timeout, on_result=on_result, skip=done)
    records.update(read_log(args.log))
    if args.report:
        with open(args.report, "w") as f:
            f.write(report(shown, records, sources, command))
    results = [records[i] for i in ids if i in records and records[i]["key"] == key(BY_ID[i], sources)]
    survived = [r["id"] for r in results if r["status"] == SURVIVED]
    errors = [r["id"] for r in results if r["status"] == ERROR]
    caught = sum(r["status"] == CAUGHT for r in results)
    gpu = sum(r["status"] == GPU_ONLY for r in results)
    print(f"\n{caught} of {len(results) - gpu} caught by the emulation tests; {gpu} GPU-only; "
          f"survived: {', '.join(survived) or 'none'}; errors: {', '.join(errors) or 'none'}")
    return 2 if errors else 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
