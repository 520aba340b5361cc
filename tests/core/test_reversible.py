"""Reversible layers: gradients equal the ordinary residual stack's (dropout and LSH hashing replayed
exactly), the memory kept for backward is flat in depth (measured), a 6-layer stack trains."""
import pytest
import torch
from torch import nn

from effattn.nn import LSHSelfAttention, ReversibleSequence

E, HEADS = 16, 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_blocks(depth, dtype=torch.float64, dropout=0.1, seed=0, chunk_len=8, backend="auto"):
    torch.manual_seed(seed)
    blocks = []
    for _ in range(depth):
        f = LSHSelfAttention(E, HEADS, n_hashes=2, chunk_len=chunk_len, dropout=dropout, dtype=dtype, backend=backend)
        g = nn.Sequential(nn.LayerNorm(E, dtype=dtype), nn.Linear(E, 2 * E, dtype=dtype), nn.GELU(),
                          nn.Dropout(dropout), nn.Linear(2 * E, E, dtype=dtype))
        blocks.append((f, g))
    return blocks


def ordinary(blocks, x1, x2, kpm):
    for f, g in blocks:
        x1 = x1 + f(x2, key_padding_mask=kpm)
        x2 = x2 + g(x1)
    return x1, x2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradients_equal_ordinary_stack_with_dropout(backend):
    # triton: the LSH kernels (in the interpreter on a CPU), float32, their Philox dropout replayed
    triton = backend == "triton"
    dtype = torch.float32 if triton else torch.float64
    rev = ReversibleSequence(make_blocks(2 if triton else 6, dtype=dtype, chunk_len=16 if triton else 8, backend=backend))
    rev.train()
    B = 1 if triton else 2                                   # (the interpreter is slow)
    x = torch.randn(B, 14, E, dtype=dtype)                   # padded to 16 inside the attention
    kpm = torch.zeros(B, 14, dtype=torch.bool)
    kpm[-1, 11:] = True
    w1, w2 = torch.randn_like(x), torch.randn_like(x)

    def loss_and_grads(run):
        xr = x.clone().requires_grad_(True)
        torch.manual_seed(123)                                # same dropout masks and rotations
        y1, y2 = run(xr)
        loss = (y1 * w1).sum() + (y2 * w2).sum()
        params = list(rev.parameters())
        return loss.detach(), torch.autograd.grad(loss, [xr] + params)

    loss_r, grads_r = loss_and_grads(lambda xr: rev(xr, f_kwargs={"key_padding_mask": kpm}))
    blocks = list(zip(rev.f_blocks, rev.g_blocks))
    loss_o, grads_o = loss_and_grads(lambda xr: ordinary(blocks, xr, xr, kpm))
    tol = dict(rtol=1e-4, atol=1e-4) if triton else dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(loss_r, loss_o, **tol)
    assert len(grads_r) == len(grads_o) == 1 + len(list(rev.parameters()))
    for a, b in zip(grads_r, grads_o):
        torch.testing.assert_close(a, b, **tol)
    # dropout was on: without the replay the gradients would differ
    torch.manual_seed(999)
    y1, _ = ordinary(blocks, x, x, kpm)
    torch.manual_seed(123)
    z1, _ = ordinary(blocks, x, x, kpm)
    assert not torch.allclose(y1, z1)


def saved_bytes(run):
    """Bytes of the tensors autograd keeps for the backward of run() (parameters excluded)."""
    seen = {}

    def pack(t):
        if not isinstance(t, nn.Parameter):
            seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def test_memory_flat_in_depth():
    x = torch.randn(2, 64, E, requires_grad=True)
    rev_bytes, ord_bytes = [], []
    for depth in (1, 2, 6):
        blocks = make_blocks(depth, dtype=torch.float32)
        rev = ReversibleSequence(blocks)
        rev_bytes.append(saved_bytes(lambda: rev(x))[0])
        ord_bytes.append(saved_bytes(lambda: ordinary(blocks, x, x, None))[0])
    # ordinary stack: every layer keeps its activations (LSH scores included)
    assert ord_bytes[-1] > 5 * ord_bytes[0]
    # reversible: the two output streams plus each LSH layer's int16 buckets (B*H*n_hashes*L*2 bytes)
    streams = 2 * x.numel() * 4
    buckets = 2 * HEADS * 2 * 64 * 2
    for depth, b in zip((1, 2, 6), rev_bytes):
        assert b == streams + depth * buckets, (depth, b)
    assert rev_bytes[-1] < ord_bytes[-1] / 20


def test_six_layer_stack_trains():
    torch.manual_seed(0)
    rev = ReversibleSequence(make_blocks(6, dtype=torch.float32, dropout=0.0))
    head = nn.Linear(E, 1)
    x = torch.randn(4, 16, E)
    y = x[:, :, :1].cumsum(1).mean(1)                  # a target that needs mixing across positions
    opt = torch.optim.Adam(list(rev.parameters()) + list(head.parameters()), lr=5e-3)
    losses = []
    for _ in range(12):
        y1, y2 = rev(x)
        loss = ((head((y1 + y2).mean(1) / 2) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_no_grad_is_plain_loop_and_errors():
    blocks = make_blocks(2, dtype=torch.float32, dropout=0.0)
    rev = ReversibleSequence(blocks)
    x = torch.randn(1, 16, E)
    torch.manual_seed(1)
    with torch.no_grad():
        a = rev(x)
    torch.manual_seed(1)
    b = ordinary(blocks, x, x, None)
    torch.testing.assert_close(a[0], b[0])
    with pytest.raises(TypeError, match=r"blocks\[0\] must be a pair"):
        ReversibleSequence([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="at least one"):
        ReversibleSequence([])
    with pytest.raises(ValueError, match="x1 and x2"):
        rev(x, x[:, :8])


def test_lsh_self_attention_pads_and_replays_buckets():
    torch.manual_seed(0)
    m = LSHSelfAttention(E, HEADS, n_hashes=2, chunk_len=8)
    x = torch.randn(2, 13, E)
    out, b = m(x, return_buckets=True)
    assert out.shape == (2, 13, E) and b.shape == (2, HEADS, 2, 16)
    torch.testing.assert_close(m(x, buckets=b), out)
    with pytest.raises(ValueError, match="n_buckets must be an even"):
        LSHSelfAttention(E, HEADS, n_buckets=5)
    with pytest.raises(ValueError, match="num_heads=3 must divide"):
        LSHSelfAttention(E, 3)
