"""Dispatch plans (effattn.plans): a repeated CPU call runs the row `select` would pick, on the call
`make_attn_call` would build, and every change of what decides the row (the registry, a module
switch, a key padding mask changed in place, another argument) is a new plan or the full path."""
import pytest
import torch

import effattn
from effattn import plans
from effattn._call import make_attn_call
from effattn.backends import base
from effattn.backends.torch.attention import cpu_blocks, cpu_masked
from effattn.layouts import BlockLayout


def _qkv(B=2, H=4, Hkv=4, Lq=32, Lk=32, D=16, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, L, D, generator=g).to(dtype).requires_grad_(grad)
            for h, L in ((H, Lq), (Hkv, Lk), (Hkv, Lk))]


def _planned(q, k, v, **kw):
    """The (row name, call) a stored plan gives for this call, or None."""
    kpm = kw.get("key_padding_mask")
    path, call = plans.lookup(q, k, v, kw.get("causal", False), kw.get("window"), kw.get("layout"), kpm,
                              kw.get("scale"), kw.get("dropout_p", 0.0), kw.get("return_lse", False),
                              kw.get("backend", "auto"), peek=True)
    return None if path is None else (path.name, call)


@pytest.fixture(autouse=True)
def _fresh_plans():
    plans.clear()
    yield
    plans.clear()


def _pad(B, L, start):
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[:, start:] = True
    return pad


CALLS = {
    "dense": (dict(), dict()),
    "causal": (dict(), dict(causal=True)),
    "gqa, Lq != Lk": (dict(H=4, Hkv=2, Lq=8, Lk=40), dict()),
    "window": (dict(), dict(causal=True, window=5)),
    "window pair": (dict(), dict(window=(3, 2))),
    "layout": (dict(), dict(causal=True, layout=BlockLayout(torch.tril(torch.ones(4, 4, dtype=torch.bool)), 8))),
    "padding": (dict(), dict(key_padding_mask=_pad(2, 32, 25))),
    "padding, lse": (dict(), dict(key_padding_mask=_pad(2, 32, 20), return_lse=True)),
    "scale": (dict(), dict(scale=0.3)),
    "bfloat16": (dict(dtype=torch.bfloat16), dict(causal=True)),
    "float64": (dict(dtype=torch.float64), dict()),
    "backend torch": (dict(), dict(backend="torch")),
}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("case", list(CALLS))
def test_a_repeated_call_runs_the_row_and_call_of_the_full_path(case, grad):
    shape, kw = CALLS[case]
    q, k, v = _qkv(**shape, grad=grad)
    assert _planned(q, k, v, **kw) is None
    first = effattn.attention(q, k, v, **kw)
    planned = _planned(q, k, v, **kw)
    assert planned is not None, "the first call stored no plan"
    full = make_attn_call(q, k, v, **{n: x for n, x in kw.items() if n != "backend"})
    assert planned[0] == base.select("attention", full, kw.get("backend", "auto")).name
    assert planned[0] == effattn.explain(q, k, v, **kw).chosen_path
    assert planned[1].__dict__.keys() == full.__dict__.keys()
    for name, want in full.__dict__.items():
        got = planned[1].__dict__[name]
        assert got is want or got == want or (name == "rule" and repr(got) == repr(want)), name
    # fresh tensors of the same shapes take the plan; the result is bitwise the full path's
    q2, k2, v2 = _qkv(**shape, grad=grad, seed=1)
    again = effattn.attention(q2, k2, v2, **kw)
    plans.ENABLED = False
    try:
        ref = effattn.attention(q2, k2, v2, **kw)
    finally:
        plans.ENABLED = True
    again, ref = (x if isinstance(x, tuple) else (x,) for x in (again, ref))
    assert all(torch.equal(a, b) for a, b in zip(again, ref))
    if grad:
        d = torch.randn_like(again[0])
        ga = torch.autograd.grad(again[0], (q2, k2, v2), d)
        gr = torch.autograd.grad(ref[0], (q2, k2, v2), d)
        assert all(torch.equal(a, b) for a, b in zip(ga, gr))
    assert isinstance(first, tuple) == bool(kw.get("return_lse"))


def test_a_module_switch_or_a_patched_row_is_a_new_plan(monkeypatch):
    q, k, v = _qkv()
    pad = _pad(2, 32, 24)
    effattn.attention(q, k, v, key_padding_mask=pad)
    assert _planned(q, k, v, key_padding_mask=pad)[0] == "torch/cpu-sdpa-mask"
    monkeypatch.setattr(cpu_masked, "ENABLED", False)
    assert _planned(q, k, v, key_padding_mask=pad) is None
    effattn.attention(q, k, v, key_padding_mask=pad)
    assert _planned(q, k, v, key_padding_mask=pad)[0] == "torch/cpu-blocks" == \
        effattn.explain(q, k, v, key_padding_mask=pad).chosen_path
    monkeypatch.setattr(cpu_blocks, "ENABLED", False)
    effattn.attention(q, k, v, key_padding_mask=pad)
    assert _planned(q, k, v, key_padding_mask=pad)[0] == "torch/reference"
    monkeypatch.undo()
    effattn.attention(q, k, v)
    flash = next(p for p in base.rows("attention") if p.name == "torch/cpu-flash")
    monkeypatch.setattr(flash, "admits", lambda call: ["patched away"])
    assert _planned(q, k, v) is None                # the row changed: the registry's version moved
    effattn.attention(q, k, v)
    assert _planned(q, k, v)[0] == effattn.explain(q, k, v).chosen_path != "torch/cpu-flash"


def test_a_padding_mask_changed_in_place_is_a_new_plan():
    """The masked row reads the padding (its share, the keys it keeps): a mask changed in place (its
    version moves) is judged again, and the plan follows explain."""
    q, k, v = _qkv(B=1, H=1, Hkv=1, Lq=512, Lk=512, D=8)
    pad = _pad(1, 512, 384)                          # a quarter padding: skipped, 384 keys read
    effattn.attention(q, k, v, key_padding_mask=pad)
    assert _planned(q, k, v, key_padding_mask=pad)[0] == "torch/cpu-sdpa-mask"
    assert "384 of 512 keys" in effattn.explain(q, k, v, key_padding_mask=pad).paths["torch"]
    pad[:, 40:] = True                               # 92% padding: 40 keys read
    assert _planned(q, k, v, key_padding_mask=pad) is None
    out = effattn.attention(q, k, v, key_padding_mask=pad)
    assert _planned(q, k, v, key_padding_mask=pad)[0] == "torch/cpu-sdpa-mask"
    assert "40 of 512 keys" in effattn.explain(q, k, v, key_padding_mask=pad).paths["torch"]
    torch.testing.assert_close(out, effattn.attention(q, k[:, :, :40], v[:, :, :40]))
    other = _pad(1, 512, 384)                        # an equal mask, another tensor: its own plan
    assert _planned(q, k, v, key_padding_mask=other) is None


@pytest.mark.parametrize("bad, error", [
    (dict(causal=1), TypeError), (dict(scale=True), TypeError), (dict(scale=float("nan")), TypeError),
    (dict(window=(-3, 0)), ValueError), (dict(window=(2.0, 0)), TypeError), (dict(window=(True, 0)), TypeError),
    (dict(dropout_p=1.5), ValueError),
    (dict(key_padding_mask=torch.zeros(2, 32)), TypeError), (dict(backend="nope"), ValueError)])
def test_bad_arguments_after_a_good_call_meet_the_full_checks(bad, error):
    q, k, v = _qkv()
    good = dict(causal=True, scale=1, window=(1, 0), key_padding_mask=_pad(2, 32, 30))  # equal to True, (True, 0)
    effattn.attention(q, k, v, **good)
    effattn.attention(q, k, v, **{n: x for n, x in good.items() if n not in bad})
    with pytest.raises(error):
        effattn.attention(q, k, v, **{**{n: x for n, x in good.items() if n not in bad}, **bad})
    with pytest.raises(TypeError, match="dtype"):           # a dtype mismatch with the shapes of a plan
        effattn.attention(q, k.double(), v, causal=True)


def test_what_takes_the_full_path_every_time():
    q, k, v = _qkv()
    for kw in (dict(dropout_p=0.1), dict(softcap=5.0), dict(out_dtype=torch.float32), dict(positions=(3, 0)),
               dict(window=[2, 0])):
        effattn.attention(q, k, v, **kw)
        assert not plans._PLANS, kw
    assert not plans._PLANS
    sub = torch.nn.Parameter(q.detach())                      # a tensor subclass
    effattn.attention(sub, k, v)
    assert not plans._PLANS
    effattn.attention(q, k, v)
    assert len(plans._PLANS) == 1


def test_the_table_is_bounded():
    q, k, v = _qkv(B=1, H=1, Hkv=1, Lq=4, Lk=4, D=4)
    for i in range(plans.LIMIT + 5):
        effattn.attention(q, k, v, scale=0.1 + i)
    assert 0 < len(plans._PLANS) <= plans.LIMIT


def _plan():
    (plan,) = plans._PLANS.values()
    return plan


RUNNERS = {
    "torch/cpu-flash": (dict(), dict(causal=True)),
    "torch/cpu-sdpa-mask": (dict(B=1, Lq=64, Lk=64), dict(key_padding_mask=_pad(1, 64, 40))),   # padding skipped
    "torch/cpu-sdpa-mask, rule": (dict(), dict(causal=True, window=(5, 0), key_padding_mask=_pad(2, 32, 30))),
    "torch/cpu-sdpa-mask, layout": (dict(), dict(layout=BlockLayout(torch.eye(4, dtype=torch.bool), 8))),
}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("row", list(RUNNERS))
def test_a_rows_runner_serves_the_plan_without_a_call(row, grad, monkeypatch):
    """The rows' runners (`Path.planned`) serve a repeated eager call on its q, k, v alone: no call is
    built and the row's ``run`` is not asked; output and gradients are bitwise the full path's."""
    shape, kw = RUNNERS[row]
    q, k, v = _qkv(**shape, grad=grad)
    effattn.attention(q, k, v, **kw)
    plan = _plan()
    assert plan.path.name == row.split(",")[0] and plan.runner is not None
    monkeypatch.setattr(plans, "_call", lambda *a: pytest.fail("the plan built a call"))
    q2, k2, v2 = _qkv(**shape, grad=grad, seed=3)
    out = effattn.attention(q2, k2, v2, **kw)
    assert out.requires_grad == grad
    monkeypatch.undo()
    plans.ENABLED = False
    try:
        ref = effattn.attention(q2, k2, v2, **kw)
    finally:
        plans.ENABLED = True
    assert torch.equal(out, ref)
    if grad:
        d = torch.randn_like(out)
        ga, gr = (torch.autograd.grad(o, (q2, k2, v2), d) for o in (out, ref))
        assert all(torch.equal(a, b) for a, b in zip(ga, gr))


def test_the_runner_leaves_huge_scores_and_strided_inputs_to_the_row():
    """Scores past the flash backward's exact range (|lse| > 8192 in float32) and a strided last
    dimension: the runner declines and the row's ``run`` takes the call (finite gradients, the
    copies), as the full path would."""
    q, k, v = _qkv(grad=True)
    effattn.attention(q, k, v)
    assert _plan().runner is not None
    g = torch.Generator().manual_seed(5)
    big = [(torch.randn(2, 4, 32, 16, generator=g) * 300).requires_grad_() for _ in range(3)]
    wide = [torch.randn(2, 4, 32, 32, generator=g)[..., ::2].requires_grad_() for _ in range(3)]
    for args in (big, wide):
        assert _plan().runner(*args) is None
        out = effattn.attention(*args)
        grads = torch.autograd.grad(out.sum(), args)
        assert all(torch.isfinite(x).all() for x in grads)
        plans.ENABLED = False
        try:
            ref = torch.autograd.grad(effattn.attention(*args).sum(), args)
        finally:
            plans.ENABLED = True
        assert all(torch.equal(a, b) for a, b in zip(grads, ref))


def test_the_runner_is_not_used_under_a_mode_or_a_trace():
    """Under a dispatch mode (and the other states `direct` refuses) a plan runs the row, which calls
    the op effattn registers: the mode sees effattn's op, not the kernel underneath."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = _qkv()
    effattn.attention(q, k, v)
    with Log():
        effattn.attention(q, k, v)
    assert any("effattn" in name for name in seen), seen


def test_a_replaced_registry_is_a_new_plan(monkeypatch):
    q, k, v = _qkv()
    effattn.attention(q, k, v)
    assert _planned(q, k, v) is not None
    monkeypatch.setattr(base, "_REGISTRY", {op: dict(t) for op, t in base._REGISTRY.items()})
    assert _planned(q, k, v) is None
    monkeypatch.undo()
    assert _planned(q, k, v) is None                    # undone: a new version again
