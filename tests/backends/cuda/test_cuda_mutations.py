"""The mutation script of the CUDA kernels (csrc/emu/mutate.py):

- every mutation's pattern occurs exactly once in today's sources (the list follows the kernels;
  a stale pattern fails here, not silently in a long run), and a pattern that does not match makes
  the script fail loudly;
- its fast subset (a removed barrier, a decode wait count) is caught by the emulation tests (CI runs
  the decode wait count, the long run, EFFATTN_LONG=1, the barrier too);
- marked ``mutation`` (EFFATTN_MUTATION=1): the whole list, every mutation that is not GPU-only caught.
"""
import importlib.util
import os
import shutil

import pytest

from tests.conftest import CSRC

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels")


def load_mutate():
    spec = importlib.util.spec_from_file_location("effattn_mutate", os.path.join(CSRC, "emu", "mutate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mutate = load_mutate()


def test_every_pattern_occurs_once_and_a_stale_one_fails_loudly(tmp_path):
    assert len(mutate.MUTATIONS) >= 12 and len(mutate.BY_ID) == len(mutate.MUTATIONS)
    assert set(mutate.FAST) <= set(mutate.BY_ID)
    for m in mutate.MUTATIONS:
        copy = tmp_path / m.id
        shutil.copytree(CSRC, copy)
        mutate.apply(m, str(copy))
        with open(copy / m.file) as f:
            assert m.new in f.read() or not m.new, m.id
        assert m.gpu_only or m.tests, m.id                 # an emulated mutation names the tests that catch it
    stale = mutate.Mutation("stale", "attention/fwd.cuh", "no such line", "x", ("tests",), "a pattern that moved")
    with pytest.raises(mutate.ListError, match="occurs 0 times"):
        mutate.apply(stale, str(tmp_path / mutate.MUTATIONS[0].id))
    assert mutate.main(["no-such-mutation"]) == 2


@pytest.mark.parametrize("mutation", mutate.FAST)
def test_fast_subset_is_caught(mutation):
    """The mutant's kernels rebuilt (only the units that include the mutated file: the backward's
    attention/inst/bwd_*.cu, or decode.cu)
    and its tests run in a fresh process: about 50 s of CPU per mutation (CI runs decode-wait-count;
    barrier-dq is in conftest.py's LONG_RUN)."""
    [r] = mutate.run([mutation])
    assert r.status == mutate.CAUGHT, (r.mutation.id, r.status, r.detail)


@pytest.mark.mutation
@pytest.mark.skipif(os.environ.get("EFFATTN_MUTATION") != "1", reason="every mutation (about 15 minutes): "
                    "EFFATTN_MUTATION=1, or run python3 csrc/emu/mutate.py")
def test_every_mutation_that_is_not_gpu_only_is_caught():
    results = mutate.run([m.id for m in mutate.MUTATIONS])
    missed = [(r.mutation.id, r.status, r.detail) for r in results if r.status in (mutate.SURVIVED, mutate.ERROR)]
    assert not missed, missed
