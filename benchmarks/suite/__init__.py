"""The GPU benchmark suite: fixed shapes in priority order, each section within a time budget, the
baselines in the same run (``python -m benchmarks.suite``; benchmarks/README.md).

Modules, each importing only those before it: kernels.py (the Triton kernel variants a suite
launches, planned on meta tensors and compiled in a process pool), explore.py (autotune timings and
the re-check of tuned configs against the float64 oracle), sections.py (the suites, their sections
and the plan ``--dry-run`` prints), extra_sections.py (GQA, decode, host overhead, capture / compile
checks), runner.py (budgets, the ``max_diff`` column, the run), __main__.py (the command line) and
precompile.py (the compile step on its own).
"""
