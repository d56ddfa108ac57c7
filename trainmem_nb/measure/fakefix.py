"""Make transformers, peft and PyTorch's meta kernels treat fake tensors as they treat real CPU ones.

Under ``FakeTensorMode`` the Hugging Face code must take the path it takes on real tensors, or the
measurement would describe a different step. Three places differ in the versions we pin
(torch 2.13, transformers 5.24, peft 0.21); each fix below is applied only while a fake step is built
and run, and ``tests/test_measure.py`` proves fake == real CPU, byte for byte, for every family.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["fake_mode_fixes", "fake_scalar_reads"]


@contextlib.contextmanager
def _unpacked_sequences() -> Iterator[None]:
    """Our inputs are never packed: say so, as transformers concludes itself on real tensors.

    transformers' mask builder calls ``find_packed_sequence_indices`` when it cannot look at the data
    (it treats fake tensors as "tracing"); without an answer it builds an explicit (b, 1, s, s) mask,
    SDPA loses ``is_causal`` and grouped-query k/v get ``repeat_kv`` copies that a real run never makes.
    """
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _convert_module_params(module: nn.Module, device: torch.device | None, dtype: torch.dtype | None) -> None:
    """Move `module`'s parameters and buffers to `device` (and floating ones to `dtype`) by rebinding.

    Parameters shared by several modules (tied weights) stay shared: each is converted once.
    """
    done: dict[int, nn.Parameter] = {}
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if param is None:
                continue
            if id(param) in done:
                owner._parameters[name] = done[id(param)]
                continue
            target = device if device is not None else param.device
            cast = dtype if dtype is not None and param.is_floating_point() else param.dtype
            if param.device != target or param.dtype != cast:
                new = nn.Parameter(param.detach().to(device=target, dtype=cast), requires_grad=param.requires_grad)
                done[id(param)] = new
                owner._parameters[name] = new
        for name, buf in list(owner._buffers.items()):
            if buf is None:
                continue
            target = device if device is not None else buf.device
            cast = dtype if dtype is not None and buf.is_floating_point() else buf.dtype
            if buf.device != target or buf.dtype != cast:
                owner._buffers[name] = buf.to(device=target, dtype=cast)


@contextlib.contextmanager
def _module_to_by_rebinding() -> Iterator[None]:
    """Let ``nn.Module.to`` work on fake parameters.

    For fake parameters ``nn.Module._apply`` always swaps tensors in place
    (``torch.utils.swap_tensors``), which fails ("Couldn't swap Linear.weight": the fake mode holds a
    weak reference to each fake tensor), even when nothing changes. peft moves every new adapter
    with ``.to(device, dtype)`` of its base layer. While a fake step is built, ``Module.to`` rebinds
    converted tensors instead (`_convert_module_params`); the end state is the same as a real run's:
    one storage per parameter, in the target device and dtype, which is all the measurement sees.
    """
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _non_blocking, _memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"nn.Module.to only accepts floating point or complex dtypes, but got desired dtype={dtype}")
        _convert_module_params(self, torch.device(device) if device is not None else None, dtype)
        return self

    nn.Module.to = to  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _grouped_mm_any_dtype() -> Iterator[None]:
    """Let ``aten._grouped_mm``'s meta kernel accept the dtypes the CPU kernel accepts.

    transformers 5.x runs mixture-of-experts layers (Mixtral) with ``torch.nn.functional.grouped_mm``,
    whose CPU kernel takes fp32/fp16/bf16 but whose meta function copies the CUDA rule "BF16 only", so a
    fake fp32 step fails where a real one runs. Routing is data-dependent but shapes are not: every
    token goes to ``top_k`` experts, so the grouped matmuls see ``tokens * top_k`` rows whatever the
    router picks. The replacement checks what the CPU kernel checks (2-D or 3-D operands, matching
    contraction sizes) and builds the output as the meta function does on a CPU build.
    """
    from torch import _meta_registrations as meta

    original = getattr(meta, "_meta_grouped_mm_common", None)
    create = getattr(meta, "_create_grouped_mm_output_tensor", None)
    if original is None or create is None:
        yield
        return

    def common(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: Any, scale_b: Any, offs: Any = None,
               bias: Any = None, scale_result: Any = None, out_dtype: Any = None, use_fast_accum: bool = False) -> Any:
        if scale_a is not None or scale_b is not None or mat_a.dtype == torch.bfloat16:
            return original(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum)
        torch._check(mat_a.dtype == mat_b.dtype, lambda: f"grouped_mm dtypes differ: {mat_a.dtype} and {mat_b.dtype}")
        torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "grouped_mm operands must be 2-D or 3-D")
        if mat_a.dim() == 3 or mat_b.dim() == 3:
            torch._check(mat_a.size(-1) == mat_b.size(-2), lambda: "grouped_mm contraction sizes differ")
        return create(mat_a, mat_b, offs, out_dtype)

    meta._meta_grouped_mm_common = common
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = original


class _CpuLayerNormStats(TorchDispatchMode):
    """Give ``native_layer_norm``'s saved mean and rstd the dtype the CPU kernel gives them.

    On CPU a 16-bit input with fp32 weight and bias (a LayerNorm under autocast: bert's MLM head)
    takes the kernel's mixed-type path, which returns fp32 mean/rstd (``param_scalar_type`` in
    aten/src/ATen/native/layer_norm.cpp); the meta function returns them in the input dtype. This
    mode sits between the fake mode and the tracker and hands back fp32 statistics in that case.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.native_layer_norm.default:
            x, weight = args[0], args[2] if len(args) > 2 else None
            if (x.dtype in (torch.bfloat16, torch.float16) and isinstance(weight, torch.Tensor)
                    and weight.dtype == torch.float32):
                y, mean, rstd = out
                out = (y, torch.empty_like(mean, dtype=torch.float32), torch.empty_like(rstd, dtype=torch.float32))
        return out


@contextlib.contextmanager
def fake_mode_fixes() -> Iterator[None]:
    """All fixes a fake step needs, applied together and undone on exit (enter inside the fake mode)."""
    with _unpacked_sequences(), _module_to_by_rebinding(), _grouped_mm_any_dtype(), _CpuLayerNormStats():
        yield


@contextlib.contextmanager
def fake_scalar_reads(value: float = 1.0) -> Iterator[None]:
    """Let ``.item()`` on a fake tensor return `value` (only around ``optimizer.step``).

    Adafactor reads scalars on the host (the step count, parameter and update norms) to compute its
    learning-rate factors; a fake tensor has no value, so FakeTensorMode raises. Those values scale
    the update but never decide a shape or an allocation, so any positive number gives the same
    memory. Only used around the optimizer step, where no control flow depends on such a read.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    FakeTensor.item = lambda self: value  # type: ignore[method-assign]
    try:
        yield
    finally:
        del FakeTensor.item
