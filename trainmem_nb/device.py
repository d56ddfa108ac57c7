"""What a device adds around the tensors: allocator rounding, cached segments, context, workspaces.

``peak_allocated_bytes`` is what ``torch.cuda.max_memory_allocated()`` reports: tensors (each rounded
to 512 B) plus cuBLAS workspaces, which PyTorch allocates through its caching allocator.
``peak_reserved_bytes`` adds what the caching allocator holds but has not handed out (segment rounding
and fragmentation). ``device_total_bytes`` is what ``nvidia-smi`` shows: reserved plus the CUDA
context. The constants below are modelled from their sources and checked on one GPU (an H200, the
measurements in validation/gpu); a calibration measured on the user's GPU (``trainmem measure --device
cuda``) replaces them."""

from __future__ import annotations

__all__ = ['CUBLAS_HANDLES_PER_STEP', 'CUBLAS_HANDLE_WORKSPACE_BYTES', 'CUBLAS_WORKSPACE_BYTES', 'CUDA_BLOCK_BYTES', 'CUDA_CONTEXT_BYTES', 'CUDA_CONTEXT_EAGER_BYTES', 'LARGE_SEGMENT_BYTES', 'REPLAY_MAX_BYTES',
           'REPLAY_MAX_EVENTS', 'RESERVED_CHURN_FRACTION', 'round_block']

#: Every CUDA caching-allocator block is a multiple of 512 B (``kMinBlockSize``,
#: c10/cuda/CUDACachingAllocator.cpp); ``max_memory_allocated`` counts the rounded sizes.
CUDA_BLOCK_BYTES = 512

#: Allocations above 1 MiB come from segments rounded to 2 MiB (``kRoundLarge``, same file).
LARGE_SEGMENT_BYTES = 2 << 20

#: cuBLAS workspace PyTorch allocates per handle and stream through the caching allocator:
#: ``:4096:2:16:8`` = 2 x 4 MiB + 8 x 16 KiB, and 32 MiB on compute capability 9.x, 10.x and 12.x
#: (Hopper, Blackwell). Sources: aten/src/ATen/cuda/CublasHandlePool.cpp ``parseChosenWorkspaceSize``
#: (pytorch/pytorch#89027 for Hopper; #175344, 2026-02, for Blackwell) and the cuBLAS docs'
#: cublasSetWorkspace recommendation. cuBLASLt shares it (no second workspace was allocated on an H200).
CUBLAS_HANDLE_WORKSPACE_BYTES = {"pre-hopper": 2 * (4 << 20) + 8 * (16 << 10), "hopper+": 32 << 20}

#: cuBLAS handles a training step holds a workspace for: handles are per thread (``DeviceThreadHandlePool``),
#: and autograd runs the backward on its own device thread, so the forward's thread and the backward's each
#: have one. Measured on an H200 (torch 2.11, scripts/gpu_probe.py): 32 MiB allocated after a first matmul,
#: 64 MiB after a backward through it; the measured H200 steps (validation/gpu/h200) begin with 64 MiB + 512 B
#: allocated beyond their tensors.
CUBLAS_HANDLES_PER_STEP = 2

#: The workspaces of a step, by GPU generation; "default" is Hopper's and Blackwell's, the cards most
#: training runs on now (an Ampere or Ada card holds 48 MiB less; a calibration from it says so).
CUBLAS_WORKSPACE_BYTES = {k: CUBLAS_HANDLES_PER_STEP * v for k, v in CUBLAS_HANDLE_WORKSPACE_BYTES.items()}
CUBLAS_WORKSPACE_BYTES["default"] = CUBLAS_WORKSPACE_BYTES["hopper+"]

#: CUDA context (driver state and the kernels loaded so far) of a PyTorch training process, visible in
#: nvidia-smi but not in PyTorch's counters: 766.8 MiB after a training step with SDPA on an NVIDIA H200
#: (torch 2.11 + CUDA 13.0, driver 580.159; `trainmem measure --device cuda`, validation/gpu/h200:
#: total - free - memory_reserved(); 750.8 MiB with eager attention, whose flash kernels never load).
#: About 300 MB right after start-up with lazy loading (pytorch/pytorch#107667, ptrblck 2023). Other GPUs
#: and CUDA versions differ: calibrate on yours.
CUDA_CONTEXT_BYTES = 804061184

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
#: allocated for LLM training; 0.10 of the churn is a middle value, and the median of the nine steps measured
#: on an H200 (validation/gpu/h200: 0.047 to 0.426, the replay gets each within 1.4 %). Calibrate for your own.
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
