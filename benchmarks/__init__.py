"""effattn benchmarks: `python -m benchmarks.run` (see README.md). registry.py says what runs,
run.py runs it, flops.py / masks.py / measure.py count and measure, report.py / plots.py write out."""
