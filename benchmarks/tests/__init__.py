"""Tests of the benchmarks: the sweep, the GPU suite (on the CPU: its plan, --dry-run, --smoke), LRA,
and the kernel micro-benchmarks."""
