"""Testing support shared by effattn's tests and its benchmark suite (not imported by ``import effattn``).

- `oracle`: an independent float64 attention and linear attention, written from the conventions
  alone (docs/conventions.md), with their gradients; the reference kernels are judged against.
- `checks`: CUDA-graph replay and torch.compile against eager, and a switch for torch's TF32 matmuls.
"""
