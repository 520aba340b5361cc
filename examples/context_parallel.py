"""Context parallelism on a CPU box: one causal sequence sharded over the ranks, checked against one
process.

    torchrun --nproc_per_node=2 examples/context_parallel.py
"""
import torch
import torch.distributed as dist

import effattn
import effattn.distributed as ecp

dist.init_process_group("gloo")                     # "nccl" on GPUs (one rank per GPU)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)                                # every rank builds the same full sequence
q, k, v = (torch.randn(1, 4, 64 * world, 32) for _ in range(3))

# each rank holds 64 tokens: zigzag gives every rank the same share of the causal work
ql, kl, vl = (ecp.shard(t, dim=2, balance="zigzag").requires_grad_() for t in (q, k, v))
out = ecp.attention(ql, kl, vl, method="ring", balance="zigzag", causal=True)
out.square().sum().backward()                       # ring backward: dK/dV travel back to their owners

full = ecp.unshard(out.detach(), dim=2, balance="zigzag")
ref = effattn.attention(q, k, v, causal=True)
ecp.reset_bytes_sent()
with torch.no_grad():                               # a window shorter than a shard: only the halo moves
    ecp.attention(*(ecp.shard(t, dim=2) for t in (q, k, v)), causal=True, window=16)
print(f"rank {rank}/{world}: max |out - single process| = {(full - ref).abs().max():.2e}, "
      f"dq shard {tuple(ql.grad.shape)}, window-16 halo sent {ecp.bytes_sent()} bytes")
dist.destroy_process_group()
