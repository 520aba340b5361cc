"""Packed sequences vs padding, and context parallelism on gloo (issue 23).

    python -m benchmarks.packed_cp packed        # packed (cu_seqlens) vs padded (key_padding_mask), 50% padding
    python -m benchmarks.packed_cp cp            # effattn.distributed at world 1 / 2 / 4 (gloo, CPU processes)
    python -m benchmarks.packed_cp all --out benchmarks/results/cpu/packed_cp.md

packed: B documents whose lengths average half the padded length (50% padding), causal. "padded" is one
call on ``(B, H, Lmax, D)`` with a key padding mask (padding rows computed and discarded); "packed" is
one call on ``(1, H, sum of lengths, D)`` with ``cu_seqlens``. Median milliseconds of forward and
forward+backward, and the bytes of q, k, v and the output each layout holds (on a GPU also the peak
allocated memory of the call).

cp: one sequence of L tokens sharded over W gloo processes on this machine, each with one torch
thread; per method the median milliseconds of a forward and a forward+backward (the slowest rank) and
the bytes each rank sends per forward (`effattn.distributed.bytes_sent`). With more processes than
cores the times measure the machine's oversubscription, not the method: read them with the core count
printed above the table.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch

import effattn


def _median_ms(fn, runs: int) -> float:
    fn()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def _lengths(B: int, Lmax: int, seed: int = 0):
    """B document lengths in [1, Lmax] averaging Lmax / 2 (50% padding)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(1, Lmax + 1, (B,), generator=g)
    n = (n.float() * (B * Lmax / 2) / n.sum()).round().clamp(1, Lmax).long()
    return n.tolist()


def packed_table(B=8, Lmax=1024, H=4, D=64, runs=3, device="cpu", dtype=torch.float32):
    lens = _lengths(B, Lmax)
    T = sum(lens)
    rows = []
    g = torch.Generator().manual_seed(1)
    qp, kp, vp = (torch.randn(1, H, T, D, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    pad = torch.ones(B, Lmax, dtype=torch.bool, device=device)
    qb, kb, vb = (torch.zeros(B, H, Lmax, D, device=device, dtype=dtype) for _ in range(3))
    for b, (a, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        pad[b, :n] = False
        for dst, src in ((qb, qp), (kb, kp), (vb, vp)):
            dst[b, :, :n] = src[0, :, a:a + n].detach()
    for t in (qb, kb, vb):
        t.requires_grad_()
    # padded causal: right padding, so bottom-right causal over Lmax equals each document's causal rows
    cases = {
        "padded (key_padding_mask)": (lambda: effattn.attention(qb, kb, vb, causal=True, key_padding_mask=pad),
                                      (qb, kb, vb)),
        "packed (cu_seqlens)": (lambda: effattn.attention(qp, kp, vp, causal=True, cu_seqlens=cu, max_seqlen=max(lens)),
                                (qp, kp, vp)),
    }
    if device == "cpu":
        from effattn.backends.torch.attention import cpu_blocks

        def work_list():
            cpu_blocks.ENABLED = False          # the CPU rows (torch/cpu-segments included) step aside
            try:
                return effattn.attention(qp, kp, vp, causal=True, cu_seqlens=cu, max_seqlen=max(lens))
            finally:
                cpu_blocks.ENABLED = True

        cases["packed, reference work list (fast paths off)"] = (work_list, (qp, kp, vp))
    for name, (f, inputs) in cases.items():
        fwd = _median_ms(lambda: f(), runs)

        def fb():
            out = f()
            torch.autograd.grad(out.sum(), inputs)

        both = _median_ms(fb, runs)
        held = sum(t.numel() * t.element_size() for t in inputs) * 4 // 3       # q, k, v and the output
        peak = ""
        if device != "cpu":
            torch.cuda.reset_peak_memory_stats()
            fb()
            peak = f"{torch.cuda.max_memory_allocated() / 2**20:.1f}"
        path = effattn.explain(*inputs, causal=True, **(
            {"cu_seqlens": cu} if "packed" in name else {"key_padding_mask": pad})).paths.get("torch", "")
        rows.append((name, fwd, both, held / 2**20, peak, "chunked reference" if "work list" in name else path))
    head = (f"B={B} documents, Lmax={Lmax}, {T} real tokens of {B * Lmax} ({100 * (1 - T / (B * Lmax)):.0f}% padding), "
            f"H={H}, D={D}, causal, {dtype}, {device}, torch threads {torch.get_num_threads()}\n\n"
            "| layout | fwd ms | fwd+bwd ms | q/k/v/out MiB | peak MiB | torch path |\n|---|---|---|---|---|---|\n")
    return head + "".join(f"| {n} | {a:.1f} | {b:.1f} | {m:.1f} | {p} | {path} |\n" for n, a, b, m, p, path in rows)


# ------------------------------------------------------------------------------------ context parallel

CP_CASES = [
    ("ring", "zigzag", dict(causal=True)),
    ("ring", "contiguous", dict(causal=True)),
    ("ulysses", "zigzag", dict(causal=True)),
    ("allgather", "zigzag", dict(causal=True)),
    ("ring", "contiguous", dict(causal=True, window=256)),     # halo exchange
]


def _cp_worker(rank, world, port, L, H, D, runs, queue):
    import torch.distributed as dist

    import effattn.distributed as ecp
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, H, L, D, generator=g) for _ in range(3)]
    for method, balance, kw in CP_CASES:
        shards = [ecp.shard(t, dim=2, balance=balance).requires_grad_() for t in full]

        def fwd():
            with torch.no_grad():
                ecp.attention(*shards, method=method, balance=balance, **kw)

        def fb():
            out = ecp.attention(*shards, method=method, balance=balance, **kw)
            torch.autograd.grad(out.sum(), shards)

        res = []
        for f in (fwd, fb):
            f()
            ts = []
            for _ in range(runs):
                dist.barrier()
                t = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t)
            slowest = torch.tensor([statistics.median(ts) * 1e3])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            res.append(float(slowest))
        ecp.reset_bytes_sent()
        fwd()
        sent = torch.tensor([float(ecp.bytes_sent())])
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        if rank == 0:
            queue.put((world, method, balance, kw, res[0], res[1], int(sent)))
    dist.destroy_process_group()


def cp_table(L=4096, H=4, D=64, worlds=(1, 2, 4), runs=3):
    import torch.multiprocessing as mp
    ctx = mp.get_context("fork")
    rows = []
    for world in worlds:
        queue = ctx.SimpleQueue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_cp_worker, args=(world, port, L, H, D, runs, queue), nprocs=world, start_method="fork")
        while not queue.empty():
            rows.append(queue.get())
    head = (f"L={L}, H={H}, D={D}, fp32, gloo on {os.cpu_count()} CPU cores, one torch thread per rank; times are "
            "the slowest rank's median; bytes = the most any rank sends in one forward\n\n"
            "| world | method | balance | mask | fwd ms | fwd+bwd ms | bytes sent / rank (fwd) |\n"
            "|---|---|---|---|---|---|---|\n")
    mask = lambda kw: "causal" + (f", window {kw['window']}" if "window" in kw else "")   # noqa: E731
    return head + "".join(f"| {w} | {m} | {b} | {mask(kw)} | {a:.0f} | {c:.0f} | {n:,} |\n"
                          for w, m, b, kw, a, c, n in rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["packed", "cp", "all"])
    p.add_argument("--out", help="also write the tables (markdown) to this file")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--length", type=int, default=4096, help="cp: the sequence length")
    p.add_argument("--lmax", type=int, default=1024, help="packed: the padded length")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    parts = []
    if args.what in ("packed", "all"):
        torch.set_num_threads(1)
        parts.append("### Packed vs padded\n\n" + packed_table(Lmax=args.lmax, runs=args.runs, device=device,
                                                                dtype=dtype))
    if args.what in ("cp", "all"):
        parts.append("### Context parallelism (gloo)\n\n" + cp_table(L=args.length, runs=args.runs))
    text = "\n".join(parts)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
