"""The README's conventions table states what other libraries do; what can run here is checked here,
against the installed torch (the README names the version). FlashAttention's entries cannot run on a
CPU: the README cites the source lines instead."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import effattn

CPU_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def qkv(Lq=3, Lk=5, D=4):
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 1, Lq, D, generator=g), torch.randn(1, 1, Lk, D, generator=g), torch.randn(1, 1, Lk, D, generator=g)


def masked(q, k, v, mask):
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ v


@pytest.mark.parametrize("which", CPU_SDPA, ids=lambda b: b.name)
def test_sdpa_is_causal_is_top_left_and_effattn_bottom_right(which):
    q, k, v = qkv(Lq=3, Lk=5)
    with sdpa_kernel([which]):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    top_left = torch.ones(3, 5, dtype=torch.bool).tril()                  # query i sees keys j <= i
    bottom_right = torch.ones(3, 5, dtype=torch.bool).tril(5 - 3)          # j <= i + Lk - Lq
    torch.testing.assert_close(got, masked(q, k, v, top_left))
    torch.testing.assert_close(effattn.attention(q, k, v, causal=True), masked(q, k, v, bottom_right))


@pytest.mark.parametrize("which", CPU_SDPA, ids=lambda b: b.name)
def test_sdpa_bool_mask_true_means_attend(which):
    q, k, v = qkv()
    keep = torch.tensor([True, True, False, True, False])
    with sdpa_kernel([which]):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=keep.expand(1, 1, 3, 5))
    torch.testing.assert_close(got, masked(q, k, v, keep.expand(3, 5)))
    ours = effattn.attention(q, k, v, key_padding_mask=~keep[None])      # effattn: True = ignore
    torch.testing.assert_close(ours, got)


@pytest.mark.parametrize("which", CPU_SDPA, ids=lambda b: b.name)
def test_sdpa_row_that_sees_no_key_is_zero_on_cpu(which):
    """README: SDPA on CPU (torch 2.13) returns 0 for a boolean mask row with no True, not NaN."""
    q, k, v = qkv()
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 1, :] = False
    with sdpa_kernel([which]):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(got[0, 0, 1], torch.zeros(4)), f"torch {torch.__version__}: {got[0, 0, 1]}"
    assert torch.isfinite(got).all()


def test_sdpa_default_scale_is_one_over_sqrt_d():
    q, k, v = qkv(D=16)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v),
                               masked(q, k, v, torch.ones(3, 5, dtype=torch.bool)))
    torch.testing.assert_close(effattn.attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
