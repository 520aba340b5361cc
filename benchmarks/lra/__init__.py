"""Long Range Arena harness on effattn: data (generated ListOps and Pathfinder, loaders for the
official files, stand-ins), a small encoder on `effattn.nn`, training with every attention variant,
and LRA-style tables. ``python -m benchmarks.lra --help``; ``benchmarks/lra/README.md``."""
