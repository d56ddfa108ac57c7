"""What a device adds around the tensors: allocator rounding, cached segments, context, workspaces.

``peak_allocated_bytes`` is what ``torch.cuda.max_memory_allocated()`` reports: tensors (each rounded
to 512 B) plus cuBLAS workspaces, which PyTorch allocates through its caching allocator.
``peak_reserved_bytes`` adds what the caching allocator holds but has not handed out (segment rounding
and fragmentation). ``device_total_bytes`` is what ``nvidia-smi`` shows: reserved plus the CUDA
context. The constants below are modelled from their sources, not measured here (this machine has no
GPU); a calibration measured on the user's GPU (``trainmem measure --device cuda``) replaces them."""

from __future__ import annotations

__all__ = ['CUBLAS_WORKSPACE_BYTES', 'CUDA_BLOCK_BYTES', 'CUDA_CONTEXT_BYTES', 'CUDA_CONTEXT_EAGER_BYTES', 'LARGE_SEGMENT_BYTES', 'REPLAY_MAX_BYTES',
           'REPLAY_MAX_EVENTS', 'RESERVED_CHURN_FRACTION', 'round_block']

#: Every CUDA caching-allocator block is a multiple of 512 B (``kMinBlockSize``,
#: c10/cuda/CUDACachingAllocator.cpp); ``max_memory_allocated`` counts the rounded sizes.
CUDA_BLOCK_BYTES = 512

#: Allocations above 1 MiB come from segments rounded to 2 MiB (``kRoundLarge``, same file).
LARGE_SEGMENT_BYTES = 2 << 20

#: cuBLAS workspace PyTorch allocates per handle and stream through the caching allocator:
#: ``:4096:2:16:8`` = 2 x 4 MiB + 8 x 16 KiB by default, 32 MiB on Hopper (sm90). Sources:
#: pytorch/pytorch#89027 (aten/src/ATen/cuda/CublasHandlePool.cpp) and the cuBLAS docs'
#: cublasSetWorkspace recommendation. One handle is used by a training step on one stream.
CUBLAS_WORKSPACE_BYTES = {"default": 2 * (4 << 20) + 8 * (16 << 10), "sm90": 32 << 20}

#: CUDA context (driver state and lazily loaded kernels) of a PyTorch training process, visible in
#: nvidia-smi but not in PyTorch's counters: ~300 MB at start-up with CUDA lazy loading
#: (pytorch/pytorch#107667, ptrblck 2023), growing as cuBLAS/cuDNN/attention kernels load; 512 MiB is
#: a typical figure after a training step. Calibrate on your GPU for its own value.
CUDA_CONTEXT_BYTES = 512 << 20

#: The CUDA context when every kernel of the loaded libraries goes into it at start-up (no lazy module
#: loading: CUDA before 11.7, or torch before 1.13, which does not set ``CUDA_MODULE_LOADING=LAZY``):
#: 1343 MiB measured on a Tesla V100 16 GB with CUDA 11.2 (huggingface/transformers
#: docs/source/en/perf_train_gpu_one.mdx @0016acf7: ``torch.ones((1, 1)).to("cuda")`` -> "GPU memory
#: occupied: 1343 MB", pynvml ``used // 1024**2``). Others: 636 MiB vs 274 MiB lazy (pytorch/pytorch#86509,
#: GPU not named); ">1000MB" (ptrblck, pytorch/pytorch#107667). The libraries' kernels differ by version
#: and GPU: calibrate on yours.
CUDA_CONTEXT_EAGER_BYTES = 1343 << 20

#: Caching-allocator overhead above the allocated peak, as a fraction of the memory that churns
#: within a step (activations and temporaries): freed blocks stay cached and split blocks fragment.
#: The PyTorch memory-management notes and the measurement harness's notes put reserved 5-30 % above
#: allocated for LLM training; 0.10 of the churn is a middle value. Calibrate for your own.
RESERVED_CHURN_FRACTION = 0.10

#: The allocator replay's limits (design choices, not facts of the world). A step longer than this many
#: allocator events (two steps and the loading) is not replayed: the replay runs ~1 µs per event, and the
#: longest preset step, qwen3-235b-a22b's 94 layers, has ~92,000, so 400,000 keeps a replay within about a
#: second while a custom model with thousands of layers does not freeze the explorer. Beyond either limit
#: the reserved bytes come from the churn model (`RESERVED_CHURN_FRACTION`) and the estimate says so.
REPLAY_MAX_EVENTS = 400_000

#: ... nor a step whose allocated peak exceeds 1 PiB (some 5,000 of the largest cards): no card fits it, and
#: the replay's synthetic address space (2**56 bytes, `trainmem_nb.spec.alloc_conf`) stays far from full.
REPLAY_MAX_BYTES = 1 << 50


def round_block(nbytes: int) -> int:
    """Bytes the CUDA caching allocator accounts for a tensor of `nbytes` (0 stays 0)."""
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES if nbytes > 0 else 0
