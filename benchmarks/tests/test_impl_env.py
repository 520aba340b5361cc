"""An implementation may run under environment variables (``effattn-cuda-earlier``: the CUDA backend
with its Hopper kernels switched off): the runner sets them around the whole step, backward included,
and restores what was there."""
import os

import torch

from benchmarks import registry, run
from benchmarks.suite import sections

NAME = "EFFATTN_CUDA_HOPPER_BWD"


def test_the_environment_holds_through_the_backward_and_is_restored(monkeypatch):
    monkeypatch.setenv(NAME, "1")
    monkeypatch.delenv("EFFATTN_CUDA_HOPPER_TMA", raising=False)
    seen = []
    x = torch.randn(3, requires_grad=True)

    def fn():
        seen.append(("fwd", os.environ.get(NAME), os.environ.get("EFFATTN_CUDA_HOPPER_TMA")))
        y = x * 2
        if y.requires_grad:
            y.register_hook(lambda g: seen.append(("bwd", os.environ.get(NAME), os.environ.get("EFFATTN_CUDA_HOPPER_TMA"))))
        return y

    bench = registry.Bench(fn, (x,), registry.EARLIER_CUDA)
    run._step(bench, "fwdbwd", torch.ones(3))()
    assert seen == [("fwd", "0", "0"), ("bwd", "0", "0")]
    assert os.environ.get(NAME) == "1" and "EFFATTN_CUDA_HOPPER_TMA" not in os.environ
    seen.clear()
    run._step(registry.Bench(fn, (x,)), "fwd", torch.ones(3))()
    assert seen == [("fwd", "1", None)]


def test_the_hopper_section_runs_the_earlier_kernels_beside_the_shipped_ones():
    impl = next(i for i in registry.IMPLS if i.name == "effattn-cuda-earlier")
    assert impl.kind == "baseline" and not impl.cpu_default
    hopper = next(s for s in sections.SUITES["gpu"] if s.name == "hopper")
    entries = sections.plan([hopper], ["triton", "cuda"])
    assert {e["variant"] for e in entries} == {"dense", "causal"}
    assert all(e["impls"] == ["effattn-triton", "effattn-cuda", "effattn-cuda-earlier"] and e["L"] == 16384
               for e in entries)
