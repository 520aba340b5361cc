"""Host side of the Triton attention backend: the eager path that skips the torch.library layer
gives bitwise the ops' results and is left for the ops under modes; dispatch asks only the backends
it needs. Small interpreter shapes (the kernels' accuracy is tests/backends/triton/test_triton_attention.py's)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import effattn
from effattn.backends import autograd, base
from effattn.layouts import BlockLayout
from tests.conftest import DEVICE

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


def _inputs(seed=0, features=True):
    """(q, k, v, kwargs): GQA, and with `features` every optional input (window, layout, padding
    mask, dropout)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 24, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(1, 1, 24, 16, generator=g).to(DEVICE) for _ in range(2))
    if not features:
        return q, k, v, dict(causal=True)
    kpm = (torch.rand(1, 24, generator=g) < 0.2).to(DEVICE)
    layout = BlockLayout(torch.rand(2, 2, 2, generator=g) < 0.7, 16).to(DEVICE)
    return q, k, v, dict(causal=True, window=9, layout=layout, key_padding_mask=kpm, dropout_p=0.2)


def test_eager_path_is_bitwise_the_ops(monkeypatch):
    """Outputs and gradients of the eager path equal those through the ops bit for bit, whichever
    outputs the gradient flows from (the eager path passes no zero-filled gradient for the other)."""
    q, k, v, kw = _inputs()

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(3)                                    # the dropout seed
        out, lse = effattn.attention(*leaves, return_lse=True, backend="triton", **kw)
        fin = torch.isfinite(lse)
        got = [out, lse]
        for loss in (out.sum(), lse[fin].sum(), out.sum() + lse[fin].sum()):
            got += torch.autograd.grad(loss, leaves, retain_graph=True)
        return got

    direct = run()
    monkeypatch.setattr(autograd, "direct", lambda *t: False)   # every call through the ops
    via_ops = run()
    for a, b in zip(direct, via_ops):
        assert torch.equal(a, b)


class _Sub(torch.Tensor):
    pass


def _below_autograd() -> bool:
    """Whether the caller runs below the dispatcher's autograd keys, as a torch.library op's body does
    (an eager call of the launchers, in an autograd.Function or not, runs above them)."""
    return torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradFunctionality)


def test_ops_are_used_under_a_dispatch_mode_and_skipped_otherwise(monkeypatch):
    """Under a dispatch mode the ops run; eager calls on plain tensors (forward without autograd,
    forward and backward with it) run the launchers themselves; a tensor subclass goes through the ops.
    The launchers, spied on, say whether the dispatcher called them (an op's body) or the eager path."""
    q, k, v, kw = _inputs(1, features=False)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    calls = []
    for name in ("fwd", "bwd"):
        real = getattr(ta.launch, name)
        monkeypatch.setattr(ta.launch, name, lambda *a, name=name, real=real, **kw: calls.append(
            (name, _below_autograd())) or real(*a, **kw))
    with OpNames() as mode:
        out = effattn.attention(*leaves, backend="triton", **kw)
        torch.autograd.grad(out.sum(), leaves)
    assert "effattn.triton_attention_fwd.default" in mode.names
    assert "effattn.triton_attention_bwd.default" in mode.names
    assert calls == [("fwd", True), ("bwd", True)]
    calls.clear()
    with torch.no_grad():
        effattn.attention(q, k, v, backend="triton", **kw)
    out = effattn.attention(*leaves, backend="triton", **kw)
    torch.autograd.grad(out.sum(), leaves)
    assert calls == [("fwd", False), ("fwd", False), ("bwd", False)]
    calls.clear()
    assert ta.op._direct(q, None, torch.nn.Parameter(q)) and not ta.op._direct(q, q.as_subclass(_Sub))
    effattn.attention(q.as_subclass(_Sub), k, v, backend="triton", **kw)
    assert calls == [("fwd", True)]


def test_dispatch_asks_only_the_rows_it_needs(monkeypatch):
    """A named backend that serves asks only its own rows, up to the first that admits; "auto" asks
    the rows ranked up to its pick (skipping those it never picks on this device). All are asked
    only for an error message."""
    q, k, v, _ = _inputs(2, features=False)
    ex = effattn.explain(q, k, v)
    order = [r.path for r in ex.rows]
    rows = {p.name: p for p in base.rows("attention")}
    asked = []
    for p in rows.values():
        monkeypatch.setattr(p, "reasons", lambda call, p=p, real=p.reasons: asked.append(p.name) or real(call))
    effattn.attention(q, k, v, backend="torch")
    torch_rows = [r.path for r in ex.rows if r.backend == "torch"]
    first_torch = next(n for n in torch_rows if ex.can_serve(n))
    assert asked == torch_rows[:torch_rows.index(first_torch) + 1]
    asked.clear()
    effattn.attention(q, k, v, backend="auto")
    assert asked == [n for n in order[:order.index(ex.chosen_path) + 1]
                     if DEVICE.type not in rows[n].explicit_only_devices]
    asked.clear()
    with pytest.raises(RuntimeError, match="backend 'triton' cannot serve this call: dtype float64 not served"):
        effattn.attention(q.double(), k.double(), v.double(), backend="triton")
    assert {"triton/decode", "triton/prefill", "cuda/decode", "cuda/prefill"} <= set(asked)


# ------------------------------------------------------------------ float32 without TF32 (on a GPU)

@pytest.mark.parametrize("tf32", [False, True])
def test_fp32_without_tf32_ranks_after_torch_and_explain_says_why(monkeypatch, tf32):
    """On a GPU (the device check widened to the CPU here), float32 with TF32 disallowed ranks the
    Triton backend after torch, with a note in explain: "auto" takes torch. With TF32 allowed, or in
    fp16/bf16, Triton is first. Named, it still serves (IEEE dots, never TF32: see the plan)."""
    monkeypatch.setattr(ta.op, "_COMPILED", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(ta.op, "_tf32_enabled", lambda: tf32)
    monkeypatch.setattr(ta.op.BACKEND, "explicit_only_devices", frozenset())
    q = torch.randn(1, 2, 16, 16, device=DEVICE)
    ex = effattn.explain(q, q, q, causal=True)
    torch_rank = ex.ranks["torch"]
    if tf32:
        assert ex.ranks["triton"] < torch_rank and ex.chosen == "triton" and "triton" not in ex.notes
    else:
        assert ex.ranks["triton"] == ta.op.IEEE_FP32_RANK > torch_rank and ex.chosen == "torch"
        assert ex.notes["triton"] == ta.op.IEEE_FP32_NOTE and "without TF32" in str(ex)
    bf = q.bfloat16()
    assert effattn.explain(bf, bf, bf).ranks["triton"] == 10
    out = effattn.attention(q, q, q, causal=True, backend="triton")           # named: served either way
    torch.testing.assert_close(out, effattn.attention(q, q, q, causal=True, backend="torch"))


def test_fp32_dots_follow_the_tf32_setting_on_the_gpu(monkeypatch):
    """Compiled (not interpreted), float32 takes TF32 dots only when the call allows TF32, IEEE
    otherwise; fp16/bf16 keep IEEE (their products are exact in fp32)."""
    monkeypatch.setattr(ta.launch, "_INTERPRET", False)
    x = torch.empty(1, 2, 64, 32, device="meta")
    args = (None, 0, None, 0.25, 0.0, -1, 0)
    assert ta.LaunchPlan(x, x, x, *args, tf32=True).dot_prec == "tf32"
    assert ta.LaunchPlan(x, x, x, *args, tf32=False).dot_prec == "ieee"
    h = x.half()
    assert ta.LaunchPlan(h, h, h, *args, tf32=True).dot_prec == "ieee"


# ------------------------------------------------------------------ one compiled kernel per length class

def test_lengths_do_not_multiply_compiled_kernels():
    """Triton's binder (sm_90 target) gives the forward launches of calls that differ only in their
    sequence lengths one specialization (one compile) per class of lengths (multiples of 16, or
    not), whatever the layout's blocks per row; so does every kernel that lists the unspecialized
    arguments in ``do_not_specialize``. Without the list, a layout at 1024, 1536 and 2560 compiles 3 times."""
    from triton.runtime.jit import JITFunction

    from effattn.backends.triton.jit import UNSPECIALIZED_ARGS
    from tools.triton.specializations import count

    listing = [n for n, k in vars(ta.launch).items() if n.endswith("_kernel")
               and set(UNSPECIALIZED_ARGS) & set(k.arg_names) <= set(_do_not_specialize(k))]
    assert "fwd_kernel" in listing
    five = next(c for c in ta.configs.candidates("bwd", 64, 2) if ta.configs.five_product(c))
    launched = set()
    for lengths in ((1024, 1536, 2560), (1000, 1013, 1500)):
        for case in ("causal", "layout"):
            for bwd_config in (None, five):          # the five-product backward launches dq_reduce_kernel
                variants = count(case, lengths, bwd_config=bwd_config)
                launched |= set(variants)
                assert all(variants[n] == 1 for n in listing if n in variants), (case, lengths, variants)
    assert set(listing) <= launched, (listing, launched)
    specialized = JITFunction(ta.launch.fwd_kernel.fn, do_not_specialize=["seed"])
    assert count("layout", (1024, 1536, 2560), kernels={"fwd_kernel": specialized})["fwd_kernel"] > 1


def _do_not_specialize(kernel):
    """A kernel's ``do_not_specialize`` names, interpreted or compiled."""
    return getattr(kernel, "kwargs", {}).get("do_not_specialize") or getattr(kernel, "do_not_specialize", [])


def test_every_launch_pins_fp_fusion(monkeypatch):
    """Every kernel launch of the attention and linear-attention launchers passes
    ``enable_fp_fusion=True`` (triton 3.10 turns the default off: the same FMAs on every version).
    The kernels are replaced by recorders; nothing is computed."""
    from effattn.backends.triton.linear import launch as linear_launch

    seen = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append((self.name, meta.get("enable_fp_fusion")))

    for mod in (ta.launch, linear_launch):
        for name in [n for n in vars(mod) if n.endswith("_kernel")]:
            monkeypatch.setattr(mod, name, Recorder(name))
    q, k, v, kw = _inputs(4, features=False)
    monkeypatch.setitem(linear_launch.MAP_ONCE, q.dtype, 0)         # the map kernel too, whatever the dtype's placement
    leaves = [t.requires_grad_() for t in (q, k, v)]
    torch.autograd.grad(effattn.attention(*leaves, backend="triton", **kw).sum(), leaves)
    torch.autograd.grad(effattn.linear_attention(*leaves, causal=True, backend="triton").sum(), leaves)
    S, z = torch.zeros(1, 2, 16, 16, device=DEVICE), torch.zeros(1, 2, 16, device=DEVICE)
    linear_launch.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], S, z, 0, True, 1e-6)
    names = {n for n, _ in seen}
    assert {"fwd_kernel", "delta_kernel", "chunk_out_kernel", "map_kernel", "step_kernel"} <= names, names
    assert all(f is True for _, f in seen), [n for n, f in seen if f is not True]


def test_gluon_forward_trial_compiles_for_sm90_offline():
    """The Gluon forward trial (tools/triton/gluon_fwd.py: async wgmma, the next tile's scores under the
    softmax) compiles for sm_90 with Triton's compiler, no spill, no wgmma narrower than 64 and no wait for
    all copies in its loop. It does not run under the interpreter (numerics: its ``--run`` on a GPU), so
    it is no backend path nor autotune candidate."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    root = os.path.dirname(os.path.dirname(effattn.__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "tools.triton.gluon_fwd"], cwd=root, capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["hgmma"] > 0 and row["wgmma_min_n"] >= 64 and row["loop_spills"] == 0 and row["spills"] == 0, row
    assert row["shared"] <= 227 * 1024 and not any(row["loop_wait_all"]), row
