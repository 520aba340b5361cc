"""Host side of the Triton attention backend: the eager path that skips the torch.library layer
gives bitwise the ops' results and is left for the ops under modes; dispatch asks only the backends
it needs. Small interpreter shapes (the kernels' accuracy is tests/test_triton_attention.py's)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import effattn
from conftest import DEVICE
from effattn.backends import base
from effattn.layouts import BlockLayout

ta = pytest.importorskip("effattn.backends.triton.attention")
rt = pytest.importorskip("effattn.backends.triton.runtime")
if rt.triton is None or rt._available(DEVICE) is not None:
    pytest.skip(f"triton backend unavailable: {rt._available(DEVICE)}", allow_module_level=True)


class OpNames(TorchDispatchMode):
    """Records the name of every op dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 24, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(1, 2, 24, 16, generator=g).to(DEVICE) for _ in range(2))
    kpm = (torch.rand(1, 24, generator=g) < 0.2).to(DEVICE)
    layout = BlockLayout(torch.rand(4, 2, 2, generator=g) < 0.7, 16).to(DEVICE)
    return q, k, v, dict(causal=True, window=9, layout=layout, key_padding_mask=kpm, dropout_p=0.2)


@pytest.mark.parametrize("grads_of", ["out", "lse", "both"])
def test_eager_path_is_bitwise_the_ops(monkeypatch, grads_of):
    """Outputs and gradients of the eager path equal those through the ops bit for bit, whichever
    outputs the gradient flows from (the eager path passes no zero-filled gradient for the other)."""
    q, k, v, kw = _inputs()

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(3)                                    # the dropout seed
        out, lse = effattn.attention(*leaves, return_lse=True, backend="triton", **kw)
        fin = torch.isfinite(lse)
        loss = {"out": out.sum(), "lse": lse[fin].sum(), "both": out.sum() + lse[fin].sum()}[grads_of]
        return (out, lse, *torch.autograd.grad(loss, leaves))

    direct = run()
    monkeypatch.setattr(ta.op, "_direct", lambda *t: False)    # every call through the ops
    via_ops = run()
    for a, b in zip(direct, via_ops):
        assert torch.equal(a, b)


class _Sub(torch.Tensor):
    pass


def test_ops_are_used_under_a_dispatch_mode_and_skipped_otherwise(monkeypatch):
    q, k, v, kw = _inputs(1)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with OpNames() as mode:
        out = effattn.attention(*leaves, backend="triton", **kw)
        torch.autograd.grad(out.sum(), leaves)
    assert "effattn.triton_attention_fwd.default" in mode.names
    assert "effattn.triton_attention_bwd.default" in mode.names
    calls = []
    real = ta.op.triton_attention_fwd
    monkeypatch.setattr(ta.op, "triton_attention_fwd", lambda *a: calls.append(a) or real(*a))
    with torch.no_grad():
        effattn.attention(q, k, v, backend="triton", **kw)
    out = effattn.attention(*leaves, backend="triton", **kw)
    torch.autograd.grad(out.sum(), leaves)
    assert calls == []
    assert ta.op._direct(q, None, torch.nn.Parameter(q)) and not ta.op._direct(q, q.as_subclass(_Sub))
    effattn.attention(q.as_subclass(_Sub), k, v, backend="triton", **kw)
    assert len(calls) == 1


def test_dispatch_asks_only_the_backends_it_needs(monkeypatch):
    """A named backend that serves is the only one asked; "auto" asks those ranked up to its pick
    (skipping those it never picks on this device). All are asked only for an error message."""
    q, k, v, _ = _inputs(2)
    chosen = effattn.explain(q, k, v).chosen
    order = [b.name for b in base.backends_for("attention")]
    asked = []
    for b in base.backends_for("attention"):
        monkeypatch.setattr(b, "reasons", lambda call, b=b, real=b.reasons: asked.append(b.name) or real(call))
    effattn.attention(q, k, v, backend="torch")
    assert asked == ["torch"]
    asked.clear()
    effattn.attention(q, k, v, backend="auto")
    assert asked == [n for n in order[:order.index(chosen) + 1]
                     if DEVICE.type not in base._REGISTRY["attention"][n].explicit_only_devices]
    asked.clear()
    with pytest.raises(RuntimeError, match="backend 'triton' cannot serve this call: dtype float64 not served"):
        effattn.attention(q.double(), k.double(), v.double(), backend="triton")
    assert sorted(asked) == sorted(["triton"] + order)
