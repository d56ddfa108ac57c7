"""What a GPU allocates outside the tensors a step makes: cuBLAS workspaces per thread, the SDPA backend.

    python scripts/gpu_probe.py

prints ``memory_allocated()`` after a bf16 matmul on the main thread, after a backward through one
(the autograd engine's device thread has a cuBLAS handle of its own), and which SDPA backends are on.
"""

from __future__ import annotations

import torch


def main() -> None:
    mib = 1 << 20
    base = torch.cuda.memory_allocated()
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    held = torch.cuda.memory_allocated() - base
    c = a @ b
    fwd = torch.cuda.memory_allocated() - base - held - c.untyped_storage().nbytes()
    print(f"after a forward matmul: {fwd / mib:.3f} MiB beyond the tensors")
    c.sum().backward()
    torch.cuda.synchronize()
    bwd = torch.cuda.memory_allocated() - base - held - c.untyped_storage().nbytes() - a.grad.untyped_storage().nbytes()
    print(f"after a backward through it: {bwd / mib:.3f} MiB beyond the tensors")
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.float32)
    before = torch.cuda.memory_allocated()
    y = torch.nn.functional.linear(x, torch.randn(256, 256, device="cuda"))
    print(f"fp32 linear adds {(torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()) / mib:.3f} MiB")
    print("sdpa: flash", torch.backends.cuda.flash_sdp_enabled(), "mem_efficient",
          torch.backends.cuda.mem_efficient_sdp_enabled(), "cudnn", torch.backends.cuda.cudnn_sdp_enabled(),
          "math", torch.backends.cuda.math_sdp_enabled(), "blas", torch.backends.cuda.preferred_blas_library())


if __name__ == "__main__":
    main()
