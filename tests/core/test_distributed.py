"""Context parallelism (effattn.distributed) on spawned gloo processes on the CPU, against the
single-process call: ring (contiguous, zigzag), halo exchange, Ulysses, all-gather, linear attention,
forward and backward, bitwise repeatable; the halo's bytes; errors instead of hangs.

Each test spawns its processes once and runs a list of scenarios in them (process start-up dominates)."""
import datetime
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import effattn
import effattn.distributed as ecp
from effattn.testing.oracle import visibility

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world, *args):
    port = _free_port()
    mp.start_processes(_entry, args=(world, port, fn, args), nprocs=world, start_method="fork", join=True)


def _entry(rank, world, port, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _inputs(B, H, Hkv, L, D, Dv, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g, dtype=dtype), torch.randn(B, Hkv, L, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, L, Dv, generator=g, dtype=dtype))


def _run_cp(q, k, v, balance, fn, dout):
    """Shards q, k, v, runs fn on the shards, returns (out shard, grads of the shards)."""
    shards = [ecp.shard(t, dim=2, balance=balance).detach().requires_grad_() for t in (q, k, v)]
    out = fn(*shards)
    grads = torch.autograd.grad(out, shards, ecp.shard(dout, dim=2, balance=balance))
    return out, grads


def _check_against_single(rank, q, k, v, balance, fn, single, tol, label):
    ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = single(*ref_in)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=ref.dtype)
    ref_grads = torch.autograd.grad(ref, ref_in, dout)
    out, grads = _run_cp(q, k, v, balance, fn, dout)
    full = ecp.unshard(out.detach(), dim=2, balance=balance)
    torch.testing.assert_close(full, ref.detach(), rtol=tol, atol=tol, msg=lambda m: f"{label} out, rank {rank}: {m}")
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, ecp.shard(r, dim=2, balance=balance), rtol=tol, atol=tol,
                                   msg=lambda m: f"{label} d{name}, rank {rank}: {m}")
    out2, grads2 = _run_cp(q, k, v, balance, fn, dout)                 # bitwise repeatable
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2)), label


SOFTMAX = [
    # method, balance, attention kwargs
    ("ring", "contiguous", dict(causal=True)),
    ("ring", "zigzag", dict(causal=True)),
    ("ring", "contiguous", dict()),
    ("ring", "zigzag", dict(causal=True, window=5)),              # zigzag + window: ring with skipped pairs
    ("ring", "contiguous", dict(causal=True, window=3)),          # halo exchange
    ("ring", "contiguous", dict(window=(2, 3))),                  # halo both ways
    ("ring", "contiguous", dict(causal=True, window=20)),         # a window past one shard: ring, fewer steps
    ("ulysses", "zigzag", dict(causal=True)),
    ("ulysses", "contiguous", dict(window=(3, 1))),
    ("allgather", "zigzag", dict(causal=True, window=6)),
    ("allgather", "contiguous", dict()),
]


def _softmax_worker(rank, world, cases, L):
    q, k, v = _inputs(2, 4, 2, L, 8, 6)
    for method, balance, kw in cases:
        label = f"{method}/{balance}/{kw}"
        _check_against_single(
            rank, q, k, v, balance,
            lambda a, b, c: ecp.attention(a, b, c, method=method, balance=balance, **kw),
            lambda a, b, c: effattn.attention(a, b, c, **kw), 2e-5, label)


def _extras_worker(rank, world):
    # linear attention, causal and not, GQA
    q, k, v = _inputs(1, 4, 2, 16, 4, 3, seed=1)
    for causal in (True, False):
        _check_against_single(rank, q, k, v, "contiguous",
                              lambda a, b, c: ecp.linear_attention(a, b, c, causal=causal),
                              lambda a, b, c: effattn.linear_attention(a, b, c, causal=causal), 2e-5,
                              f"linear causal={causal}")
    # the halo: a causal window of 3 sends 3 keys and 3 values to the next rank, nothing else
    q, k, v = _inputs(1, 2, 2, 32, 8, 8, seed=2)
    ks, vs, qs = (ecp.shard(t, dim=2) for t in (k, v, q))
    ecp.reset_bytes_sent()
    with torch.no_grad():
        ecp.attention(qs, ks, vs, causal=True, window=3)
    want = 2 * (1 * 2 * 3 * 8 * 4) if rank < world - 1 else 0
    assert ecp.bytes_sent() == want, (rank, ecp.bytes_sent(), want)
    ecp.reset_bytes_sent()
    with torch.no_grad():
        ecp.attention(qs, ks, vs, causal=True)                      # the full ring sends whole shards
    assert ecp.bytes_sent() == (world - 1) * (ks.numel() + vs.numel()) * 4 or world == 1
    # ranks disagreeing on the call: a ValueError on every rank, not a hang
    bad = qs[:, :, :4] if rank == 1 else qs[:, :, :6]
    with pytest.raises(ValueError, match="ranks disagree on the call"):
        ecp.attention(bad, bad[:, :2], bad[:, :2], causal=True)
    with pytest.raises(ValueError, match=r"unshard: the ranks disagree on the call \(size 2: rank 0=6, rank 1=4"):
        ecp.unshard(bad, dim=2)
    with pytest.raises(ValueError, match="not divisible by 4"):
        ecp.shard(torch.zeros(1, 6), dim=1, balance="zigzag")
    # bad input on one rank: that rank's error names the argument, the others raise too (no hang)
    with pytest.raises(ValueError, match="dropout_p must be" if rank == 1 else "rank\\(s\\) 1 rejected the call"):
        ecp.attention(qs, ks, vs, dropout_p=1.5 if rank == 1 else 0.1)
    with pytest.raises(ValueError, match=r"dropout_p \(x1e6\): rank 0=100000, rank 1=200000"):
        ecp.attention(qs, ks, vs, dropout_p=0.1 * (rank + 1))


DROPOUT = [
    # method, balance, attention kwargs: every method that serves dropout, the ring's shapes and the halo
    ("ring", "contiguous", dict(causal=True)),
    ("ring", "zigzag", dict(causal=True)),
    ("ring", "contiguous", dict()),
    ("ring", "contiguous", dict(causal=True, window=3)),          # halo exchange
    ("ring", "contiguous", dict(window=(2, 3))),                  # halo both ways
    ("allgather", "zigzag", dict(causal=True, window=6)),
    ("allgather", "contiguous", dict()),
    ("ulysses", "zigzag", dict(causal=True)),                     # head shards: the global head index
    ("ulysses", "contiguous", dict(window=(3, 1))),
]


def _dropout_worker(rank, world, cases, L, backend="torch", heads=(2, 4, 2), grads=True):
    """Sharded dropout against the one-device call under the same torch seed: V = identity reads the
    keep-mask off the output, which must be the one-device call's exactly (rank 1 seeds its generator
    differently: rank 0's seed is the call's); outputs and gradients (random V) to float32 rounding
    (the partial outputs are merged in another order than one call's), bitwise repeatable."""
    p, (B, H, Hkv) = 0.3, heads
    q, k, _ = _inputs(B, H, Hkv, L, 8, 6, seed=3)
    eye = torch.eye(L).expand(B, Hkv, L, L).contiguous()
    _, _, v = _inputs(B, H, Hkv, L, 8, 6, seed=4)

    def seeded(fn, s):
        def run(*args):
            torch.manual_seed(s)
            return fn(*args)
        return run

    for method, balance, kw in cases:
        label = f"dropout {method}/{balance}/{kw}"
        torch.manual_seed(11)
        full = effattn.attention(q, k, eye, dropout_p=p, backend=backend, **kw) != 0
        torch.manual_seed(11 + 100 * rank)
        shards = [ecp.shard(t, dim=2, balance=balance) for t in (q, k, eye)]
        with torch.no_grad():
            got = ecp.attention(*shards, method=method, balance=balance, dropout_p=p, backend=backend, **kw)
        got = ecp.unshard(got, dim=2, balance=balance) != 0
        assert torch.equal(got, full), f"{label}: rank {rank} drops other pairs"
        assert 0.5 < full.double().sum().item() / visibility(L, L, **kw).sum().item() / (B * H) < 0.9
        if not grads:
            continue
        _check_against_single(
            rank, q, k, v, balance,
            seeded(lambda a, b, c: ecp.attention(a, b, c, method=method, balance=balance, dropout_p=p,
                                                 backend=backend, **kw), 11),
            seeded(lambda a, b, c: effattn.attention(a, b, c, dropout_p=p, backend=backend, **kw), 11), 2e-5, label)


def test_world2_dropout_equals_the_single_process_call():
    _spawn(_dropout_worker, 2, DROPOUT, 24)


def test_world2_softmax_methods_and_extras():
    def work(rank, world):
        _softmax_worker(rank, world, SOFTMAX, 24)
        _extras_worker(rank, world)
    _spawn(work, 2)


def test_world4_ring_zigzag_halo_ulysses():
    cases = [SOFTMAX[1], SOFTMAX[4], SOFTMAX[7], SOFTMAX[9], ("ring", "contiguous", dict(causal=True, window=10))]

    def work(rank, world):
        _softmax_worker(rank, world, cases, 32)
        _dropout_worker(rank, world, [DROPOUT[1], DROPOUT[3], DROPOUT[7]], 32)     # zigzag, halo, one head a rank
        # a causal window of 10 over shards of 8 reaches two shards back: 3 of the 4 ring steps,
        # so K/V are passed on twice
        q, k, v = (ecp.shard(t, dim=2) for t in _inputs(1, 2, 2, 32, 8, 8, seed=2))
        ecp.reset_bytes_sent()
        with torch.no_grad():
            ecp.attention(q, k, v, causal=True, window=10)
        assert ecp.bytes_sent() == 2 * (k.numel() + v.numel()) * 4, ecp.bytes_sent()
        q, k, v = _inputs(1, 4, 2, 16, 4, 3, seed=1)
        _check_against_single(rank, q, k, v, "contiguous",
                              lambda a, b, c: ecp.linear_attention(a, b, c, causal=True),
                              lambda a, b, c: effattn.linear_attention(a, b, c, causal=True), 2e-5, "linear")
    _spawn(work, 4)


TERMS = [
    # method, balance, attention kwargs: the ring (whole, zigzag with skipped pairs), the halo, Ulysses, all-gather
    ("ring", "contiguous", dict()),
    ("ring", "zigzag", dict(causal=True, window=9)),
    ("ring", "contiguous", dict(causal=True, window=3)),          # halo exchange
    ("ulysses", "zigzag", dict(causal=True)),                     # per-head tensors sliced to the rank's heads
    ("allgather", "zigzag", dict(window=(4, 2))),
]


def _terms_worker(rank, world, cases, L):
    """Score terms (softcap, sinks, ALiBi, a relative table, adaptive span) through every method: the
    output and the gradients of q, k, v equal the single-process call's, the terms' gradients summed
    over the ranks equal its parameter gradients; bitwise repeatable. A dense bias is refused by name."""
    from effattn.bias import ALiBi, Relative, Span
    q, k, v = _inputs(1, 4, 2, L, 8, 6, seed=5, dtype=torch.float64)
    g = torch.Generator().manual_seed(6)
    params = [torch.randn(4, generator=g, dtype=torch.float64), 0.3 * torch.rand(4, generator=g, dtype=torch.float64),
              torch.randn(4, 11, generator=g, dtype=torch.float64), torch.tensor([3.5, 10.0, 20.0, 6.0],
                                                                                 dtype=torch.float64)]

    def terms(ps):
        return dict(softcap=3.0, sinks=ps[0], bias=[ALiBi(ps[1]), Relative(ps[2], max_distance=5),
                                                    Span(ps[3], ramp=3, max_span=L)])

    dout = torch.randn(1, 4, L, 6, generator=g, dtype=torch.float64)
    for method, balance, kw in cases:
        label = f"terms {method}/{balance}/{kw}"
        ref_in = [t.detach().requires_grad_() for t in (q, k, v, *params)]
        ref = effattn.attention(*ref_in[:3], backend="torch", **kw, **terms(ref_in[3:]))
        ref_grads = torch.autograd.grad(ref, ref_in, dout)
        results = []
        for _ in range(2):
            shards = [ecp.shard(t, dim=2, balance=balance).detach().requires_grad_() for t in (q, k, v)]
            ps = [t.detach().requires_grad_() for t in params]
            out = ecp.attention(*shards, method=method, balance=balance, backend="torch", **kw, **terms(ps))
            grads = torch.autograd.grad(out, shards + ps, ecp.shard(dout, dim=2, balance=balance))
            results.append((out, grads))
        (out, grads), (out2, grads2) = results
        assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2)), label
        torch.testing.assert_close(ecp.unshard(out.detach(), dim=2, balance=balance), ref.detach(), rtol=1e-10,
                                   atol=1e-10, msg=lambda m: f"{label} out, rank {rank}: {m}")
        for name, a, r in zip("qkv", grads[:3], ref_grads[:3]):
            torch.testing.assert_close(a, ecp.shard(r, dim=2, balance=balance), rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"{label} d{name}, rank {rank}: {m}")
        for name, a, r in zip(("sinks", "slopes", "table", "z"), grads[3:], ref_grads[3:]):
            total = a.clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total, r, rtol=1e-10, atol=1e-10, msg=lambda m: f"{label} d{name}: {m}")
    # a module's position_bias (learnable ALiBi) through context_parallel: output and parameter gradients
    from effattn.nn import ALiBi as ALiBiModule
    from effattn.nn import MultiheadAttention
    torch.manual_seed(0)
    single = MultiheadAttention(16, 4, batch_first=True, position_bias=ALiBiModule(4, learnable=True))
    cpm = MultiheadAttention(16, 4, batch_first=True, position_bias=ALiBiModule(4, learnable=True),
                             context_parallel=ecp.ContextParallel(method="ring", balance="zigzag"))
    cpm.load_state_dict(single.state_dict())
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.nn.Transformer.generate_square_subsequent_mask
    ref, _ = single(x, x, x, need_weights=False, is_causal=True, attn_mask=mask(16))
    xs = ecp.shard(x, balance="zigzag")
    out, _ = cpm(xs, xs, xs, need_weights=False, is_causal=True, attn_mask=mask(8))
    torch.testing.assert_close(out, ecp.shard(ref, balance="zigzag"), rtol=2e-5, atol=2e-5)
    g_ref = torch.autograd.grad(ref.square().sum(), list(single.parameters()))
    for (name, _), a, b in zip(cpm.named_parameters(), torch.autograd.grad(out.square().sum(),
                                                                           list(cpm.parameters())), g_ref):
        dist.all_reduce(a)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"module {name}: {m}")
    qs = ecp.shard(q, dim=2)
    with pytest.raises(ValueError, match="bias: a dense bias tensor cannot be combined with context parallelism"):
        ecp.attention(qs, qs, qs, bias=torch.zeros(1, 4, L // world, L // world, dtype=torch.float64))


def test_world2_score_terms_equal_the_single_process_call():
    _spawn(_terms_worker, 2, TERMS, 24)


def test_not_initialized_is_an_error():
    with pytest.raises(RuntimeError, match="not initialized"):
        ecp.attention(*_inputs(1, 2, 2, 4, 4, 4))


def _swap_worker(rank, world):
    """swap_attention(context_parallel=...): a causal encoder layer on zigzag shards equals the model
    on the whole sequence; parameter gradients summed over the ranks equal the single-process ones."""
    from torch import nn
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    single = effattn.swap_attention(layer)
    import copy
    cp = effattn.swap_attention(copy.deepcopy(layer), context_parallel=ecp.ContextParallel(balance="zigzag"))
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(1))
    ref = single(x, is_causal=True, src_mask=nn.Transformer.generate_square_subsequent_mask(16))
    out = cp(ecp.shard(x, balance="zigzag"), is_causal=True, src_mask=nn.Transformer.generate_square_subsequent_mask(8))
    torch.testing.assert_close(out, ecp.shard(ref, balance="zigzag"), rtol=2e-5, atol=2e-5)
    g_ref = torch.autograd.grad(ref.square().sum(), list(single.parameters()))
    g = torch.autograd.grad(out.square().sum(), list(cp.parameters()))
    for a, b in zip(g, g_ref):
        dist.all_reduce(a)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert cp.self_attn.last_path == "fused"


def _wrapped_training_worker(rank, world):
    """A model swapped with swap_attention(context_parallel=...) inside DistributedDataParallel and
    inside FSDP2's fully_shard (both on gloo, CPU): one training step (loss = mean over this rank's
    tokens, SGD) gives the single-process run's gradients and parameters (the wrappers average the
    ranks' shares; equal shards make that the whole sequence's mean)."""
    import copy

    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    single = effattn.swap_attention(copy.deepcopy(layer))
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(1))
    mask = nn.Transformer.generate_square_subsequent_mask
    single(x, is_causal=True, src_mask=mask(16)).square().mean().backward()
    torch.optim.SGD(single.parameters(), lr=0.5).step()
    for wrap in (DistributedDataParallel, fully_shard):
        cp = effattn.swap_attention(copy.deepcopy(layer), context_parallel=ecp.ContextParallel(balance="zigzag"))
        model = wrap(cp)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(ecp.shard(x, balance="zigzag"), is_causal=True, src_mask=mask(8)).square().mean().backward()
        opt.step()
        assert cp.self_attn.last_path == "fused"
        for (name, a), b in zip(cp.named_parameters(), single.parameters()):
            grad, value = a.grad, a.detach()
            if hasattr(value, "full_tensor"):                # FSDP2: DTensor shards
                grad, value = grad.full_tensor(), value.full_tensor()
            label = f"{wrap.__name__} {name}"
            torch.testing.assert_close(grad, b.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{label} grad: {m}")
            torch.testing.assert_close(value, b.detach(), rtol=1e-4, atol=1e-6, msg=lambda m: f"{label}: {m}")


def test_world2_ddp_and_fsdp_around_a_context_parallel_model():
    _spawn(_wrapped_training_worker, 2)


def _module_dropout_worker(rank, world):
    """effattn.nn.MultiheadAttention(dropout=0.3, context_parallel=...) in training mode: the module's
    attention dropout on zigzag shards equals the module on the whole sequence under the same
    torch seed (rank 1 seeds differently: rank 0's seed is the call's); in eval it drops nothing."""
    from effattn.nn import MultiheadAttention
    torch.manual_seed(0)
    single = MultiheadAttention(16, 4, dropout=0.3, batch_first=True)
    cp = MultiheadAttention(16, 4, dropout=0.3, batch_first=True, context_parallel=ecp.ContextParallel(
        method="ring", balance="zigzag"))
    cp.load_state_dict(single.state_dict())
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(1))
    xs = ecp.shard(x, balance="zigzag")
    for train in (True, False):
        single.train(train)
        cp.train(train)
        torch.manual_seed(5)
        ref, _ = single(x, x, x, need_weights=False, is_causal=True,
                        attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(16))
        torch.manual_seed(5 + rank)
        out, _ = cp(xs, xs, xs, need_weights=False, is_causal=True,
                    attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(8))
        torch.testing.assert_close(out, ecp.shard(ref, balance="zigzag"), rtol=2e-5, atol=2e-5)
    torch.manual_seed(5)
    single.train(True)
    dropped, _ = single(x, x, x, need_weights=False, is_causal=True,
                        attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(16))
    assert not torch.allclose(dropped, ref, atol=1e-3)             # ref: the eval output; training drops


def test_world2_module_dropout_context_parallel():
    _spawn(_module_dropout_worker, 2)


def test_world2_swap_attention_context_parallel():
    _spawn(_swap_worker, 2)


def test_world2_dropout_on_the_triton_kernels():
    """The same on the Triton kernels (the interpreter on the CPU): their Philox counters take the chunks'
    absolute positions and Ulysses' head shards' global head index, so the zigzag ring's pairs and the
    head shards drop the one-device call's pairs (small cases, forward only: the interpreter is slow;
    test_packed checks the kernels' positioned backward)."""
    rt = pytest.importorskip("effattn.backends.triton.runtime")
    if rt.triton is None or rt._available(torch.device("cpu")) is not None:
        pytest.skip("the Triton interpreter is not usable here")
    _spawn(_dropout_worker, 2, [DROPOUT[1], DROPOUT[7]], 8, "triton", (2, 2, 1), False)
