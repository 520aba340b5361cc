// Helpers the csrc/emu self-test programs share (host only: selftest.cpp, selftest_sm90.cpp,
// linear_selftest.cpp, built with g++ -DEFFATTN_CUDA_EMU).
#pragma once

#include <cstdio>
#include <cstdlib>

namespace effattn {
namespace selftest {

// An exact-size heap buffer: one element past the end is a sanitizer report.
template <class T>
T* heap(size_t n) {
  return static_cast<T*>(std::malloc(n * sizeof(T) + (n == 0)));
}

// Prints "TAG who reg e row col" for each register `reg` < regs and half `e` < 2 of thread `who`
// in a fragment map: elem(reg, e, row, col) sets where that element sits in the tile.
template <class Elem>
void print_pairs(const char* tag, int who, int regs, Elem elem) {
  for (int reg = 0; reg < regs; ++reg)
    for (int e = 0; e < 2; ++e) {
      int r, c;
      elem(reg, e, r, c);
      std::printf("%s %d %d %d %d %d\n", tag, who, reg, e, r, c);
    }
}

}  // namespace selftest
}  // namespace effattn
