"""Training stacks (`trainmem_nb.spec.stack`): a named stack and its component versions set the options
whose mechanisms they switch on, each mechanism changes the step as its source says, and the CLI, the
explorer and the JSON contract say which stack and versions an estimate assumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trainmem_nb as tm
from trainmem_nb.device import CUDA_CONTEXT_BYTES, CUDA_CONTEXT_EAGER_BYTES, round_block
from trainmem_nb.engine.breakdown import TOP_KEYS
from trainmem_nb.spec.stack import list_stacks, resolve_stack

#: The stacks issue 14 names.
NAMED = ("hf-trainer", "trl", "axolotl", "torchtune", "litgpt", "lightning-fabric", "torchtitan", "accelerate-fsdp1",
         "deepspeed", "megatron", "fsdp_qlora")

#: A small llama whose head dominates (a large vocabulary on a narrow model), so the loss's tensors set the peak.
HEAVY_HEAD = dict(family="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=8192,
                  tie_embeddings=False, max_positions=4096)


def _first_and_last(est: tm.MemoryEstimate) -> tuple[tuple[int, ...], tuple[int, ...]]:
    points = est.timeline(max_points=10**7)
    return points[0].by_category, points[-1].by_category


# -- the stacks and their resolution --------------------------------------------------------------------


def test_every_named_stack_of_the_issue_exists_and_each_setting_and_rule_cites_a_source() -> None:
    assert set(NAMED) <= set(list_stacks())
    assert list_stacks()[0] == "default"
    for name in list_stacks():
        s = resolve_stack(name)
        assert all(a.source.strip() for a in s.options.values()), name
    for rule_source in (a.source for a in resolve_stack("hf-trainer@4.30", "torch=1.12,cuda=11.6,bitsandbytes=0.41").options.values()):
        assert rule_source.strip()


def test_a_stack_version_is_its_key_librarys_and_older_components_switch_their_mechanisms_on() -> None:
    today = resolve_stack("")
    assert today.label == "default" and not today.options
    old = resolve_stack("hf-trainer@4.38", {"torch": "1.13", "cuda": "11.6", "bitsandbytes": "0.43.1"})
    assert old.components == {"torch": "1.13", "transformers": "4.38", "bitsandbytes": "0.43.1", "peft": "0.21.2",
                              "cuda": "11.6"}
    values = {k: a.value for k, a in old.options.items()}
    assert values == {"loop_keeps_outputs": False, "zero_grad_set_to_none": False, "cuda_lazy_loading": False,
                      "bnb_saves_input": True, "causal_lm_loss": "model-upcast", "sync_module_states": True,
                      "adafactor": "transformers", "optimizer_impl": None}
    assert {k: a.value for k, a in resolve_stack("hf-trainer@4.47").options.items()}["causal_lm_loss"] == "logits-shifted"
    assert {k: a.value for k, a in resolve_stack("hf-trainer@4.30").options.items()}["causal_lm_loss"] == "no-upcast"
    assert "causal_lm_loss" not in resolve_stack("hf-trainer@4.49").options  # today's loss from 4.49
    # torch sets CUDA_MODULE_LOADING=LAZY from 1.13; CUDA loads lazily by itself from 12.2
    assert resolve_stack("", "torch=1.12,cuda=12.1").options["cuda_lazy_loading"].value is False
    assert "cuda_lazy_loading" not in resolve_stack("", "torch=1.12,cuda=12.2").options
    assert "cuda_lazy_loading" not in resolve_stack("", "torch=1.13,cuda=11.7").options


def test_a_stack_sets_only_what_is_not_given_and_a_rebuilt_spec_follows_its_new_stack() -> None:
    t = tm.TrainingSpec(stack="torchtune")
    assert (t.loss_impl.value, t.loss_chunks, t.dropout) == ("chunked", 8, 0.0)
    assert tm.TrainingSpec(stack="torchtune", loss_impl="standard").loss_impl.value == "standard"
    assert tm.TrainingSpec(stack="torchtune@0.2.1").loss_impl.value == "standard"  # torch.nn.CrossEntropyLoss then
    from trainmem_nb.spec.training import build_training

    moved = build_training(t, stack="hf-trainer")
    assert moved.loss_impl.value == "standard" and moved.dropout is None
    assert build_training(None, stack="hf-trainer@4.38", torch="1.13").zero_grad_set_to_none is False
    assert tm.TrainingSpec(versions={"torch": "1.13"}).versions == "torch=1.13"


@pytest.mark.parametrize(("options", "message"), [
    (dict(stack="hf-trainr"), r"not a named stack \(did you mean 'hf-trainer'\?\)"),
    (dict(stack="hf-trainer@four"), r"must be dotted numbers"),
    (dict(stack="default@1.0"), r"the default stack has no version"),
    (dict(versions="torch:1.13"), r"COMPONENT=VERSION pairs"),
    (dict(versions={"pytorch": "1.13"}), r"'pytorch' is not a component \(did you mean 'torch'\?\)"),
    (dict(stack="hf-trainer@4.38", transformers="4.40"), r"give it once"),
    (dict(stack="no/such/stack.json"), r"does not exist"),
])
def test_bad_stacks_and_versions_are_refused_with_what_to_change(options: dict, message: str) -> None:
    with pytest.raises(tm.SpecError, match=message):
        tm.estimate("gpt2", **options)


def test_a_users_own_stack_file_is_read_and_checked(tmp_path: Path) -> None:
    mine = tmp_path / "my-loop.json"
    mine.write_text(json.dumps({"name": "my-loop", "title": "my training loop", "library": "transformers",
                                "version": "4.40", "source": "train.py of my repo",
                                "settings": {"loop_keeps_outputs": {"value": True, "source": "train.py:88"}}}))
    t = tm.TrainingSpec(stack=str(mine))
    assert t.loop_keeps_outputs and t.causal_lm_loss.value == "model-upcast"
    assert t.resolved_stack.label == "my-loop@4.40"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad", "title": "t", "library": "x", "source": "s",
                               "settings": {"loop_keeps_outputs": {"value": True}}}))
    with pytest.raises(tm.SpecError, match=r"stack file .*bad.json: settings.loop_keeps_outputs.source: Field required"):
        tm.TrainingSpec(stack=str(bad))
    rogue = tmp_path / "rogue.json"
    rogue.write_text(json.dumps({"name": "rogue", "title": "t", "library": "x", "source": "s",
                                 "settings": {"micro_batch": {"value": 8, "source": "s"}}}))
    with pytest.raises(tm.SpecError, match=r"sets 'micro_batch', which a stack cannot set"):
        tm.TrainingSpec(stack=str(rogue))


# -- each mechanism, switched on and off -----------------------------------------------------------------


def test_zero_grad_without_set_to_none_keeps_every_gradient_through_the_step() -> None:
    """torch < 2.0's ``zero_grad()`` zeroes the gradients in place: they exist when the step starts and
    are still there when it ends; with set_to_none they are born in backward and freed by zero_grad."""
    opts = dict(micro_batch=1, seq_len=64, precision="fp32", optimizer="sgd", device="cpu")
    kept = tm.estimate("gpt2", zero_grad_set_to_none=False, **opts)
    freed = tm.estimate("gpt2", **opts)
    from trainmem_nb.model.params import weight_tensors

    grads = sum(round_block(p.numel * dt) * p.count for p, dt, trains in weight_tensors(kept.model, kept.training)
                if trains)
    g = TOP_KEYS.index("gradients")
    first, last = _first_and_last(kept)
    assert first[g] == last[g] == grads
    assert _first_and_last(freed)[0][g] == _first_and_last(freed)[1][g] == 0
    assert kept.peak_allocated_bytes >= freed.peak_allocated_bytes
    assert tm.estimate("gpt2", torch="1.13", **opts).to_dict()["peak_allocated_bytes"] == kept.peak_allocated_bytes


def test_zero_grad_without_set_to_none_is_refused_where_it_is_not_modelled() -> None:
    with pytest.raises(tm.SpecError, match=r"zero_grad_set_to_none=False .* is not modelled"):
        tm.estimate("gpt2", seq_len=512, zero_grad_set_to_none=False, gpus=2, engine="deepspeed", zero=2)
    assert tm.estimate("gpt2", seq_len=512, zero_grad_set_to_none=False, gpus=2, engine="fsdp",
                       zero=3).peak_allocated_bytes > 0


def test_an_eagerly_loaded_cuda_context_is_the_measured_v100_one_unless_calibrated() -> None:
    lazy = tm.estimate("gpt2", seq_len=512)
    eager = tm.estimate("gpt2", seq_len=512, cuda="11.6")
    assert lazy.device_total_bytes - lazy.peak_reserved_bytes == CUDA_CONTEXT_BYTES
    assert eager.device_total_bytes - eager.peak_reserved_bytes == CUDA_CONTEXT_EAGER_BYTES
    assert eager.peak_allocated_bytes == lazy.peak_allocated_bytes
    calibrated = tm.estimate("gpt2", seq_len=512, cuda="11.6", calibration={"cuda_context_bytes": 700 << 20})
    assert calibrated.device_total_bytes - calibrated.peak_reserved_bytes == 700 << 20


def test_old_bitsandbytes_keeps_each_4bit_linears_input_for_backward() -> None:
    """bitsandbytes < 0.43.2 ``MatMul4Bit`` keeps its input (``ctx.tensors = (A, B)``): at least every
    down_proj input, which nothing else saves, stays to the end of the forward; LoRA has no 4-bit layer."""
    m = tm.ModelSpec.model_validate(dict(HEAVY_HEAD, vocab=256))
    opts = dict(micro_batch=2, seq_len=128, method="qlora", lora_targets="qv")
    new, old = tm.estimate(m, **opts), tm.estimate(m, bitsandbytes="0.43.1", **opts)
    down_inputs = m.n_layers * round_block(2 * 128 * m.ffn * 2)
    assert old.saved_activations_bytes - new.saved_activations_bytes >= down_inputs
    lora = dict(opts, method="lora")
    assert tm.estimate(m, bnb_saves_input=True, **lora).to_dict() == tm.estimate(m, **lora).to_dict() | {
        "training": tm.estimate(m, bnb_saves_input=True, **lora).to_dict()["training"]}


def test_fabrics_qlora_quantizes_the_untied_head_and_from_fp16() -> None:
    """Lightning Fabric's BitsandbytesPrecision (litgpt) replaces every nn.Linear, the head included
    (`qlora_head`), and quantizes each from an fp16 copy (`bnb_fp16_state`), so every ``dequantize_4bit`` makes
    an fp16 weight that MatMul4Bit copies to bf16: two copies of the head at once where there was one."""
    # a wide head on few tokens: its dequantized copies in backward set the peak
    m = tm.ModelSpec.model_validate(dict(HEAVY_HEAD, hidden=512, ffn=1024))
    opts = dict(micro_batch=1, seq_len=64, method="qlora", lora_targets="qv", precision="bf16-true")
    plain, head = tm.estimate(m, **opts), tm.estimate(m, qlora_head=True, **opts)
    head_bf16 = round_block(m.vocab * m.hidden * 2)
    head_nf4 = round_block(m.vocab * m.hidden // 2) + round_block(m.vocab * m.hidden // 64)  # packed + uint8 absmax
    assert plain.detail_bytes["weights/params"] - head.detail_bytes["weights/params"] >= head_bf16 - 2 * head_nf4
    both = tm.estimate(m, qlora_head=True, bnb_fp16_state=True, **opts)
    # the head's backward: the fp16 and bf16 copies together, where the bf16 copy and then the input gradient were
    grad_x = round_block(64 * m.hidden * 2)
    assert both.peak_allocated_bytes - head.peak_allocated_bytes == head_bf16 - grad_x
    assert tm.TrainingSpec(stack="litgpt").qlora_head and tm.TrainingSpec(stack="litgpt").bnb_fp16_state
    tied = tm.ModelSpec.model_validate(dict(HEAVY_HEAD, tie_embeddings=True))  # an embedding is no Linear
    assert tm.estimate(tied, qlora_head=True, **opts).to_dict()["detail_bytes"] == \
        tm.estimate(tied, **opts).to_dict()["detail_bytes"]


def test_the_transformers_version_decides_where_the_logits_are_upcast_and_shifted() -> None:
    m = tm.ModelSpec.model_validate(HEAVY_HEAD)
    opts = dict(micro_batch=2, seq_len=256, method="lora", precision="bf16-mixed")
    # at the loss (the forward's peak), per logit: today 16-bit + fp32 + log-probabilities (10 B); 4.46-4.48
    # an fp32 shifted copy more (14 B); 4.31-4.45 without the 16-bit logits the model dropped (12 B)
    peak = {v: tm.estimate(m, causal_lm_loss=v, **opts).phase_peaks_bytes["forward"]
            for v in ("labels-shifted", "logits-shifted", "model-upcast", "no-upcast")}
    logit = 2 * 256 * m.vocab
    assert 3.5 * logit < peak["logits-shifted"] - peak["labels-shifted"] < 4.5 * logit
    assert 1.5 * logit < peak["model-upcast"] - peak["labels-shifted"] < 2.5 * logit
    assert peak["no-upcast"] < peak["logits-shifted"]
    # one sequence: the shifted slice is already contiguous, no copy
    one = {v: tm.estimate(m, causal_lm_loss=v, **(opts | dict(micro_batch=1))).peak_allocated_bytes
           for v in ("labels-shifted", "logits-shifted")}
    assert one["logits-shifted"] - one["labels-shifted"] < round_block(256 * m.vocab * 4)


@pytest.mark.parametrize(("causal_lm_loss", "dtype_bytes"), [("labels-shifted", 2), ("model-upcast", 4)])
def test_a_loop_that_names_its_outputs_keeps_the_last_steps_logits_into_the_next_forward(
        causal_lm_loss: str, dtype_bytes: int) -> None:
    """``outputs = model(**batch)`` in the loop: the last step's logits (16-bit today, fp32 when the model
    upcast them, transformers 4.31-4.45) are alive when the step starts, and this step's when it ends."""
    m = tm.ModelSpec.model_validate(HEAVY_HEAD)
    opts = dict(micro_batch=2, seq_len=256, method="lora", causal_lm_loss=causal_lm_loss)
    kept, dropped = tm.estimate(m, loop_keeps_outputs=True, **opts), tm.estimate(m, **opts)
    logits = round_block(2 * 256 * m.vocab * dtype_bytes)
    a = TOP_KEYS.index("activations")
    for k, d in zip(_first_and_last(kept), _first_and_last(dropped), strict=True):
        assert k[a] - d[a] == logits
    assert kept.peak_allocated_bytes > dropped.peak_allocated_bytes
    assert tm.estimate(m, stack="litgpt", **opts).training.loop_keeps_outputs


# -- where a stack shows ---------------------------------------------------------------------------------


def test_the_estimate_says_which_stack_and_versions_it_assumed_and_what_it_set() -> None:
    e = tm.estimate("llama-3-8b", stack="hf-trainer@4.38", torch="1.13", method="lora")
    d = e.to_dict()["stack"]
    assert d["label"] == "hf-trainer@4.38" and d["components"]["torch"] == "1.13"
    assert d["options"]["zero_grad_set_to_none"]["value"] is False
    assert "optimizer.py" in d["options"]["zero_grad_set_to_none"]["source"]
    assert any("FSDP1" in n for n in d["not_modelled"])
    text = e.summary()
    assert "stack hf-trainer@4.38 (Hugging Face Trainer): torch 1.13, transformers 4.38" in text
    # what the stack set for a step that never reaches it (Adafactor under AdamW, FSDP on one device) is in the
    # JSON, not in the summary's "it sets", where it would read as if it had changed the numbers
    assert ("it sets loop_keeps_outputs=False, optimizer_impl=default, zero_grad_set_to_none=False, "
            "causal_lm_loss=model-upcast") in text
    assert {"adafactor", "sync_module_states"} <= set(d["options"])
    there = tm.estimate("llama-3-8b", stack="hf-trainer@4.38", optimizer="adafactor", gpus=2, engine="fsdp", zero=3,
                        method="lora").summary()
    assert "sync_module_states=True, adafactor=transformers" in there
    assert "stack default (today's versions): torch 2.13" in tm.estimate("gpt2", seq_len=512).summary()
    mine = tm.estimate("llama-3-8b", stack="torchtune", loss_impl="standard", method="lora").to_dict()["stack"]
    assert mine["options"]["loss_impl"]["overridden"] is True


def test_the_cli_takes_a_stack_and_component_versions_and_lists_the_stacks(capsys: pytest.CaptureFixture[str]) -> None:
    from trainmem_nb.cli.main import main

    assert main(["estimate", "--model", "gpt2", "--seq-len", "512", "--stack", "hf-trainer@4.38", "--cuda", "11.6",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["stack"]["components"]["cuda"] == "11.6"
    assert d["device_total_bytes"] - d["peak_reserved_bytes"] == CUDA_CONTEXT_EAGER_BYTES
    assert main(["stacks"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in NAMED)
    assert main(["estimate", "--model", "qwen2.5-0.5b", "--seq-len", "512", "--stack", "torchtune"]) == 0
    assert "loss chunked in 8" in capsys.readouterr().out


def test_the_planner_fits_with_the_stack_it_is_given() -> None:
    from trainmem_nb.planning.fit import fit
    from trainmem_nb.planning.gpus import get_gpu

    lazy = fit(tm.estimate("llama-3-8b", method="qlora"), get_gpu("rtx-4090"))
    eager = fit(tm.estimate("llama-3-8b", method="qlora", cuda="11.6"), get_gpu("rtx-4090"))
    assert eager.needed_bytes - lazy.needed_bytes == CUDA_CONTEXT_EAGER_BYTES - CUDA_CONTEXT_BYTES


def test_the_explorers_stack_dropdown_sets_the_stack_and_moves_the_loss_control_to_the_stacks() -> None:
    pytest.importorskip("ipywidgets")
    from trainmem_nb.ui.explorer import Explorer

    ex = Explorer("qwen2.5-0.5b", method="lora", seq_len=512)
    assert list(ex.controls["stack"].options) == list_stacks()
    ex.controls["stack"].value = "torchtune"
    assert ex.controls["loss_impl"].value == "chunked"
    assert ex.estimate is not None and ex.estimate.training.resolved_stack.name == "torchtune"
    ex.controls["stack"].value = "hf-trainer"
    assert ex.controls["loss_impl"].value == "standard" and not ex.message


def test_the_plan_runs_with_the_stack_and_says_which_it_assumed() -> None:
    from trainmem_nb.planning.search import plan

    p = plan("llama-3-8b", gpu="rtx-4090", method="qlora", seq_len=1024, stack="hf-trainer@4.38", cuda="11.6")
    assert "stack hf-trainer@4.38 (Hugging Face Trainer): torch 2.13, transformers 4.38, bitsandbytes 0.50.2, peft 0.21.2, " \
           "cuda 11.6" in str(p)


@pytest.mark.torch
def test_a_measurement_refuses_the_mechanisms_of_versions_it_does_not_run() -> None:
    pytest.importorskip("torch")
    from trainmem_nb.measure.api import measure

    with pytest.raises(tm.SpecError, match=r"zero_grad_set_to_none=False, causal_lm_loss=model-upcast \(stack "
                                           r"hf-trainer@4.38\) cannot be measured here"):
        measure("gpt2", micro_batch=1, seq_len=32, stack="hf-trainer@4.38", torch="1.13")
    assert measure("gpt2", micro_batch=1, seq_len=32, cuda="11.6").peak_allocated_bytes > 0  # the context: not a step's


# -- what the review of the stacks found ------------------------------------------------------------------


def test_old_bitsandbytes_keeps_the_inputs_until_the_graph_goes_but_not_in_reentrant_checkpointed_layers() -> None:
    """``ctx.tensors = (A, B)`` is a ctx attribute: backward does not free it, so without checkpointing every
    4-bit input is alive to the end of backward; a checkpointed layer (reentrant, as the stacks of that era ran
    it) builds no graph in its forward, so nothing of it is kept."""
    m = tm.ModelSpec.model_validate(dict(HEAVY_HEAD, vocab=256))
    opts = dict(micro_batch=2, seq_len=128, method="qlora", lora_targets="qv")
    new, old = tm.estimate(m, **opts), tm.estimate(m, bitsandbytes="0.43.1", **opts)
    kept = old.phase_peaks_bytes["backward"] - new.phase_peaks_bytes["backward"]
    assert kept >= m.n_layers * round_block(2 * 128 * m.ffn * 2)  # the down_proj inputs, at least
    last = old.timeline(max_points=10**7)[-1]  # and they are gone by the step's end
    assert last.total_bytes == new.timeline(max_points=10**7)[-1].total_bytes
    ckpt = dict(opts, checkpointing="full")
    assert tm.estimate(m, bitsandbytes="0.43.1", **ckpt).saved_activations_bytes == tm.estimate(
        m, **ckpt).saved_activations_bytes


def test_an_edited_stack_file_is_read_again(tmp_path: Path) -> None:
    import os

    mine = tmp_path / "loop.json"
    body = {"name": "loop", "title": "t", "library": "transformers", "version": "5.24", "source": "s",
            "settings": {"loop_keeps_outputs": {"value": True, "source": "s"}}}
    mine.write_text(json.dumps(body))
    assert tm.TrainingSpec(stack=str(mine)).loop_keeps_outputs
    body["settings"]["loop_keeps_outputs"]["value"] = False
    mine.write_text(json.dumps(body))
    os.utime(mine, (1, 1))  # a new modification time, however fast the edit
    assert not tm.TrainingSpec(stack=str(mine)).loop_keeps_outputs


@pytest.mark.parametrize(("options", "message"), [
    (dict(transformers=4.40), r"transformers=4.4 must be a string such as '4.40'"),
    (dict(stack="hf-trainer@"), r"names no version after '@'"),
    (dict(versions="torch=1.13,torch=2.1"), r"names a component twice"),
])
def test_versions_that_would_read_wrong_are_refused(options: dict, message: str) -> None:
    with pytest.raises(tm.SpecError, match=message):
        tm.estimate("gpt2", seq_len=512, **options)


def test_versions_read_as_their_release_and_names_case_insensitively() -> None:
    assert resolve_stack("Default", "torch=2.1.0+cu118").components["torch"] == "2.1.0+cu118"
    assert "zero_grad_set_to_none" in resolve_stack("", "torch=1.13.1rc1").options
    assert resolve_stack("hf-trainer@4.38", "transformers=4.38.0").label == "hf-trainer@4.38.0"  # one version, not two


def test_families_whose_4x_head_never_upcast_run_the_16bit_loss_before_4_49() -> None:
    opts = dict(micro_batch=2, seq_len=256, method="lora", lora_targets="c_attn")
    assert tm.estimate("gpt2", stack="hf-trainer@4.38", **opts).peak_allocated_bytes == tm.estimate(
        "gpt2", causal_lm_loss="no-upcast", **opts).peak_allocated_bytes
    m = tm.ModelSpec.model_validate(HEAVY_HEAD)
    llama = dict(opts, lora_targets="qv")
    assert tm.estimate(m, stack="hf-trainer@4.38", **llama).peak_allocated_bytes == tm.estimate(
        m, causal_lm_loss="model-upcast", **llama).peak_allocated_bytes


def test_a_sweep_gives_each_row_its_own_cuda_context() -> None:
    from trainmem_nb.planning.sweeps import sweep

    df = sweep("tinyllama-1.1b", micro_batch=1, seq_len=128, cuda=["13.0", "11.6"])
    totals = list(df["device_total_bytes"])
    assert totals == [tm.estimate("tinyllama-1.1b", micro_batch=1, seq_len=128, cuda=c).device_total_bytes
                      for c in ("13.0", "11.6")]
    assert totals[1] - totals[0] == CUDA_CONTEXT_EAGER_BYTES - CUDA_CONTEXT_BYTES


def test_a_stacks_values_obey_the_options_limits_and_its_rules_name_real_components(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad", "title": "t", "library": "x", "source": "s",
                               "settings": {"loss_chunks": {"value": -3, "source": "s"}}}))
    with pytest.raises(tm.SpecError, match=r"sets loss_chunks=-3: Input should be greater than or equal to 1"):
        tm.TrainingSpec(stack=str(bad))
    rule = tmp_path / "rule.json"
    rule.write_text(json.dumps({"name": "r", "title": "t", "library": "mylib", "version": "1.0", "source": "s",
                                "rules": [{"component": "torch", "below": "2.0", "option": "zero_grad_set_to_none",
                                           "value": False, "source": "s"}]}))
    assert tm.TrainingSpec(stack=str(rule)).zero_grad_set_to_none  # torch is today's 2.13, not mylib's 1.0
    assert not tm.TrainingSpec(stack=str(rule), versions="torch=1.13").zero_grad_set_to_none
    nope = tmp_path / "nope.json"
    nope.write_text(json.dumps({"name": "n", "title": "t", "library": "mylib", "source": "s",
                                "rules": [{"component": "nope", "below": "2.0", "option": "dropout", "value": 0.0,
                                           "source": "s"}]}))
    with pytest.raises(tm.SpecError, match=r"rule on 'nope'"):
        tm.TrainingSpec(stack=str(nope))


def test_the_cli_leaves_the_stacks_lora_dropout_alone(capsys: pytest.CaptureFixture[str]) -> None:
    from trainmem_nb.cli.main import main

    assert main(["estimate", "--model", "qwen2.5-0.5b", "--seq-len", "512", "--method", "lora", "--stack", "litgpt",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["training"]["lora_dropout"] == 0.05 and d["stack"]["options"]["lora_dropout"]["overridden"] is False


def test_a_stacks_torch_1x_does_not_reach_engines_that_clear_their_own_gradients() -> None:
    ds = dict(seq_len=512, gpus=2, engine="deepspeed", zero=2)
    assert tm.estimate("gpt2", torch="1.13", **ds).peak_allocated_bytes == tm.estimate("gpt2", **ds).peak_allocated_bytes
    with pytest.raises(tm.SpecError, match=r"zero_grad_set_to_none=False .* is not modelled"):
        tm.estimate("gpt2", zero_grad_set_to_none=False, **ds)


def test_the_last_steps_logits_go_when_this_forward_returns() -> None:
    m = tm.ModelSpec.model_validate(HEAVY_HEAD)
    est = tm.estimate(m, micro_batch=2, seq_len=256, method="lora", loop_keeps_outputs=True)
    points = est.timeline(max_points=10**7)
    i = next(i for i, p in enumerate(points) if "the last step's logits go" in p.label)
    a = TOP_KEYS.index("activations")
    assert points[i - 1].phase == points[i].phase == "forward" and points[i + 1].phase == "backward"
    assert points[i - 1].by_category[a] - points[i].by_category[a] == round_block(2 * 256 * m.vocab * 2)


def test_torchtune_builds_its_adapters_in_the_recipes_dtype_unless_told_otherwise() -> None:
    """torchtune instantiates the model under ``set_default_dtype(self._dtype)``: bf16 adapters (lora_dtype
    'base'), unlike peft's fp32 ones; a lora_dtype given wins over the stack's."""
    opts = dict(micro_batch=2, seq_len=256, method="lora", lora_targets="all-linear")
    assert tm.TrainingSpec(stack="torchtune", **opts).lora_dtype.value == "base"
    assert tm.TrainingSpec(**opts).lora_dtype.value == "fp32"
    assert tm.TrainingSpec(stack="torchtune", lora_dtype="fp32", **opts).lora_dtype.value == "fp32"
    tune = tm.estimate("llama-3.2-1b", stack="torchtune", loss_impl="standard", **opts)
    peft = tm.estimate("llama-3.2-1b", stack="torchtune", loss_impl="standard", lora_dtype="fp32", **opts)
    assert tune.peak_allocated_bytes < peft.peak_allocated_bytes  # 16-bit adapters and no fp32 input copies
    assert tune.to_dict()["stack"]["options"]["lora_dtype"]["value"] == "base"


def test_peft_before_0_12_keeps_adapters_in_the_adapted_weights_dtype_and_fp32_on_uint8_4bit_storage() -> None:
    """peft < 0.12 moves each new adapter to its base weight's dtype when that is floating (no
    ``autocast_adapter_dtype``): bf16 adapters on a bf16 base, and on a QLoRA base stored as bf16 (fsdp_qlora's
    ``quant_storage=torch_dtype``), but nn.Linear's fp32 on bitsandbytes' default uint8 storage; 0.12 upcasts."""
    lora = dict(micro_batch=1, seq_len=256, method="lora", lora_targets="all-linear")
    qlora = {**lora, "method": "qlora"}
    assert tm.TrainingSpec(versions="peft=0.11.1", **lora).lora_dtype.value == "weight"
    assert tm.TrainingSpec(versions="peft=0.12", **lora).lora_dtype.value == "fp32"
    assert tm.TrainingSpec(versions="peft=0.10", **lora).adapter_bytes == 2
    assert tm.TrainingSpec(versions="peft=0.10", **qlora).adapter_bytes == 4  # uint8 storage: not floating
    assert tm.TrainingSpec(versions="peft=0.10", qlora_quant_storage="base", **qlora).adapter_bytes == 2
    assert tm.TrainingSpec(stack="fsdp_qlora", versions="peft=0.10", **qlora).adapter_bytes == 2
    assert tm.TrainingSpec(stack="fsdp_qlora", **qlora).adapter_bytes == 4  # today's peft upcasts
    for opts in (lora, qlora):
        old, new = (tm.estimate("llama-3.2-1b", peft=v, stack="fsdp_qlora", **opts) for v in ("0.10", "0.12"))
        # bf16 instead of fp32 adapters: AdamW's two states per element take 4 bytes instead of 8, the
        # adapters themselves 2 instead of 4 (half the old states' bytes more), and their activations grow too
        was, now = old.breakdown_bytes, new.breakdown_bytes
        assert was["optimizer_states"] * 2 == now["optimizer_states"]
        assert now["weights"] - was["weights"] == was["optimizer_states"] // 2
        assert now["activations"] > was["activations"] and new.peak_allocated_bytes > old.peak_allocated_bytes
        assert old.to_dict()["stack"]["options"]["lora_dtype"]["value"] == "weight"


def test_the_hf_trainers_default_adamw_is_fused_from_4_54_on_torch_2_8_else_pytorchs_default() -> None:
    """TrainingArguments' default optim: ``adamw_torch_fused`` from transformers 4.54 with torch >= 2.8 (no update
    temporaries), ``adamw_torch`` from 4.32 (PyTorch's default: foreach on CUDA, whose sqrt copies every state),
    ``adamw_hf`` before (a loop over the parameters). An optimizer given, or another than AdamW, keeps its own."""
    assert tm.TrainingSpec(stack="hf-trainer").resolved_optimizer_impl.value == "fused"
    assert tm.TrainingSpec(stack="trl").resolved_optimizer_impl.value == "fused"
    # axolotl's own default (adamw_torch_fused) and DeepSpeed's FusedAdam for a config's "AdamW"
    assert {tm.TrainingSpec(stack=st).resolved_optimizer_impl.value for st in ("axolotl", "deepspeed")} == {"fused"}
    assert tm.TrainingSpec(stack="hf-trainer@4.53").resolved_optimizer_impl.value == "foreach"
    assert tm.TrainingSpec(stack="hf-trainer", versions="torch=2.7").resolved_optimizer_impl.value == "foreach"
    assert tm.TrainingSpec(stack="hf-trainer@4.31").resolved_optimizer_impl.value == "for-loop"
    assert tm.TrainingSpec(stack="hf-trainer@4.53", device="cpu").resolved_optimizer_impl.value == "for-loop"
    assert tm.TrainingSpec(stack="hf-trainer", optimizer_impl="foreach").optimizer_impl.value == "foreach"
    for opt in ("adafactor", "lion", "adamw-8bit", "sgd"):  # no fused flag forced on them (fused refuses most)
        assert tm.TrainingSpec(stack="hf-trainer", optimizer=opt).optimizer_impl is None
    # full fine-tuning on one GPU: the fused step allocates nothing beside the states; foreach copies them all
    opts = dict(model="gpt2", micro_batch=1, seq_len=128)
    fused, foreach = tm.estimate(stack="hf-trainer", **opts), tm.estimate(stack="hf-trainer@4.53", **opts)
    assert "optimizer" not in fused.phase_peaks_bytes and foreach.peak_phase == "optimizer"
    assert fused.peak_allocated_bytes < foreach.peak_allocated_bytes
    assert "optimizer_impl=fused" in fused.summary() and "optimizer_impl=default" in foreach.summary()


def test_the_hf_trainer_steps_transformers_adafactor_whose_fp32_copies_set_a_16bit_models_peak() -> None:
    """``optim="adafactor"`` in the HF Trainer is transformers' Adafactor: a loop that copies each 16-bit gradient
    and parameter to fp32 and builds its update next to the previous one's, where torch's for-loop Adafactor
    works in the parameter's dtype (the measured steps of `hf_adafactor_cases` pin both to the byte)."""
    opts = dict(micro_batch=1, seq_len=64, precision="bf16-true", optimizer="adafactor", device="cpu")
    trainer = tm.estimate("gpt2", stack="hf-trainer", **opts)
    assert trainer.training.adafactor.value == "transformers"
    assert trainer.to_dict()["stack"]["options"]["adafactor"]["value"] == "transformers"
    assert tm.estimate("gpt2", adafactor="transformers", **opts).peak_allocated_bytes == trainer.peak_allocated_bytes
    torch_loop = tm.estimate("gpt2", optimizer_impl="for-loop", **opts)
    assert trainer.peak_phase == "optimizer" and torch_loop.peak_phase == "backward"
    assert trainer.peak_allocated_bytes > torch_loop.peak_allocated_bytes
    # the same state (row and column second moments) plus one 0-dim RMS tensor per parameter
    from trainmem_nb.model.params import trainable_tensors

    n_tensors = sum(p.count for p, _ in trainable_tensors(trainer.model, trainer.training))
    gap = trainer.breakdown_bytes["optimizer_states"] - torch_loop.breakdown_bytes["optimizer_states"]
    assert gap >= n_tensors * 512  # bf16 state becomes fp32 too


@pytest.mark.parametrize(("options", "message"), [
    (dict(optimizer="adamw", adafactor="transformers"), r"adafactor='transformers' says which Adafactor"),
    (dict(optimizer="adafactor", adafactor="transformers", optimizer_impl="foreach"), r"one implementation"),
])
def test_transformers_adafactor_is_refused_where_it_means_nothing(options: dict, message: str) -> None:
    with pytest.raises(tm.SpecError, match=message):
        tm.estimate("gpt2", seq_len=64, **options)
    assert tm.estimate("gpt2", seq_len=64, stack="hf-trainer").training.optimizer.value == "adamw"  # set by the stack


def test_torch_before_1_11_keeps_each_softmaxs_input_for_backward() -> None:
    """torch 1.10's softmax and log_softmax save their input besides their result (pytorch/pytorch#64000): eager
    attention keeps every layer's fp32 scores (batch x heads x seq x seq) until its backward, and the loss its logits."""
    from trainmem_nb.device import round_block
    from trainmem_nb.engine.breakdown import TOP_KEYS

    m = tm.ModelSpec.model_validate({**tm.get_model("bert-base").model_dump(), "num_labels": 2})
    opts = dict(micro_batch=2, seq_len=128, precision="fp32", attention="eager", dropout=0.0, device="cpu",
                optimizer="sgd")
    today, kept = tm.estimate(m, **opts), tm.estimate(m, softmax_saves_input=True, **opts)
    assert resolve_stack("", "torch=1.10").options["softmax_saves_input"].value is True
    assert "softmax_saves_input" not in resolve_stack("", "torch=1.11").options
    act = TOP_KEYS.index("activations")

    def most(e: tm.MemoryEstimate) -> int:
        return max(p.by_category[act] for p in e.timeline(max_points=10**7))

    scores = m.n_layers * round_block(2 * m.n_heads * 128 * 128 * 4)
    logits = round_block(2 * 2 * 4)
    assert most(kept) - most(today) == scores + logits
    assert kept.peak_allocated_bytes >= today.peak_allocated_bytes


def test_a_loop_keeping_its_output_keeps_old_bitsandbytes_inputs_into_the_next_forward() -> None:
    """bitsandbytes < 0.43.2 keeps MatMul4Bit's input as an attribute of the graph's node, which lives as long as
    the graph: a loop that keeps its output (litgpt's ``logits``, rebound after the next forward returns) keeps
    each 4-bit linear's input, one per distinct input, into the next step's forward, beside the last logits;
    the HF Trainer's loop drops the graph with its loss, before the optimizer step."""
    from trainmem_nb.spec.training import TrainingSpec
    from trainmem_nb.step.compile import _SINGLE, compile_step, program_key

    m = tm.ModelSpec.model_validate(dict(HEAVY_HEAD, vocab=256))
    b, s = 2, 128

    def before_step(**kw: object) -> int:  # bytes alive when the step starts: the last step's leftovers
        t = TrainingSpec(micro_batch=b, seq_len=s, method="qlora", lora_targets="qv", precision="bf16-true",
                         grad_accum=2, **kw)
        return sum(sz.at(b, s) * n for _cat, sz, n in compile_step(m, program_key(t, m), _SINGLE).init)

    def kept_by_old_bnb(keeps: bool) -> int:
        return before_step(loop_keeps_outputs=keeps, bnb_saves_input=True) - \
            before_step(loop_keeps_outputs=keeps, bnb_saves_input=False)

    # per layer: the attention's input (q, k and v share it), o_proj's, the MLP's (gate and up) and down_proj's
    per_layer = 3 * round_block(2 * b * s * m.hidden) + round_block(2 * b * s * m.ffn)
    assert kept_by_old_bnb(True) == m.n_layers * per_layer
    assert kept_by_old_bnb(False) == 0


def test_litgpt_gives_a_tied_checkpoints_head_a_weight_of_its_own() -> None:
    """litgpt's GPT builds lm_head as an nn.Linear of its own and the checkpoint's converter copies the embedding
    into it (`untied_head`): a tied model gains vocab x hidden parameters, which QLoRA under Fabric quantizes
    (`qlora_head`), where a tied head stays the 16-bit embedding; an untied model is unchanged."""
    tied = tm.ModelSpec.model_validate(dict(HEAVY_HEAD, tie_embeddings=True))
    opts = dict(micro_batch=1, seq_len=64, precision="bf16-true")
    plain, own = tm.estimate(tied, **opts), tm.estimate(tied, untied_head=True, **opts)
    assert own.n_params - plain.n_params == tied.vocab * tied.hidden
    assert own.detail_bytes["weights/params"] - plain.detail_bytes["weights/params"] == \
        round_block(2 * tied.vocab * tied.hidden)
    qlora = dict(opts, method="qlora", lora_targets="qv", qlora_head=True)
    numel = tied.vocab * tied.hidden
    quantized_head = tm.estimate(tied, untied_head=True, **qlora).detail_bytes["weights/params"] - \
        tm.estimate(tied, **qlora).detail_bytes["weights/params"]
    # 4-bit: half a byte an element, with its scales (at most an fp32 one per 64-element block, and blocks)
    assert numel // 2 <= quantized_head <= numel // 2 + numel // 64 * 4 + 4 * 512
    untied = tm.ModelSpec.model_validate(HEAVY_HEAD)
    same, base = tm.estimate(untied, untied_head=True, **opts), tm.estimate(untied, **opts)
    assert (same.n_params, same.detail_bytes, same.peak_reserved_bytes) == \
        (base.n_params, base.detail_bytes, base.peak_reserved_bytes)
    assert resolve_stack("litgpt").options["untied_head"].value is True
    planned = tm.plan(tied, gpu="H100", stack="litgpt", seq_len=64, precision="bf16-true", prices=False, max_gpus=1)
    assert planned.model.n_params == own.n_params  # the plan's header and checkpoints count the model built


def test_a_version_outside_what_is_modelled_is_said_not_taken_silently() -> None:
    """A component newer than today's release is modelled as today's, one older than any published check ran is
    modelled with the oldest mechanisms known: both are estimated, and the result says so."""
    newer = resolve_stack("", {"torch": "99.0"}).not_modelled
    assert any(line.startswith("torch 99.0: newer than the newest release modelled") for line in newer)
    older = resolve_stack("hf-trainer@3.0").not_modelled
    assert any(line.startswith("transformers 3.0: older than any release a published check ran") for line in older)
    assert not [line for line in resolve_stack("hf-trainer@4.38", {"torch": "1.13"}).not_modelled
                if "release" in line]
    assert not [line for line in resolve_stack("hf-trainer@5.24.1", {"torch": "2.13.1"}).not_modelled
                if "release" in line]  # a patch release of today's is today's
