"""`trainmem measure`: fake == real CPU for every family, categories, the JSON contract, the harness.

Every expected number here comes from a second measurement (real vs fake tensors, or the independent
harness's stored results), never from a constant typed into the test.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem_nb.engine.breakdown import DETAIL_KEYS, TOP_KEYS  # noqa: E402
from trainmem_nb.measure import measure  # noqa: E402
from trainmem_nb.measure.dataset import CASES_FILE, HARNESS_FILE, load_cases  # noqa: E402
from trainmem_nb.measure.step import run_step, summarize  # noqa: E402
from trainmem_nb.model.families import Family  # noqa: E402
from trainmem_nb.model.spec import ModelSpec  # noqa: E402
from trainmem_nb.spec.training import TrainingSpec  # noqa: E402

ALL_FAMILIES = [f.value for f in Family]


def tiny(family: str, **kw: Any) -> ModelSpec:
    """A two-layer model of `family` (GQA where the family has it; mistral with a window shorter than the sequence)."""
    spec: dict[str, Any] = {"family": family, "name": f"{family}-tiny", "n_layers": 2, "hidden": 64, "n_heads": 4,
                            "ffn": 128, "vocab": 256, "max_positions": 256}
    if family in ("llama", "mistral", "qwen2", "mixtral", "phi3", "gemma"):
        spec["n_kv_heads"] = 2
    if family == "gemma":
        spec["head_dim"] = 16
    if family == "mistral":
        spec["sliding_window"] = 16
    if family == "mixtral":
        spec.update(n_experts=4, experts_top_k=2)
    if family == "gpt_oss":
        spec.update(n_kv_heads=2, n_experts=4, experts_top_k=2, sliding_window=16,
                    layer_types=("sliding_attention", "full_attention"))
    if family == "deepseek_v3":
        spec.update(head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=32,
                    n_experts=4, experts_top_k=2, n_expert_groups=2, topk_groups=1, expert_ffn=32, dense_layers=(0,))
    spec.update(kw)
    return ModelSpec.model_validate(spec)


def training(**kw: Any) -> TrainingSpec:
    base: dict[str, Any] = {"micro_batch": 2, "seq_len": 32, "device": "cpu", "dropout": 0.0, "precision": "fp32",
                            "optimizer_impl": "foreach"}
    base.update(kw)
    if base.get("optimizer") == "none":
        base["optimizer_impl"] = None
    return TrainingSpec.model_validate(base)


def summaries(m: ModelSpec, t: TrainingSpec, device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The 512-B-rounded and the exact summary of one step (without the timeline)."""
    trace = run_step(m, t, device)
    out = []
    for rounding in (True, False):
        s = summarize(trace, rounding=rounding)
        s.pop("timeline")
        out.append(s)
    return out[0], out[1]


FAMILY_SETUPS = {
    "fp32-adamw": {},
    "bf16-mixed-ckpt-dropout": {"precision": "bf16-mixed", "checkpointing": "full", "dropout": 0.1},
}


@pytest.mark.parametrize("setup", sorted(FAMILY_SETUPS))
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_fake_equals_cpu_byte_for_byte_for_every_family(family: str, setup: str) -> None:
    m, t = tiny(family), training(**FAMILY_SETUPS[setup], **({"attention": "eager"} if family == "gpt_oss" else {}))
    fake = summaries(m, t, "fake")
    real = summaries(m, t, "cpu")
    assert fake == real
    rounded = fake[0]
    assert rounded["peak_phase"] in ("forward", "backward", "optimizer")
    assert max(rounded["phase_peaks"].values()) == rounded["peak"]
    assert sum(rounded["detail"].values()) == rounded["peak"]


OPTIONS = {
    "bf16-true": {"precision": "bf16-true"},
    "fp16-mixed-scaler": {"precision": "fp16-mixed"},
    "fp16-true": {"precision": "fp16-true"},
    "selective-ckpt": {"checkpointing": "selective"},
    "eager-dropout": {"attention": "eager", "dropout": 0.1},
    "lora-qv": {"method": "lora", "lora_targets": "qv", "lora_rank": 4, "lora_alpha": 8},
    "lora-all-linear-bf16": {"method": "lora", "lora_targets": "all-linear", "precision": "bf16-true",
                             "lora_dropout": 0.1},
    "lora-ckpt-mixed": {"method": "lora", "checkpointing": "full", "precision": "bf16-mixed"},
    "sgd": {"optimizer": "sgd"},
    "sgd-momentum-for-loop": {"optimizer": "sgd-momentum", "optimizer_impl": "for-loop"},
    "adam-fused": {"optimizer": "adam", "optimizer_impl": "fused"},
    "adafactor": {"optimizer": "adafactor"},
    "adamw-for-loop": {"optimizer_impl": "for-loop"},
    "no-optimizer": {"optimizer": "none"},
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_fake_equals_cpu_byte_for_byte_across_options(option: str, family: str) -> None:
    m, t = tiny(family), training(**OPTIONS[option])
    assert summaries(m, t, "fake") == summaries(m, t, "cpu")


MOE_OPTIONS = {
    # peft wraps the 3-D expert weights for all-linear (and refuses lora_dropout there)
    "lora-all-linear-bf16": {"method": "lora", "lora_targets": "all-linear", "precision": "bf16-true"},
    "adafactor": OPTIONS["adafactor"],
    "selective-ckpt": OPTIONS["selective-ckpt"],
}


@pytest.mark.parametrize("option", sorted(MOE_OPTIONS))
def test_fake_equals_cpu_byte_for_byte_for_mixture_of_experts(option: str) -> None:
    # Routing is data-dependent, but every token goes to top_k experts: grouped matmuls see
    # tokens * top_k rows whatever the router picks.
    m, t = tiny("mixtral"), training(**MOE_OPTIONS[option])
    assert summaries(m, t, "fake") == summaries(m, t, "cpu")


def test_breakdown_sums_to_the_peak_with_the_estimators_keys() -> None:
    from trainmem_nb.estimator.api import estimate

    r = measure(tiny("llama"), training(precision="bf16-mixed"), device="fake")
    d = r.to_dict()
    assert set(d["breakdown_bytes"]) == set(TOP_KEYS)
    assert set(d["detail_bytes"]) == set(DETAIL_KEYS)
    assert sum(d["breakdown_bytes"].values()) == d["peak_allocated_bytes"]
    assert d["peak_reserved_bytes"] == d["device_total_bytes"] == d["peak_allocated_bytes"]
    assert d["device"] == "cpu" and d["measured_with"]["device"] == "fake"
    for key in ("torch", "transformers", "peft", "python", "threads", "timing", "date"):
        assert key in d["measured_with"]
    est = estimate(r.model, r.training).to_dict()  # the contract as the estimator writes it today
    assert set(est) <= set(d)
    assert set(est["detail_bytes"]) <= set(d["detail_bytes"])
    json.dumps(d)  # the contract is JSON


def test_measurement_round_trips_through_its_dict() -> None:
    from trainmem_nb.measure.result import Measurement

    r = measure(tiny("qwen2"), training(), device="fake")
    assert Measurement.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_measure_accepts_the_model_forms_of_estimate() -> None:
    from trainmem_nb.model.hf_config import to_hf_config

    m = tiny("gpt2")
    by_spec = measure(m, training(), device="fake")
    by_config = measure(hf_config=to_hf_config(m), micro_batch=2, seq_len=32, precision="fp32",
                        optimizer_impl="foreach", dropout=0.0, device="fake")
    assert by_config.peak_allocated_bytes == by_spec.peak_allocated_bytes
    assert by_spec.n_params == m.n_params


def _records(m: ModelSpec, t: TrainingSpec) -> list[Any]:
    return run_step(m, t, "fake").tracker.records


def test_checkpointing_recomputes_layers_in_backward_only() -> None:
    plain = {r.category for r in _records(tiny("llama"), training())}
    ckpt = [r for r in _records(tiny("llama"), training(checkpointing="full")) if r.category == "activations/recomputed"]
    assert "activations/recomputed" not in plain
    assert ckpt and all(r.phase == "backward" and r.in_layer for r in ckpt)


def test_autocast_weight_copies_are_their_own_category() -> None:
    copies = [r for r in _records(tiny("llama"), training(precision="bf16-mixed"))
              if r.category == "activations/weight_copies"]
    assert copies and all(r.dtype == "bfloat16" and r.op.startswith("_to_copy") for r in copies)
    assert not [r for r in _records(tiny("llama"), training()) if r.category == "activations/weight_copies"]


def test_activations_outside_layers_split_into_embeddings_and_head() -> None:
    records = _records(tiny("llama"), training())
    emb = [r for r in records if r.category == "activations/embeddings"]
    head = [r for r in records if r.category == "activations/head"]
    first_layer = min(r.born for r in records if r.in_layer and r.phase == "forward")
    last_layer = max(r.born for r in records if r.in_layer and r.phase == "forward")
    assert any(r.op.startswith("embedding") for r in emb)
    assert all(r.born < first_layer for r in emb)
    assert any("log_softmax" in r.op for r in head)
    assert all(r.born > last_layer for r in head)


def test_lora_trains_only_the_adapters() -> None:
    full = measure(tiny("llama"), training(), device="fake")
    lora = measure(tiny("llama"), training(method="lora", lora_rank=4, lora_alpha=8), device="fake")
    assert 0 < lora.n_trainable_params < lora.n_params
    assert lora.n_params > full.n_params  # the adapters are added to the base
    grads = [r for r in run_step(tiny("llama"), training(method="lora", lora_rank=4, lora_alpha=8), "fake").tracker.records
             if r.category == "gradients"]
    assert sum(r.nbytes for r in grads) == 4 * lora.n_trainable_params  # fp32 adapter grads only


def test_first_step_creates_optimizer_state_inside_the_step() -> None:
    steady = measure(tiny("llama"), training(), device="fake")
    first = measure(tiny("llama"), training(), device="fake", prime=False)
    assert first.live_at_start_bytes < steady.live_at_start_bytes
    assert first.measured_with["steady_state"] is False and first.training.first_step
    by_spec = measure(tiny("llama"), training(first_step=True), device="fake")
    assert by_spec.detail_bytes == first.detail_bytes and by_spec.phase_peaks_bytes == first.phase_peaks_bytes


def _harness_cases() -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in json.loads(HARNESS_FILE.read_text())["cases"]}


# Small harness runs (two real-tensor GPT-2 steps, a first step, a real-tensor LoRA step), re-measured live.
LIVE_HARNESS = ["harness/gpt2-124m_fp32_adamw_b1_s128", "harness/gpt2-124m_fp32_adamw_b4_s128_ckpt",
                "harness/gpt2-124m_fp32_adamw_b4_s512_firststep", "harness/llama-1b_fp32_lora8qv_b1_s512"]


@pytest.mark.parametrize("case_id", LIVE_HARNESS)
def test_agrees_with_the_independent_harness_within_one_percent(case_id: str) -> None:
    from trainmem_nb.measure.harness import compare

    case = _harness_cases()[case_id]
    m = ModelSpec.model_validate(case["model_spec"])
    t = TrainingSpec.model_validate(case["training"])
    r = measure(m, t, device="fake")
    c = compare(r.to_dict(), case)
    assert abs(c["peak_rel_err"]) <= 0.01
    assert c["phase_ours"] == c["phase_harness"]
    assert all(abs(e) <= 0.01 for e in c["category_rel_err"].values()), c["category_rel_err"]
    assert r.n_params == case["n_params"] and r.n_trainable_params == case["n_trainable_params"]


def _reproducible_cases() -> list[Any]:
    if not CASES_FILE.exists():
        return []
    picks = ("families/gpt2-tiny/fp32-adamw-foreach/b2s64/fake", "families/mixtral-tiny/", "cpu-real/bert-tiny/",
             "families/gemma-tiny-mqa/bf16-true")
    cases = load_cases()
    return [next(c for c in cases if c.id.startswith(p)) for p in picks if any(c.id.startswith(p) for c in cases)]


@pytest.mark.parametrize("case", _reproducible_cases(), ids=lambda c: c.id)
def test_stored_dataset_cases_are_reproduced_byte_for_byte(case: Any) -> None:
    import transformers

    stored = case.measurement
    if (stored.measured_with["torch"], stored.measured_with["transformers"]) != (torch.__version__,
                                                                                 transformers.__version__):
        pytest.skip("the dataset was measured with other torch/transformers versions")
    again = measure(case.model, case.training, device=case.mode)
    for key in ("n_params", "n_trainable_params", "peak_allocated_bytes", "peak_phase", "peak_at", "detail_bytes",
                "phase_peaks_bytes", "peak_live_bytes"):
        assert getattr(again, key) == getattr(stored, key), key


def test_dataset_file_is_present() -> None:
    assert CASES_FILE.exists() and HARNESS_FILE.exists()
    assert len(_reproducible_cases()) == 4


def test_cpu_step_that_cannot_fit_in_ram_is_refused_before_allocating() -> None:
    from trainmem_nb.measure.api import check_fits_in_ram
    from trainmem_nb.model.presets import get_model

    m = get_model("llama-2-7b")
    with pytest.raises(RuntimeError, match="use --device fake"):
        check_fits_in_ram(m, training(), available=8 << 30)
    check_fits_in_ram(tiny("llama"), training(), available=8 << 30)  # a tiny step passes


def test_options_that_need_other_kernels_are_refused_in_one_line() -> None:
    for opts, text in (({"optimizer": "adamw-8bit"}, "cannot be measured here"),
                       ({"method": "qlora"}, "bitsandbytes"),
                       ({"attention": "flash"}, "flash-attn")):
        with pytest.raises(RuntimeError, match=text) as err:
            measure(tiny("llama"), training(**opts), device="fake")
        assert "\n" not in str(err.value)


def test_cuda_counters_become_peak_reserved_total_and_calibration() -> None:
    """The CUDA path's bookkeeping, on a traced step given the allocator counters a GPU would report."""
    from trainmem_nb.measure.api import measurement_from_trace

    trace = run_step(tiny("llama"), training(precision="bf16-mixed"), "fake")
    tracked = summarize(trace)
    churn = sum(v for k, v in tracked["detail"].items() if k.startswith(("activations/", "transient/")))
    workspace, scratch, cached, context = 8 << 20, 2 << 20, churn // 4, 500 << 20
    trace.device = "cuda"
    trace.cuda = {"allocated_at_start": tracked["live_at_start"] + workspace,
                  "max_allocated": tracked["peak"] + workspace + scratch,
                  "max_reserved": tracked["peak"] + workspace + scratch + cached, "context": context,
                  "device_total": 80 << 30, "gpu_name": "a GPU"}
    r = measurement_from_trace(trace)
    assert r.peak_allocated_bytes == trace.cuda["max_allocated"]
    assert r.detail_bytes["overhead/workspaces"] == workspace + scratch
    assert sum(r.breakdown_bytes.values()) == r.peak_allocated_bytes
    assert max(r.phase_peaks_bytes.values()) == r.peak_allocated_bytes
    assert r.peak_reserved_bytes == trace.cuda["max_reserved"]
    assert r.device_total_bytes == r.peak_reserved_bytes + context
    cal = r.to_dict()["calibration"]
    assert cal["workspace_bytes"] == workspace and cal["cuda_context_bytes"] == context
    assert cal["reserved_churn_fraction"] == pytest.approx(cached / churn)


def test_measure_on_cuda_runs_the_allocator_with_the_specs_alloc_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings reach torch's allocator once, before the model is built; a second, different one in
    the same process (settings are process-wide) and a conflict with the environment are refused."""
    from trainmem_nb.measure import cuda

    for name in cuda.ALLOC_CONF_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cuda, "_APPLIED", [])
    given: list[str] = []
    cuda.apply_alloc_conf("expandable_segments:True", setter=given.append)
    cuda.apply_alloc_conf("expandable_segments:True", setter=given.append)
    assert given == ["expandable_segments:True"]
    with pytest.raises(RuntimeError, match="new process"):
        cuda.apply_alloc_conf("max_split_size_mb:128", setter=given.append)
    with pytest.raises(RuntimeError, match="new process"):
        cuda.apply_alloc_conf("", setter=given.append)  # back to the defaults: parsing cannot undo a key
    monkeypatch.setattr(cuda, "_APPLIED", [])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    with pytest.raises(RuntimeError, match="differs from the environment"):
        cuda.apply_alloc_conf("expandable_segments:True", setter=given.append)
    cuda.apply_alloc_conf("", setter=given.append)  # the environment's settings are in effect already
    assert given == ["expandable_segments:True"]


def test_alloc_conf_from_the_environment_is_recorded_with_a_cuda_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU step run under PYTORCH_ALLOC_CONF (which torch reads before PYTORCH_CUDA_ALLOC_CONF) records
    those settings in its training spec, so its replay uses the same rules."""
    from trainmem_nb.measure import cuda, step

    assert cuda.env_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "a:1", "PYTORCH_ALLOC_CONF": " b:2 "}) == "b:2"
    assert cuda.env_alloc_conf({"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "a:1"}) == "a:1"
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    seen: list[TrainingSpec] = []

    def fake_run(m: Any, t: TrainingSpec, dev: str, prime: bool) -> Any:
        seen.append(t)
        raise RuntimeError("stop before a GPU is needed")

    monkeypatch.setattr(step, "run_step", fake_run)
    with pytest.raises(RuntimeError, match="stop before"):
        measure("gpt2", device="cuda", micro_batch=1, seq_len=64)
    assert seen[0].alloc_conf == "expandable_segments:True" and seen[0].device.value == "cuda"
