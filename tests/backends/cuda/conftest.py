"""Fixtures of the CUDA backend's tests."""
import shutil

import pytest
import torch

from effattn.backends.cuda import _ext
from tests.conftest import EMU_DEFAULT_SCHEDULE


@pytest.fixture(scope="module")
def hopper():
    """The emulated ops with the Hopper forward on (EFFATTN_CUDA_EMU_HOPPER=1) for one test module;
    the emulator's default schedule is back in place afterwards."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EFFATTN_CUDA_EMU", "1")
        mp.setenv("EFFATTN_CUDA_EMU_HOPPER", "1")
        problem = _ext.emu_problem()
        assert problem is None, problem
        yield torch.ops.effattn_cuda_emu
        torch.ops.effattn_cuda_emu.emu_set_schedule(EMU_DEFAULT_SCHEDULE)
