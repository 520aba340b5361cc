"""The backend registry: one list of names, capability declarations checked at registration, import
failures shown as reasons, and a new backend added by one folder plus one line in that list."""
import sys
import textwrap

import pytest
import torch

import effattn
from effattn import backends
from effattn.backends import base

# A fourth backend, as a contributor would write it in effattn/backends/dummy/__init__.py: it serves
# softmax attention on CPU by calling the torch backend's paths, so that the test can run it.
DUMMY = '''
import torch
from effattn.backends.base import FEATURES, Capabilities, Path, register, select

CALLS = []

def _run(call):
    CALLS.append(call.features())
    return select("attention", call, "torch").run(call)

register(Path(backend="dummy", op="attention", name="dummy/reference", priority=50,
              caps=Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}),
                                features=FEATURES["attention"] - {"dropout"}),
              run=_run))
'''


@pytest.fixture
def registry_snapshot(monkeypatch):
    """Restores the registry, the BACKENDS list and the unavailable reasons after the test."""
    monkeypatch.setattr(base, "BACKENDS", dict(base.BACKENDS))
    monkeypatch.setattr(base, "UNAVAILABLE", dict(base.UNAVAILABLE))
    monkeypatch.setattr(base, "_REGISTRY", {op: dict(t) for op, t in base._REGISTRY.items()})
    yield


def _write_package(tmp_path, monkeypatch, name, source):
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_a_fourth_backend_is_one_folder_and_one_line(tmp_path, monkeypatch, registry_snapshot):
    _write_package(tmp_path, monkeypatch, "effattn_test_dummy", DUMMY)
    base.BACKENDS["dummy"] = "effattn_test_dummy"          # the one line in effattn/backends/base.py
    backends.load("dummy")
    dummy = sys.modules["effattn_test_dummy"]
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    # dispatch: "auto" picks it (priority 50 < torch's 100), by name too, and it computes the reference
    torch.testing.assert_close(effattn.attention(q, k, v, causal=True),
                               effattn.attention(q, k, v, causal=True, backend="torch"), rtol=0, atol=0)
    assert dummy.CALLS == [{"causal"}]
    effattn.attention(q, k, v, window=2, backend="dummy")
    assert len(dummy.CALLS) == 2
    # explain lists it with its reasons, read from the declaration
    ex = effattn.explain(q.double(), k.double(), v.double(), dropout_p=0.1)
    assert not ex.can_serve("dummy")
    assert any("float64" in r for r in ex.reasons["dummy"]) and any("dropout" in r for r in ex.reasons["dummy"])
    # its name is valid for the nn layers too
    effattn.nn.MultiheadAttention(16, 2, backend="dummy")
    with pytest.raises(ValueError, match=r"'auto', 'torch', 'triton', 'cuda', 'dummy'"):
        effattn.attention(q, k, v, backend="dumy")


def test_a_typo_in_a_declaration_fails_at_registration(registry_snapshot):
    with pytest.raises(ValueError, match=r"unknown features \['casual'\]"):
        base.register(base.Path(backend="torch", op="attention", name="torch/typo", priority=1,
                                caps=base.Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset(),
                                                       features=frozenset({"casual"})),
                                run=lambda call: None))
    with pytest.raises(ValueError, match="not in effattn.backends.base.BACKENDS"):
        base.register(base.Path(backend="nameless", op="attention", name="nameless/x", priority=1,
                                caps=base.Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset()),
                                run=lambda call: None))
    with pytest.raises(ValueError, match="must be named 'torch/<path>'"):
        base.register(base.Path(backend="torch", op="attention", name="reference2", priority=1,
                                caps=base.Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset()),
                                run=lambda call: None))


def test_a_missing_dependency_is_a_reason_not_a_disappearance(tmp_path, monkeypatch, registry_snapshot):
    _write_package(tmp_path, monkeypatch, "effattn_test_needs_dep", "import a_module_nobody_installed\n")
    base.BACKENDS["needsdep"] = "effattn_test_needs_dep"
    backends.load("needsdep")
    q = torch.randn(1, 1, 4, 8)
    ex = effattn.explain(q, q, q)
    assert ex.reasons["needsdep"] == ["is not available: needs the module 'a_module_nobody_installed', "
                                      "which is not installed"]
    with pytest.raises(RuntimeError, match=r"backend 'needsdep' is not available: needs the module"):
        effattn.attention(q, q, q, backend="needsdep")


def test_a_bug_inside_effattn_is_not_swallowed(tmp_path, monkeypatch, registry_snapshot):
    _write_package(tmp_path, monkeypatch, "effattn_test_broken", "from effattn.no_such_module import x\n")
    base.BACKENDS["broken"] = "effattn_test_broken"
    with pytest.raises(ModuleNotFoundError, match="effattn.no_such_module"):
        backends.load("broken")


def test_a_backend_without_a_kernel_for_an_op_says_so():
    """Every listed backend either has a kernel for each op, or explain says it has none / why not."""
    q = torch.randn(1, 1, 4, 8)
    for op in ("attention", "linear_attention"):
        ex = effattn.explain(q, q, q, op=op)
        assert set(ex.reasons) == set(base.BACKENDS)
        for name in base.BACKENDS:
            if name not in base._REGISTRY[op]:
                assert ex.reasons[name] == [base.missing_reason(op, name)]


def test_a_priority_may_depend_on_the_call(tmp_path, monkeypatch, registry_snapshot):
    """A backend whose speed depends on the shape (a decode kernel for a few query rows against a long
    cache) ranks itself per call; dispatch and explain read the same rank."""
    src = DUMMY.replace("priority=50", "priority=lambda call: 5 if call is not None and call.q.shape[2] <= 4 else 500")
    _write_package(tmp_path, monkeypatch, "effattn_test_ranked", src)
    base.BACKENDS["dummy"] = "effattn_test_ranked"
    backends.load("dummy")
    ranked = sys.modules["effattn_test_ranked"]
    k, v = torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    effattn.attention(torch.randn(1, 2, 2, 8), k, v, causal=True)        # 2 query rows: rank 5, first
    assert len(ranked.CALLS) == 1
    effattn.attention(torch.randn(1, 2, 32, 8), k, v, causal=True)       # 32 rows: rank 500, after torch
    assert len(ranked.CALLS) == 1
    short, long = (effattn.explain(torch.randn(1, 2, n, 8), k, v) for n in (2, 32))
    assert (short.chosen, short.ranks["dummy"]) == ("dummy", 5) and "[  5] dummy/reference" in str(short)
    assert (long.chosen, long.ranks["dummy"]) == ("torch", 500)
    assert [r.path for r in long.rows][-1] == "dummy/reference"            # listed in the order tried
    assert [r.rank for r in long.rows] == sorted(r.rank for r in long.rows)
