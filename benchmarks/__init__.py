"""effattn benchmarks: `python -m benchmarks.run` (see README.md). registry.py says what runs,
run.py runs it, flops.py / measure.py count and measure (the visibility rule comes from effattn.visibility), report.py / plots.py write out."""
