"""A short CPU call's host cost (issue 25, item 7): dispatch reads a cached row order, a plain call
skips the checks of arguments it does not give, and an eager forward without lse calls the flash
kernel directly. Results stay bitwise those of the kernel, explain names the same rows, and the
cached order follows every change to the registry."""
import pytest
import torch

import effattn
from effattn._call import make_attn_call
from effattn.backends import base
from effattn.backends.torch.attention import cpu_flash

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
                                reason="this torch has no flash CPU kernel")


def _qkv(B=2, H=4, L=32, D=16, grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, L, D, generator=g).requires_grad_(grad) for _ in range(3)]


def _sorted_fresh(op, call):
    order = list(base.BACKENDS)
    flat = [(p, order.index(b.name), i) for b in base._REGISTRY[op].values() for i, p in enumerate(b.paths)]
    return [p for p, _, _ in sorted(flat, key=lambda x: (x[0].rank(call), x[1], x[2]))]


@pytest.mark.parametrize("causal", [False, True])
def test_plain_call_is_bitwise_the_kernel_and_explain_agrees(causal):
    q, k, v = _qkv()
    with torch.no_grad():
        out = effattn.attention(q, k, v, causal=causal)
        want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=0.25)[0]
        o2, lse = effattn.attention(q, k, v, causal=causal, return_lse=True)   # through the op pair
    assert torch.equal(out, want) and torch.equal(o2, want) and lse.is_contiguous()
    ex = effattn.explain(q, k, v, causal=causal)
    assert ex.chosen_path == "torch/cpu-flash", str(ex)
    # the fast call builds what the general path builds
    fast = make_attn_call(q, k, v, causal=causal)
    slow = make_attn_call(q, k, v, causal=causal, positions=(0, 0))
    assert (fast.rule.Lq, fast.rule.Lk, fast.rule.left, fast.rule.right, fast.rule.q_offset) == \
        (slow.rule.Lq, slow.rule.Lk, slow.rule.left, slow.rule.right, slow.rule.q_offset)
    assert fast.features() == slow.features() and fast.scale == slow.scale and fast.seed is None


def test_gradients_are_those_of_the_op_pair():
    q, k, v = _qkv(grad=True)
    d = torch.randn_like(q)
    grads = []
    for fn in (lambda: effattn.attention(q, k, v, causal=True),
               lambda: cpu_flash.cpu_flash_fwd(q, k, v, True, 0.25)[0]):
        q.grad = k.grad = v.grad = None
        fn().backward(d)
        grads.append([t.grad.clone() for t in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_plain_call_keeps_the_argument_errors():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="scale must be a finite float"):
        effattn.attention(q, k, v, scale=float("nan"))
    with pytest.raises(TypeError, match="causal must be a bool"):
        effattn.attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="dropout_p must be a float in"):
        effattn.attention(q, k, v, dropout_p=True)


def test_cached_row_order_follows_the_registry(monkeypatch):
    q, k, v = _qkv()
    call = make_attn_call(q, k, v)
    assert base.rows("attention", call) == _sorted_fresh("attention", call)
    assert base.rows("attention") == _sorted_fresh("attention", None)
    torch_rows = base._REGISTRY["attention"]["torch"]
    # replacing a backend's rows (as tests do) is seen at once: only the reference is left on CPU
    ref = [p for p in torch_rows.paths if p.name == "torch/reference"]
    monkeypatch.setattr(torch_rows, "paths", ref)
    assert base.select("attention", call, "auto").name == "torch/reference"
    assert [p.name for p in base.rows("attention") if p.backend == "torch"] == ["torch/reference"]
    monkeypatch.undo()
    assert base.select("attention", call, "auto").name == "torch/cpu-flash"
    # a row registered later with a better priority is taken
    first = base.Path(backend="torch", op="attention", name="torch/test-first", priority=1,
                      caps=cpu_flash.PATH.caps, run=cpu_flash.PATH.run)
    monkeypatch.setattr(base, "_REGISTRY", {op: {n: base.Backend(b.name, b.op, list(b.paths)) for n, b in t.items()}
                                            for op, t in base._REGISTRY.items()})
    base.register(first)
    assert base.select("attention", call, "auto") is first
    assert base.rows("attention", call) == _sorted_fresh("attention", call)
    monkeypatch.undo()
    assert base.select("attention", call, "auto").name == "torch/cpu-flash"


def test_key_padding_reads_finite_keys_in_place(monkeypatch):
    """Key padding on ``torch/cpu-sdpa-mask``: finite K and V go to the kernel without copies, with the
    results (forward, lse, gradients) bitwise those of the zeroed copies; a batch entry that is all
    padding gives output 0, lse -inf and gradients 0; NaN, inf or scores past the dtype's range take
    the copies."""
    from effattn.backends.torch.attention import cpu_masked
    from effattn.testing.oracle import naive_attention
    q, k, v = _qkv(B=3, L=24, grad=True)
    pad = torch.zeros(3, 24, dtype=torch.bool)
    pad[0, 17:] = True
    pad[1, :] = True                                  # every key padding: rows that see none
    d = torch.randn(3, 4, 24, 16)
    ex = effattn.explain(q, k, v, key_padding_mask=pad)
    assert ex.chosen_path == "torch/cpu-sdpa-mask" and "K and V read in place when" in ex.paths["torch"], str(ex)
    copies = []
    real = cpu_masked._seen_only
    monkeypatch.setattr(cpu_masked, "_seen_only", lambda x, u: copies.append(1) or real(x, u))

    def run():
        q.grad = k.grad = v.grad = None
        out, lse = effattn.attention(q, k, v, key_padding_mask=pad, return_lse=True)
        (out * d).sum().backward()
        return [out.detach(), lse.detach(), q.grad, k.grad, v.grad]

    fast = run()
    assert copies == []
    monkeypatch.setattr(cpu_masked, "masked_keys_harmless", lambda *a: False)
    slow = run()
    assert copies == [1] * 2                          # K and V in the backward (the forward's output was finite)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))
    out, lse, dq, dk, dv = fast
    assert torch.all(out[1] == 0) and torch.all(lse[1] == -float("inf")) and torch.all(dk[1] == 0)
    assert torch.all(dk[0, :, 17:] == 0) and torch.all(dv[0, :, 17:] == 0)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = naive_attention(q64, k64, v64, key_padding_mask=pad)
    ref = ref[0] if isinstance(ref, tuple) else ref
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    ref.backward(d.double())
    for got, want in zip((dq, dk, dv), (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    monkeypatch.undo()
    x = torch.ones(1, 1, 4, 4)
    assert cpu_masked.masked_keys_harmless(x, x, x, 0.5)
    for bad in (float("nan"), float("inf"), -float("inf"), 1e38):      # 1e38 * 1 * 4 * 0.5 > max / 4
        y = x.clone()
        y[0, 0, 3, 0] = bad
        assert not cpu_masked.masked_keys_harmless(x, y, x, 0.5), bad
        assert not cpu_masked.masked_keys_harmless(y, x, x, 0.5), bad
        assert bad == 1e38 or not cpu_masked.masked_keys_harmless(x, x, y, 0.5), bad


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_key_padding_forward_reruns_on_zeroed_copies_when_its_output_is_not_finite(bad, monkeypatch):
    """torch/cpu-sdpa-mask's forward reads K and V in place and checks its output: a NaN or inf at a padded
    key (a NaN score, inf - inf, or 0 * inf) makes it run again on zeroed copies, whose result is bitwise that
    of the call with clean padded keys; a clean call makes no copy."""
    from effattn.backends.torch.attention import cpu_masked
    q, k, v = _qkv(B=2, L=24, grad=False)
    pad = torch.zeros(2, 24, dtype=torch.bool)
    pad[:, 19:] = True
    copies = []
    real = cpu_masked._seen_only
    monkeypatch.setattr(cpu_masked, "_seen_only", lambda x, u: copies.append(1) or real(x, u))
    clean = effattn.attention(q, k, v, key_padding_mask=pad)
    assert effattn.explain(q, k, v, key_padding_mask=pad).chosen_path == "torch/cpu-sdpa-mask"
    assert copies == []
    for i in range(2):
        dirty = (k, v)[i].clone()
        dirty[0, 1, 20, 3] = bad
        out = effattn.attention(q, *((dirty, v) if i == 0 else (k, dirty)), key_padding_mask=pad)
        assert torch.equal(out, clean), (i, (out - clean).abs().max())
        assert copies == [1] * (2 * i + 2)              # the rerun's K and V copies


def _ops_of(fn):
    """The aten ops ``fn()`` runs, in order (a dispatch mode sees every one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    ops = []
    with Log():
        got = fn()
    return ops, got


def test_masked_keys_check_reads_each_input_once():
    """`masked_keys_harmless` runs once per forward+backward of a key padding call: one pass over each
    input (the norms of q, k and v in one op) and three scalar reads; no copy, no abs of a full
    tensor, no amax / amin pair (two passes); and on inputs that require grad it records no autograd
    node (the aminmax check recorded ten per call, saving 12 tensors, q, k, v among them)."""
    from effattn.backends.torch.attention import cpu_masked
    q, k, v = _qkv(B=1, H=2, L=16, D=8, grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ops, ok = _ops_of(lambda: cpu_masked.masked_keys_harmless(q, k, v, 0.25))
    assert ok is True and saved == []
    assert sorted(ops) == sorted(["detach"] * 3 + ["_foreach_norm"] + ["_local_scalar_dense"] * 3), ops
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = q.detach().to(dtype)
        assert cpu_masked.masked_keys_harmless(x, x, x, 0.25), dtype
        y = x.clone()
        y[0, 1, 5, 3] = float("nan")
        assert not cpu_masked.masked_keys_harmless(x, x, y, 0.25), dtype


@pytest.mark.parametrize("pad", [False, True])
def test_gradient_call_saves_what_sdpa_saves(pad):
    """An eager dense / key padding call wanting gradients records SDPA's own autograd node with the
    same saved tensors (count, shapes, strides, dtypes) and returns bitwise SDPA's output and gradients,
    with SDPA's strides (no extra copy in autograd's accumulation)."""
    import torch.nn.functional as F
    q, k, v = _qkv(B=1, H=4, L=64, D=16, grad=True)
    d = torch.randn(1, 4, 64, 16, generator=torch.Generator().manual_seed(1))
    kpm = (torch.arange(64) >= 56)[None] if pad else None      # 8 keys: too few to skip (cpu_masked.COMPACT)
    runs = {"effattn": lambda: effattn.attention(q, k, v, key_padding_mask=kpm),
            "sdpa": lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if kpm is None else
                torch.zeros(1, 1, 1, 64).masked_fill_(kpm[:, None, None, :], -float("inf")))}
    got = {}
    for name, f in runs.items():
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = f()
        grads = torch.autograd.grad(out, (q, k, v), d)
        got[name] = (type(out.grad_fn).__name__, [(t.shape, t.stride(), t.dtype) for t in saved],
                     [out.detach(), *grads], [(t.stride(), t.is_contiguous()) for t in (out, *grads)])
    (n1, s1, t1, st1), (n2, s2, t2, st2) = got["effattn"], got["sdpa"]
    assert n1 == n2 == "ScaledDotProductFlashAttentionForCpuBackward0"
    assert s1 == s2 and st1 == st2
    assert all(torch.equal(a, b) for a, b in zip(t1, t2))
