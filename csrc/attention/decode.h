// Split-KV decode: the parameter block and entry point of the kernels for a few query rows
// (Lq <= 16) against a long key/value cache. No torch here; the binding fills it.
//
// Work split (flash-decoding): one thread block per (batch, KV head, 16-row tile of packed rows,
// split of the key range). The G = H / Hkv query heads that share a KV head and their Lq rows are
// packed into the rows of one mma tile (packed row r = g * Lq + i: head hk * G + g, query i), so
// K and V are read once per KV head, not once per query head. The visible key tiles (the same
// schedule as the forward: analytic for windows, the packed tile lists for layouts) are cut into
// `splits` runs of ceil(count / splits) tiles; each block writes its rows' fp32 partial output and
// log-sum-exp, and a second kernel merges the splits with log-sum-exp weights. With one split the
// first kernel writes the output directly.
#pragma once

#include "attention/paged.h"

namespace effattn {

struct DecodeParams {
  AttnParams a;                  // q, k, v, masks, sizes as for the forward; a.o / a.lse: the final output
  float* part_o;                 // (B * H * Lq, splits, Dv_out) fp32 split outputs, null when splits == 1
  float* part_lse;               // (B * H * Lq, splits) fp32 split log-sum-exp, base 2; -inf: saw no key
  int splits;                    // key-range splits per (batch, KV head, row tile)
  int rows;                      // packed rows per KV head: G * Lq
  int row_tiles;                 // ceil(rows / kDecodeRows)
  int mask_full;                 // full tiles are masked too (tile lists of a layout OR-ed over a GQA group)
  int stages;                    // K/V buffers: 2 (the next tile's copies in flight), or 1 at head dim 256
                                 // where 2 exceed the GPU's shared memory (decode_smem_bytes)
  PagedKV kv;                    // paged keys/values (paged.h; kv.block_table null: the contiguous a.k / a.v)
};

constexpr int kDecodeRows = 16;      // packed rows per block (one m16n8k16 tile)
constexpr int kDecodeBlockN = 64;    // keys per tile: 16 per warp
constexpr int kDecodeMaxQueries = 16;

// Shared memory of the split kernel per block for a head-dim bucket and stage count: (16 + 2 x 64
// stages) x HD x 2 bytes (136 KB at head dim 256 with two stages, more than the 99 KB of sm_86 / sm_89 /
// sm_120; 72 KB with one). effattn/backends/cuda/resources.py carries the same sizes.
constexpr int decode_smem_bytes(int hd, int stages) { return (kDecodeRows + stages * 2 * kDecodeBlockN) * hd * 2; }

// Launches the split kernel and, with more than one split, the combine kernel. Return 0 or a CUDA
// error code (-1: no kernel for these head dims).
int attention_decode(const DecodeParams& p, bool bf16, void* stream);

}  // namespace effattn
