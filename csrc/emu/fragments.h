// Which element of a tile each lane's register holds, for the warp-wide operations the kernels use
// (PTX ISA, "Warp-level matrix fragments": mma.m16n8k16 with 16-bit inputs, and ldmatrix m8n8).
// Lane l is in group g = l / 4 at position t = l % 4 of its group. A 32-bit register holds two
// 16-bit elements, element e = 0 in the low half. Used by the emulation only; tests check these
// maps against the ISA's tables written out independently.
#pragma once

namespace effattn {
namespace emu {

// A (16 x 16, row-major), registers a0..a3: rows g (a0, a2) / g + 8 (a1, a3), columns 2t + e,
// plus 8 for a2, a3.
inline void mma_a_element(int lane, int reg, int e, int& row, int& col) {
  row = (lane >> 2) + 8 * (reg & 1);
  col = 2 * (lane & 3) + e + 8 * (reg >> 1);
}

// B (16 x 8, k x n), registers b0, b1: k = 2t + e (+ 8 for b1), n = g.
inline void mma_b_element(int lane, int reg, int e, int& row, int& col) {
  row = 2 * (lane & 3) + e + 8 * reg;
  col = lane >> 2;
}

// C / D (16 x 8, fp32), c0..c3: row g (c0, c1) / g + 8 (c2, c3), column 2t + (i & 1).
inline void mma_c_element(int lane, int i, int& row, int& col) {
  row = (lane >> 2) + 8 * (i >> 1);
  col = 2 * (lane & 3) + (i & 1);
}

// ldmatrix m8n8.b16: lane l holds row g, columns 2t + e of each 8 x 8 matrix; with .trans the
// transposed matrix's, i.e. row 2t + e, column g of the matrix as stored.
inline void ldmatrix_element(int lane, int e, bool trans, int& row, int& col) {
  if (trans) {
    row = 2 * (lane & 3) + e;
    col = lane >> 2;
  } else {
    row = lane >> 2;
    col = 2 * (lane & 3) + e;
  }
}

// wgmma.m64nNk16 (PTX ISA, "Register Fragments" of wgmma): a warpgroup of 4 warps; warp w holds
// rows [16 w, 16 w + 16). Thread `tid` of the warpgroup is lane tid % 32 of warp tid / 32.
// D (64 x N, fp32), d_i for i < N / 2: row 16 w + g (+ 8 when bit 1 of i is set), column
// 8 (i / 4) + 2 t + (i & 1): N / 8 copies of the m16n8 C fragment side by side.
inline void wgmma_d_element(int tid, int i, int& row, int& col) {
  row = 16 * (tid >> 5) + ((tid & 31) >> 2) + 8 * ((i >> 1) & 1);
  col = 8 * (i >> 2) + 2 * (tid & 3) + (i & 1);
}

// A (64 x 16) from registers, 16-bit elements: each warp's 16 rows as the m16n8k16 A fragment.
inline void wgmma_a_element(int tid, int reg, int e, int& row, int& col) {
  mma_a_element(tid & 31, reg, e, row, col);
  row += 16 * (tid >> 5);
}

}  // namespace emu
}  // namespace effattn
