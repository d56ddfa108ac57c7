"""Sequence-classification heads (issue 14): BertForSequenceClassification and the composed decoders'
``*ForSequenceClassification`` (transformers' GenericForSequenceClassification). A config saved with such a head
is read with its labels, its parameters are the model transformers builds, and its measured steps are
reproduced to the byte; the task heads that are not modelled are still refused."""

from __future__ import annotations

import importlib.util
import re
import warnings
from typing import Any

import pytest

import trainmem_nb as tm
from trainmem_nb.model.hf_config import to_hf_config
from trainmem_nb.model.params import count_params, param_inventory

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

TINY_BERT = dict(family="bert", n_layers=2, hidden=64, n_heads=4, ffn=128, vocab=512, max_positions=128,
                 tie_embeddings=True)
DECODERS = {
    "llama": dict(family="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=512,
                  max_positions=256),
    "qwen3-tied": dict(family="qwen3", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128,
                       vocab=512, tie_embeddings=True),
    "gemma2-softcap": dict(family="gemma2", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128,
                           vocab=512, final_softcap=30.0),
}
BERT_CONFIG = {"model_type": "bert", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 128}


@pytest.mark.parametrize(("extra", "labels"), [
    ({}, 2),  # transformers' default
    ({"num_labels": 5}, 5),
    ({"id2label": {"0": "neg", "1": "neutral", "2": "pos"}}, 3),
    ({"num_labels": 1}, 1),  # regression
])
def test_a_sequence_classification_config_is_read_with_its_labels(extra: dict[str, Any], labels: int) -> None:
    cfg = {**BERT_CONFIG, "architectures": ["BertForSequenceClassification"], **extra}
    m = tm.ModelSpec.from_hf_config(cfg)
    assert m.num_labels == labels
    assert tm.ModelSpec.from_hf_config(to_hf_config(m)) == m
    names = {p.name for p in param_inventory(m)}
    assert {"pooler.dense.weight", "classifier.weight"} <= names and not any(n.startswith("cls.") for n in names)


def test_a_classifier_has_no_vocabulary_sized_logits() -> None:
    mlm = tm.get_model("bert-large")
    cls = tm.ModelSpec.model_validate({**mlm.model_dump(), "num_labels": 2})
    opts = dict(micro_batch=4, seq_len=512, precision="fp32", device="cpu")
    scores = 4 * 512 * mlm.vocab * 4
    assert tm.estimate(mlm, **opts).peak_allocated_bytes - tm.estimate(cls, **opts).peak_allocated_bytes > scores / 2
    assert count_params(cls) == count_params(mlm) - (mlm.hidden * mlm.hidden + 3 * mlm.hidden + mlm.vocab) + (
        mlm.hidden * mlm.hidden + mlm.hidden + 2 * mlm.hidden + 2)


@pytest.mark.parametrize(("config", "message"), [
    ({**BERT_CONFIG, "architectures": ["BertForTokenClassification"]}, r"a TokenClassification head is not modelled"),
    ({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512,
      "architectures": ["GPT2ForSequenceClassification"]}, r"a SequenceClassification head is not modelled"),
    ({**BERT_CONFIG, "architectures": ["BertForSequenceClassification"], "num_labels": 0}, r"num_labels=0"),
])
def test_task_heads_that_are_not_modelled_are_refused(config: dict[str, Any], message: str) -> None:
    with pytest.raises(tm.SpecError, match=message):
        tm.ModelSpec.from_hf_config(config)


def test_num_labels_on_a_family_without_a_modelled_classifier_is_refused() -> None:
    with pytest.raises(tm.SpecError, match=r"num_labels=2 .* is modelled for .*bert.*, not gpt2"):
        tm.ModelSpec(family="gpt2", n_layers=2, hidden=64, n_heads=4, ffn=128, vocab=512, num_labels=2)
    m = tm.ModelSpec.model_validate({**DECODERS["llama"], "num_labels": 2})
    with pytest.raises(tm.SpecError, match=r"loss_impl='chunked' replaces the language-model head's loss"):
        tm.estimate(m, seq_len=128, loss_impl="chunked")


def test_a_decoders_classifier_config_is_read_with_its_labels_and_keeps_no_lm_head() -> None:
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 512, "architectures": ["LlamaForSequenceClassification"],
           "num_labels": 3}
    m = tm.ModelSpec.from_hf_config(cfg)
    assert m.num_labels == 3 and tm.ModelSpec.from_hf_config(to_hf_config(m)) == m
    names = {p.name for p in param_inventory(m)}
    assert "score.weight" in names and "lm_head.weight" not in names


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs the measure extra")
@pytest.mark.parametrize("labels", [1, 2, 5])
@pytest.mark.parametrize("spec", ["bert", *DECODERS])
def test_parameter_inventory_equals_the_classifier_transformers_builds(spec: str, labels: int) -> None:
    from trainmem_nb.measure.models import hf_param_shapes

    m = tm.ModelSpec.model_validate({**(TINY_BERT if spec == "bert" else DECODERS[spec]), "num_labels": labels})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shapes = hf_param_shapes(to_hf_config(m))
    hf: dict[tuple[str, tuple[int, ...]], int] = {}
    for full, shape in shapes.items():
        name = re.sub(r"^(bert|model)\.", "", re.sub(r"(encoder\.layer|layers)\.\d+\.", "layers.", full))
        hf[(name, shape)] = hf.get((name, shape), 0) + 1
    assert {(p.name, p.shape): p.count for p in param_inventory(m)} == hf


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs the measure extra")
@pytest.mark.parametrize("labels", [1, 2, 5])
@pytest.mark.parametrize("spec", ["bert", *DECODERS])
@pytest.mark.parametrize("options", [
    dict(precision="fp32"),
    dict(precision="fp32", dropout=0.1),
    dict(precision="bf16-mixed"),
    dict(precision="fp32", attention="eager"),
    dict(precision="fp32", checkpointing="full"),
    dict(precision="bf16-true", method="lora", lora_targets="query,value"),
], ids=["fp32", "dropout", "bf16-mixed", "eager", "checkpointed", "lora"])
def test_every_classifier_step_matches_its_measurement_to_the_byte(spec: str, labels: int,
                                                                   options: dict[str, Any]) -> None:
    from trainmem_nb.measure.api import measure

    if spec != "bert" and options.get("method") == "lora":
        options = dict(options, lora_targets="qv")
    m = tm.ModelSpec.model_validate({**(TINY_BERT if spec == "bert" else DECODERS[spec]), "num_labels": labels})
    opts = {"micro_batch": 3, "seq_len": 32, "device": "cpu", "optimizer": "adamw", "dropout": 0.0, **options}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = measure(m, **opts)
    e = tm.estimate(m, **opts)
    assert (e.peak_allocated_bytes, e.peak_phase) == (measured.peak_allocated_bytes, measured.peak_phase)
