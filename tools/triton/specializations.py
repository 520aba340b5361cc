"""How many kernels Triton would compile for the Triton attention launchers across sequence lengths,
read without a GPU.

Triton compiles one kernel per *specialization* of a launch: the types of the arguments, the
constexprs, and for each int argument not listed in ``do_not_specialize`` a hint taken from its value
(1 becomes a constant, a multiple of 16 gets a divisibility hint). A length argument left
specialized gives each new length class (a multiple of 16 or not, 1 or not) its own compile, seconds
each on a GPU host. This script runs the real launchers (``launch.fwd`` / ``launch.bwd``, fixed
configs) on CPU tensors with every ``@triton.jit`` kernel of the launch module replaced by a recorder
that computes the launch's specialization with Triton's own binder for an sm_90 target (what
``kernel[grid](...)`` computes before looking up its cache), then counts the distinct ones per kernel.

    python -m tools.triton.specializations                  # causal, window and layout calls
    python -m tools.triton.specializations --lengths 1000,1024,1 --json

Under ``TRITON_INTERPRET=1`` it reads the JIT functions the interpreted kernels would be on a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List

LENGTHS = (1000, 1013, 1024, 1536, 2000, 4096)


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **meta)`` records the specialization Triton's
    binder computes for the launch (nothing is compiled or launched)."""

    def __init__(self, kernel, backend, seen: Dict[str, set]):
        from triton.runtime.jit import JITFunction, create_function_from_signature
        if not isinstance(kernel, JITFunction):     # interpreted: the JIT function it would be on a GPU
            kernel = JITFunction(kernel.fn, **{k: v for k, v in kernel.kwargs.items() if "specialize" in k})
        self.name = kernel.fn.__name__
        self.binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        self.seen = seen

    def __getitem__(self, grid):
        def record(*args, **meta):
            _, specialization, options = self.binder(*args, **meta)
            self.seen.setdefault(self.name, set()).add(repr((specialization, options)))
        return record


def count(case: str, lengths, arch: int = 90, kernels=None, bwd_config=None) -> Dict[str, int]:
    """Distinct specializations per kernel over forward and backward calls of `case` at `lengths`
    (Lq = Lk = L; "decode": Lq = 1, Lk = L). `kernels`: name -> a kernel read in place of the launch
    module's (e.g. the same function with another ``do_not_specialize``); ``bwd_config``: the
    backward's config instead of the first candidate (e.g. a five-product one)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from effattn.backends.triton.attention import configs, launch
    from effattn.layouts import sliding_and_summary
    backend = make_backend(GPUTarget("cuda", arch, 32))
    seen: Dict[str, set] = {}
    saved = {n: k for n, k in vars(launch).items() if isinstance(k, (JITFunction, InterpretedFunction))}
    try:
        for n, k in saved.items():
            setattr(launch, n, _Recorder((kernels or {}).get(n, k), backend, seen))
        B, H, D = 1, 2, 64
        for L in lengths:
            Lq = 1 if case == "decode" else L
            q = torch.randn(B, H, Lq, D, dtype=torch.bfloat16)
            k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(2))
            mask, bs, left, right = None, 0, -1, 0
            if case == "window":
                left = 256
            elif case == "layout":
                lay = sliding_and_summary(L, 64, local_blocks=4, every=4)
                mask, bs = lay.mask, lay.block_size
            cfg = {kind: configs.candidates(kind, 64, 2)[0] for kind in ("fwd", "bwd")}
            args = (mask, bs, None, None, D ** -0.5, 0.0, left, right)
            out, lse = launch.fwd(q, k, v, *args, config=cfg["fwd"])
            if case != "decode":
                launch.bwd(torch.randn_like(out), None, q, k, v, out, lse, *args, config=bwd_config or cfg["bwd"])
    finally:
        for n, k in saved.items():
            setattr(launch, n, k)
    return {name: len(s) for name, s in sorted(seen.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma list of sequence lengths")
    ap.add_argument("--cases", default="causal,window,layout,decode")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import triton
    lengths = [int(x) for x in args.lengths.split(",")]
    rows: List[dict] = []
    for case in args.cases.split(","):
        rows += [dict(case=case, kernel=k, lengths=len(lengths), variants=n) for k, n in count(case, lengths).items()]
    if args.json:
        print(json.dumps(dict(triton=triton.__version__, lengths=lengths, rows=rows)))
        return 0
    print(f"triton {triton.__version__}, sm_90, lengths {lengths}\n")
    print("| case | kernel | compiled variants |\n|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['kernel']} | {r['variants']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
