"""The memory-efficient losses people switch on (`TrainingSpec.loss_impl`), each against transformers'
standard loss: torchtune's chunked loss, Liger's fused linear cross-entropy, Apple's Cut Cross-Entropy,
lit-gpt's chunked head and cross-entropy."""

from __future__ import annotations

import pytest

import trainmem_nb as tm
from trainmem_nb.errors import SpecError
from trainmem_nb.model.presets import get_model
from trainmem_nb.recipes.head import liger_chunk_rows
from trainmem_nb.spec.training import TrainingSpec
from trainmem_nb.step.compile import compile_step, program_key

M = get_model("llama-3.2-1b").layer_slice(0, 1)  # vocab 128256, hidden 2048: the head dominates
B, S = 2, 512


def _events(loss_impl: str, seq_len: int = S, **kw: object) -> list[tuple[str, int, int, str]]:
    """(phase, +1 alloc / -1 free, bytes, label) of every event of the step at B x `seq_len`."""
    t = TrainingSpec(micro_batch=B, seq_len=seq_len, loss_impl=loss_impl, **kw)
    return [(seg.phase, sign, int(sz.at(B, seq_len)), label) for seg in compile_step(M, program_key(t, M)).segments
            for _cat, sign, sz, label in seg.events]


def _labels(loss_impl: str, **kw: object) -> set[str]:
    return {label for *_rest, label in _events(loss_impl, **kw)}


def test_liger_chunk_rows_follow_its_formula() -> None:
    # inc_factor = cdiv(V, H); chunk_size = next_power_of_2(cdiv(BT, inc_factor))
    assert liger_chunk_rows(16384, 4096, 128256) == 512  # llama-3-8b, 4 x 4096
    assert liger_chunk_rows(100, 4096, 128256) == 4  # cdiv(100, 32) = 4
    assert liger_chunk_rows(129, 4096, 128256) == 8  # cdiv(129, 32) = 5, rounded up to a power of two
    assert liger_chunk_rows(1, 4096, 128256) == 1


@pytest.mark.parametrize("loss_impl", ["liger", "cce"])
def test_fused_losses_never_allocate_the_logits_of_the_whole_batch(loss_impl: str) -> None:
    seq = 8192  # the logits (4.2 GB in 16 bits) outweigh every weight-sized buffer (1.05 GB in fp32)
    full_logits = B * seq * M.vocab * 2
    assert max(n for _p, sign, n, _l in _events("standard", seq) if sign > 0) >= full_logits
    assert max(n for _p, sign, n, _l in _events(loss_impl, seq) if sign > 0) <= M.vocab * M.hidden * 4


def test_liger_computes_the_gradients_in_the_forward_and_none_for_a_frozen_head() -> None:
    fwd = {label: n for phase, sign, n, label in _events("liger") if sign > 0 and phase == "forward"}
    assert fwd["liger grad_input"] == B * S * M.hidden * 4  # the fp32 hidden state under bf16-mixed
    assert fwd["liger grad_weight"] == M.vocab * M.hidden * 4  # the (tied) fp32 weight's gradient
    assert "liger grad_weight" not in _labels("liger", method="lora")
    assert not any(phase == "backward" and sign > 0 and "liger" in label for phase, sign, _n, label in _events("liger"))


def test_liger_weight_update_in_pure_16_bit_makes_a_product_and_its_fp32_copy_per_chunk() -> None:
    # bf16 grad_weight: torch.mm(...).float() per chunk; fp32 grad_weight with 16-bit logits (AMP): addmm(out_dtype)
    pure, amp = _labels("liger", precision="bf16-true"), _labels("liger")
    assert {"liger chunk 0 grad_logits.t() @ input", "liger chunk 0 .float()"} <= pure
    assert not any("grad_logits.t() @ input" in label for label in amp)
    assert "liger chunk 0 input.to(16-bit)" in amp


def test_cce_under_autocast_saves_16_bit_copies_and_casts_its_gradients_back() -> None:
    amp, pure = _labels("cce"), _labels("cce", precision="bf16-true")
    copies = {"cce e.to(autocast dtype)", "cce c.to(autocast dtype)", "cce de.to(e dtype)", "cce dc.to(c dtype)"}
    assert copies <= amp
    assert not copies & pure and {"cce de", "cce dc"} <= pure


def test_chunked_loss_saves_every_chunks_fp32_log_probabilities_and_lowers_the_transient_peak() -> None:
    ev = _events("chunked", loss_chunks=4)
    saved = sum(n for phase, sign, n, label in ev if sign > 0 and phase == "forward" and label.endswith("log_softmax"))
    assert saved == B * S * M.vocab * 4  # as much as the standard loss's one fp32 log_softmax
    seq = 4096  # the head's peak is the step's
    peaks = {impl: tm.estimate(M, micro_batch=B, seq_len=seq, loss_impl=impl, **kw).peak_allocated_bytes
             for impl, kw in (("standard", {}), ("chunked", {"loss_chunks": 4}), ("liger", {}), ("cce", {}))}
    assert peaks["chunked"] < peaks["standard"]
    assert peaks["liger"] < peaks["chunked"] and peaks["cce"] < peaks["chunked"]
    more = tm.estimate(M, micro_batch=B, seq_len=seq, loss_impl="chunked", loss_chunks=16).peak_allocated_bytes
    assert more < peaks["chunked"]


def test_liger_programs_keep_the_batch_shape_the_others_share_one() -> None:
    # Liger's chunk size depends on the token count, so its program is compiled per batch shape
    liger = program_key(TrainingSpec(micro_batch=3, seq_len=700, loss_impl="liger"), M)
    std = program_key(TrainingSpec(micro_batch=3, seq_len=700), M)
    assert (liger.micro_batch, liger.seq_len) == (3, 700)
    assert (std.micro_batch, std.seq_len) == (2, 1)


@pytest.mark.parametrize(("model", "options", "text"), [
    ("gemma-2-2b", {"loss_impl": "liger"}, "soft-capping"),
    ("granite-3.1-2b", {"loss_impl": "cce"}, "multiplier"),
    ("gpt2", {"loss_impl": "chunked", "seq_len": 512}, "bespoke"),
    ("phi-1.5", {"loss_impl": "liger"}, "bespoke"),
    ("llama-3.2-1b", {"loss_impl": "liger", "device": "cpu"}, "CUDA only"),
    ("llama-3.2-1b", {"loss_chunks": 4}, "loss_impl='chunked' only"),
    ("llama-3.2-1b", {"loss_impl": "fused"}, "valid values: standard, chunked, liger, cce, litgpt"),
    ("gpt2", {"loss_impl": "litgpt", "seq_len": 512}, "bespoke"),
])
def test_a_loss_that_is_not_modelled_is_refused_saying_what_works(model: str, options: dict, text: str) -> None:
    with pytest.raises(SpecError, match=text):
        tm.estimate(model, **options)


def test_the_summary_names_the_loss_and_the_version_it_is_modelled_from() -> None:
    assert "Liger Kernel 0.8.2" in tm.estimate(M, loss_impl="liger").summary()
    assert "loss" not in tm.estimate(M).summary().splitlines()[0]


@pytest.mark.torch
@pytest.mark.parametrize(("family", "options"), [
    ("llama", {"precision": "fp32"}),
    ("llama", {"precision": "bf16-mixed", "checkpointing": "full"}),
    ("qwen2", {"method": "lora", "lora_rank": 4, "precision": "bf16-true"}),
    ("gemma", {"micro_batch": 1, "precision": "bf16-true"}),
    ("llama", {"loss_chunks": 3, "seq_len": 31}),  # uneven chunks: tensor_split's first ones a row longer
])
def test_the_chunked_loss_matches_a_measured_cpu_step_byte_for_byte(family: str, options: dict) -> None:
    # the measured step runs torchtune 0.7.0's LinearCrossEntropyLoss statements on the real model
    pytest.importorskip("transformers")
    from test_measure import summaries, tiny, training

    m = tiny(family, vocab=4096)  # the head's loss dominates the forward and backward peaks
    t = training(loss_impl="chunked", **{"loss_chunks": 4, **options})
    measured, _ = summaries(m, t, "cpu")
    est = tm.estimate(m, t)
    assert est.phase_peaks_bytes == measured["phase_peaks"]
    assert est.saved_activations_bytes == measured["saved_activations"]


def test_litgpt_runs_the_head_per_128_tokens_and_the_loss_per_chunk() -> None:
    # lit-gpt: [lm_head(x_i) for x_i in x.split(128, dim=1)], Fabric's fp32 conversion, cross_entropy per chunk
    ev = _events("litgpt", precision="bf16-true", method="lora")
    labels = {label for *_r, label in ev}
    assert {f"lm_head chunk {i}" for i in range(4)} <= labels and "lm_head chunk 4" not in labels
    assert not any("float()" in label for label in labels)
    v = M.vocab
    sizes = {label: n for _p, sign, n, label in ev if sign > 0}
    assert sizes["lm_head chunk 0"] == B * 128 * v * 2            # bf16 logits of 128 tokens
    assert sizes["chunk 3 log_softmax"] == B * 127 * v * 4         # the cut last chunk, fp32 after Fabric
    # with two sequences the cut last chunk is copied to be viewed as rows, and each chunk's input too
    assert sizes["logit_chunk.reshape(-1, vocab) (a copy)"] == B * 127 * v * 4
    assert "lm_head chunk 1 input reshape (a copy)" in labels


def test_litgpt_under_autocast_casts_a_frozen_head_once_per_chunk() -> None:
    # autocast caches casts of leaf weights that require grad only: a LoRA's frozen head is cast per chunk
    head = "autocast embed_tokens.weight"  # llama-3.2-1b ties its head to the token embeddings
    lora = _events("litgpt", precision="bf16-mixed", method="lora")
    full = _events("litgpt", precision="bf16-mixed")
    assert len([label for _p, sign, _n, label in lora if sign > 0 and label == head]) == 4
    assert len([label for _p, sign, _n, label in full if sign > 0 and label == head]) == 1


def test_chunked_programs_are_shared_by_the_batch_shapes_whose_tokens_leave_the_same_residue() -> None:
    # torchtune's tensor_split rows are (b s - r) / chunks (+1 for the first r): symbolic where the hidden and
    # vocabulary widths are multiples of the chunk count
    key = lambda b, s, m=M: program_key(TrainingSpec(micro_batch=b, seq_len=s, loss_impl="chunked"), m)  # noqa: E731
    assert key(2, 512) is key(4, 100) is key(2, 1000)          # 1024, 400, 2000 tokens: residue 0 of 8
    assert key(2, 513) is not key(2, 512) and key(3, 333) is not key(2, 333)   # 999 tokens: odd, not 2 x anything
    odd = M.model_copy(update={"vocab": 1001})                 # a vocabulary the chunks do not divide
    assert key(2, 512, odd) is not key(2, 1000, odd)
    # the measured steps below (tiny models: hidden 64, vocab 4096, 4 chunks) run the symbolic rows


def test_litgpt_programs_are_shared_by_the_sequences_with_as_many_chunks() -> None:
    # the chunks' sizes are symbolic in the batch shape: one program per chunk count (and one sequence or more)
    key = lambda b, s: program_key(TrainingSpec(micro_batch=b, seq_len=s, loss_impl="litgpt"), M)  # noqa: E731
    assert key(2, 300) is key(3, 384) is key(2, 257)
    assert key(2, 256) is not key(2, 257) and key(1, 300) is not key(2, 300)
    est = [tm.estimate(M, micro_batch=b, seq_len=s, loss_impl="litgpt", device="cpu") for b, s in ((2, 300), (3, 384))]
    assert est[0].peak_allocated_bytes < est[1].peak_allocated_bytes


def test_the_litgpt_stack_runs_the_chunked_head_and_fabric_converts_it_to_fp32() -> None:
    # switched on by the stack, off by hand: lit-gpt's chunks, converted to fp32 by Fabric, vs transformers' loss
    on = tm.estimate("llama-2-7b", method="lora", micro_batch=2, seq_len=1024, stack="litgpt")
    off = tm.estimate("llama-2-7b", method="lora", micro_batch=2, seq_len=1024, stack="litgpt", loss_impl="standard")
    assert on.training.loss_impl.value == "litgpt" and off.training.loss_impl.value == "standard"
    assert on.peak_allocated_bytes != off.peak_allocated_bytes
    assert "128-token chunks (litgpt 0.5.13)" in on.summary().splitlines()[0]
    ev = _events("litgpt", precision="bf16-true", method="lora")
    converts = [n for _p, sign, n, label in ev if sign > 0 and label == "Fabric convert_output .to(float32)"]
    assert converts == [B * 128 * M.vocab * 4] * 4       # each chunk's fp32 copy (the last one before it is cut)
    assert not [1 for _p, sign, _n, label in _events("litgpt", precision="fp32") if label.startswith("Fabric")]


@pytest.mark.torch
@pytest.mark.parametrize(("family", "options"), [
    ("llama", {"precision": "fp32", "seq_len": 300}),
    ("llama", {"precision": "bf16-mixed", "method": "lora", "lora_rank": 4, "seq_len": 260}),
    ("qwen2", {"precision": "bf16-true", "micro_batch": 1, "checkpointing": "full", "seq_len": 300}),
    ("llama", {"precision": "bf16-true", "seq_len": 100}),   # one chunk, cut by the loop
    ("gpt_neox", {"precision": "bf16-true", "method": "lora", "lora_rank": 4, "seq_len": 260}),
])
def test_the_litgpt_loss_matches_a_measured_cpu_step_byte_for_byte(family: str, options: dict) -> None:
    # the measured step runs litgpt 0.5.13's chunked head, its loop's cut and chunked_cross_entropy
    pytest.importorskip("transformers")
    from test_measure import summaries, tiny, training

    m = tiny(family, vocab=1024, max_positions=512)
    t = training(loss_impl="litgpt", **{"micro_batch": 2, **options})
    measured, _ = summaries(m, t, "cpu")
    est = tm.estimate(m, t)
    assert est.phase_peaks_bytes == measured["phase_peaks"]
    assert est.saved_activations_bytes == measured["saved_activations"]


def test_the_cli_takes_the_loss_and_its_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from trainmem_nb.cli.main import main

    assert main(["estimate", "--model", "llama-3.2-1b", "--loss-impl", "chunked", "--loss-chunks", "2", "--json"]) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert (training["loss_impl"], training["loss_chunks"]) == ("chunked", 2)
    assert main(["estimate", "--model", "llama-3.2-1b", "--loss-impl", "cce", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["loss_impl"] == "cce"



def test_liger_logits_chunks_have_its_chunk_rows() -> None:
    # 2 x 550 tokens of llama-3.2-1b: cdiv(V, H) = 63, chunks of next_power_of_2(cdiv(1100, 63)) = 32 rows,
    # 16-bit logits under autocast; two chunks are modelled (the later ones repeat the second)
    rows = liger_chunk_rows(B * 550, M.hidden, M.vocab)
    assert rows == 32
    sizes = [n for _p, sign, n, label in _events("liger", seq_len=550) if sign > 0 and label.startswith("liger logits")]
    assert sizes == [rows * M.vocab * 2] * 2
