"""The mutation script of the CUDA kernels (csrc/emu/mutate.py):

- every mutation's pattern occurs exactly once in today's sources (the list follows the kernels;
  a stale pattern fails here, not silently in a long run), and a pattern that does not match makes
  the script fail loudly;
- the harness: an error is a result and the run goes on, --log / --resume / --report (no build);
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


def test_an_error_is_a_result_and_the_log_resumes_and_reports(tmp_path, capsys, monkeypatch):
    """The harness without a build (the GPU-only mutations and a stale one): a mutation it cannot judge is
    an ERROR result and the run goes on; --log records each result, --resume skips what it holds, the
    report lists each mutation with its result and --report-only writes it from the log alone."""
    stale = mutate.Mutation("stale", "attention/fwd.cuh", "no such line", "x", (), "a pattern that moved", gpu_only=True)
    monkeypatch.setitem(mutate.BY_ID, "stale", stale)
    gpu = [m.id for m in mutate.MUTATIONS if m.gpu_only]
    results = mutate.run(["stale", gpu[0]])
    assert [r.status for r in results] == [mutate.ERROR, mutate.GPU_ONLY] and "occurs 0 times" in results[0].detail
    log, rep = tmp_path / "log.jsonl", tmp_path / "report.md"
    assert mutate.main(["--log", str(log), "--report", str(rep), *gpu]) == 0
    assert len(log.read_text().splitlines()) == len(gpu)
    assert mutate.main(["--log", str(log), "--resume", *gpu]) == 0
    assert f"resuming: {len(gpu)} of the {len(gpu)} mutations" in capsys.readouterr().out
    assert len(log.read_text().splitlines()) == len(gpu)               # nothing ran again
    rep.unlink()
    assert mutate.main(["--log", str(log), "--report", str(rep), "--report-only", *gpu]) == 0
    text = rep.read_text()
    assert f"{len(gpu)} GPU-only" in text and "0 not run" in text
    assert all(f"| `{i}` | `{mutate.BY_ID[i].file}` | gpu-only |" in text for i in gpu)
    assert mutate.main(["--log", str(log), "--resume", "stale"]) == 2      # an error: exit status 2


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
