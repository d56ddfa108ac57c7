"""QLoRA's layers as transformers and peft build them: every projection a bitsandbytes ``Linear4bit``
(biased or not, ``nn.Linear`` or gpt2's ``Conv1D``), and an adapted one peft's ``lora.bnb.Linear4bit``."""

from __future__ import annotations

import importlib.util

import pytest

from trainmem_nb.model.params import weight_tensors
from trainmem_nb.model.presets import get_model
from trainmem_nb.spec.training import TrainingSpec
from trainmem_nb.step.compile import compile_step

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None and importlib.util.find_spec("peft") is not None


def _forward_allocations(prog, module: str, b: int, s: int) -> list[tuple[str, int]]:  # type: ignore[no-untyped-def]
    """(label, bytes) of the forward allocations of `module` in the first layer of a compiled step."""
    out = []
    for seg in prog.segments:
        if seg.phase != "forward":
            continue
        out += [(label, int(sz.at(b, s))) for _cat, sign, sz, label in seg.events if sign > 0 and label.startswith(module)]
        if out:
            return out
    return out


@pytest.mark.parametrize("model", ["gpt2", "opt-125m", "bert-base", "pythia-160m", "phi-1.5", "starcoder2-3b",
                                   "qwen2.5-0.5b"])
def test_every_4bit_projection_runs_bitsandbytes_matmul_biased_or_not(model: str) -> None:
    # transformers' replace_with_bnb_linear makes every nn.Linear and Conv1D a Linear4bit (bias kept);
    # a biased projection used to run the full-precision addmm on the 4-bit weight
    m = get_model(model).layer_slice(0, 2)
    t = TrainingSpec(method="qlora", precision="bf16-true", micro_batch=1, seq_len=64)
    quantized = [p.name[len("layers."):-len(".weight")] for p, dt, _ in weight_tensors(m, t)
                 if dt < 1 and p.name.startswith("layers.")]
    assert quantized
    labels = {label for seg in compile_step(m, t).segments for *_rest, label in seg.events}
    for module in quantized:
        assert any(label.startswith(module) and label.endswith("dequantize_4bit") for label in labels), module


def test_a_qlora_adapter_clones_the_4bit_result_and_casts_its_own_output_before_the_add() -> None:
    # peft's lora.bnb.Linear4bit: result.clone(); x to the adapter dtype; lora_B(lora_A(x)) * scaling
    # cast to the result's dtype; then the add in that dtype (lora.Linear adds in fp32 and casts the sum)
    m = get_model("llama-3.2-1b").layer_slice(0, 1)
    t = TrainingSpec(method="qlora", precision="bf16-true", micro_batch=2, seq_len=16)
    events = _forward_allocations(compile_step(m, t), "self_attn.q_proj", 2, 16)
    labels = [label for label, _ in events]
    tail = labels[labels.index("self_attn.q_proj result.clone()"):]
    assert tail == ["self_attn.q_proj result.clone()", "self_attn.q_proj lora input cast", "self_attn.q_proj.lora_A",
                    "self_attn.q_proj.lora_B", "self_attn.q_proj * scaling", "self_attn.q_proj output to result dtype",
                    "self_attn.q_proj + lora"]
    sizes = dict(events)
    out_bf16 = 2 * 16 * m.hidden * 2
    assert sizes["self_attn.q_proj result.clone()"] == sizes["self_attn.q_proj + lora"] == out_bf16
    assert sizes["self_attn.q_proj * scaling"] == 2 * out_bf16  # the fp32 adapter's output, before its cast


def test_under_cuda_autocast_peft_leaves_the_adapter_dtypes_to_autocast() -> None:
    # torch.is_autocast_enabled() without a device asks about CUDA: on CUDA under bf16-mixed peft does
    # not convert; in a CPU autocast region it still does (the 16-bit adapter output back to the fp32
    # result's dtype; x is already fp32 there, so its cast to the adapter dtype is free)
    m = get_model("llama-3.2-1b").layer_slice(0, 1)
    for device, converts in (("cuda", False), ("cpu", True)):
        t = TrainingSpec(method="qlora", precision="bf16-mixed", device=device, micro_batch=2, seq_len=16)
        labels = [label for label, _ in _forward_allocations(compile_step(m, t), "self_attn.q_proj", 2, 16)]
        assert "self_attn.q_proj result.clone()" in labels
        assert ("self_attn.q_proj output to result dtype" in labels) is converts, device


@pytest.mark.torch
@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes and peft (the measure extra)")
def test_the_adapter_allocates_what_peft_4bit_layer_allocates_on_cpu() -> None:
    # a dispatch log of peft's real lora.bnb.Linear4bit forward (bitsandbytes' CPU backend): every
    # tensor allocated after the 4-bit matmul, in order, against the estimator's events for the layer
    import bitsandbytes as bnb
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.utils._python_dispatch import TorchDispatchMode

    b, s, hidden, rank = 2, 16, 64, 8

    class One(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = bnb.nn.Linear4bit(hidden, hidden, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q_proj(x)

    model = One()
    model.q_proj.weight = bnb.nn.Params4bit(torch.randn(hidden, hidden), requires_grad=False, quant_type="nf4")
    model = model.to("cpu")  # quantizes
    model.is_loaded_in_4bit = True  # what from_pretrained sets: peft then wraps with lora.bnb.Linear4bit
    peft_model = get_peft_model(model, LoraConfig(r=rank, target_modules=["q_proj"], lora_dropout=0.0))
    assert type(peft_model.base_model.model.q_proj).__module__ == "peft.tuners.lora.bnb"
    views = {"view", "_unsafe_view", "t", "expand", "detach", "alias"}
    seen: list[tuple[str, int]] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if name not in views and isinstance(out, torch.Tensor):
                seen.append((name, out.numel() * out.element_size()))
            return out

    x = torch.randn(b, s, hidden, dtype=torch.bfloat16)
    with Log():
        peft_model(x)
    names = [n for n, _ in seen]
    real = seen[names.index("clone"):]

    m = get_model("llama-3.2-1b").layer_slice(0, 1).model_copy(
        update={"hidden": hidden, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16})
    t = TrainingSpec(method="qlora", precision="bf16-true", lora_rank=rank, lora_dropout=0.0, micro_batch=b, seq_len=s)
    ours = _forward_allocations(compile_step(m, t), "self_attn.q_proj", b, s)
    labels = [label for label, _ in ours]
    ours = ours[labels.index("self_attn.q_proj result.clone()"):]
    assert [n for _, n in ours] == [n for _, n in real], (ours, real)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes and peft (the measure extra)")
@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-30b-a3b", "olmo-2-1b", "gemma-2-2b", "gemma-3-1b", "phi-1.5",
                                  "starcoder2-3b", "granite-3.1-2b", "smollm3-3b", "gpt-oss-20b", "deepseek-v3"])
def test_the_families_4bit_layout_is_what_transformers_quantizes(name: str) -> None:
    """QLoRA's parameter layout of each family of issue 12 (which weights are NF4) against transformers' own
    bitsandbytes quantizer run on the model built on the meta device: every nn.Linear but the head and the
    modules a family keeps in fp32; MoE expert stacks (3-D parameters) and routers as their classes are."""
    import warnings

    import bitsandbytes as bnb
    import torch
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    from trainmem_nb.measure.models import hf_config_object, hf_model_class
    from trainmem_nb.model.hf_config import to_hf_config

    full = get_model(name)
    m = full.layer_slice(2, 4) if full.dense_layers else full.layer_slice(0, 2)  # DeepSeek-V3: two MoE layers
    t = TrainingSpec(method="qlora", micro_batch=1, seq_len=64)
    ours = {p.name.removeprefix("layers.").removesuffix(".weight") for p, dt, _ in weight_tensors(m, t) if dt < 1}
    cfg = to_hf_config(m)
    cls = hf_model_class(cfg["model_type"], cfg.get("architectures"))
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = cls.from_config(hf_config_object(cfg)) if hasattr(cls, "from_config") else cls(hf_config_object(cfg))
        Bnb4BitHfQuantizer(BitsAndBytesConfig(load_in_4bit=True))._process_model_before_weight_loading(model, None)
    theirs = set()
    for module, layer in model.named_modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            parts = module.split(".")
            theirs.add(".".join(parts[parts.index("layers") + 2:]) if "layers" in parts else module)
    assert ours == theirs


@pytest.mark.torch
@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes and peft (the measure extra)")
@pytest.mark.parametrize("storage", ["uint8", "base"])
def test_peft_gives_a_4bit_layers_adapters_fp32_or_with_autocast_off_its_compute_dtype(storage: str) -> None:
    # what lora_dtype 'fp32' and 'base' mean under QLoRA, read off today's peft (0.21) on a real bitsandbytes
    # layer: upcast to fp32 by default; with autocast_adapter_dtype=False the layer's compute dtype, whatever
    # the 4-bit storage (huggingface/peft#2893; before 0.19 the storage dtype decided: lora_dtype 'weight')
    import copy

    import bitsandbytes as bnb
    import torch
    from peft import LoraConfig, get_peft_model

    quant_storage = torch.uint8 if storage == "uint8" else torch.bfloat16
    model = torch.nn.Sequential()
    model.add_module("q_proj", bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                                                 quant_storage=quant_storage))
    model.q_proj.weight = bnb.nn.Params4bit(torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False,
                                            quant_type="nf4", quant_storage=quant_storage)
    model = model.to("cpu")  # quantizes
    assert model.q_proj.weight.dtype == quant_storage
    for lora_dtype, autocast in (("fp32", True), ("base", False)):
        adapted = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj"]),
                                 autocast_adapter_dtype=autocast)
        sizes = {p.element_size() for n, p in adapted.named_parameters() if ".lora_" in n}
        t = TrainingSpec(method="qlora", precision="bf16-true", lora_dtype=lora_dtype, qlora_quant_storage=storage)
        assert sizes == {t.adapter_bytes}, (lora_dtype, storage)
