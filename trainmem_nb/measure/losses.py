"""The losses a measured step runs: transformers' own (the model's ``.loss``) or torchtune's
``LinearCrossEntropyLoss`` (``TrainingSpec.loss_impl='chunked'``) on the model's last hidden state.

torchtune is not a dependency (it pulls torchao and its own model zoo), so its loss is reproduced here
statement by statement from torchtune 0.7.0 (pytorch/torchtune@bd2a0fc7,
torchtune/modules/loss/cross_entropy_loss.py, BSD-3-Clause: ``forward``, ``mask_inputs``,
``compute_cross_entropy``, eager) with the model's ``lm_head`` as its ``linear_projection``; the
targets are the token ids, none ignored (torchtune's datasets shift them on the host)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..spec.choices import LossImpl
from ..spec.training import TrainingSpec

__all__ = ["step_loss", "torchtune_linear_cross_entropy"]

IGNORE_INDEX = -100  # torchtune's and transformers' default ignore_index


def step_loss(model: Any, inputs: dict[str, torch.Tensor], t: TrainingSpec) -> torch.Tensor:
    """The loss of one forward: ``model(**inputs).loss``, or the chunked loss `t.loss_impl` names."""
    if t.loss_impl is LossImpl.CHUNKED:
        return torchtune_linear_cross_entropy(model, inputs["input_ids"], inputs["labels"], t.loss_chunks)
    return model(**inputs).loss


def torchtune_linear_cross_entropy(model: Any, input_ids: torch.Tensor, targets: torch.Tensor,
                                   num_output_chunks: int) -> torch.Tensor:
    """A torchtune recipe's step with ``LinearCrossEntropyLoss(num_output_chunks)``: the model skips its
    output layer and returns the last hidden state, which the recipe holds while the loss runs
    (``outputs = self._model(**batch)``, the loss, then ``del outputs``)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model's transformers model
    outputs = lm.get_decoder()(input_ids=input_ids).last_hidden_state
    loss = _linear_cross_entropy(lm.get_output_embeddings(), outputs, targets, num_output_chunks)
    del outputs
    return loss


def _linear_cross_entropy(projection: Any, outputs: torch.Tensor, targets: torch.Tensor,
                          num_output_chunks: int) -> torch.Tensor:
    """``LinearCrossEntropyLoss.forward(outputs, targets)``: the valid rows kept, then chunk by chunk
    projected, upcast and summed."""
    total_valid_tokens = torch.where(targets != IGNORE_INDEX)[0].numel()
    targets = targets.reshape(-1)
    outputs = outputs.reshape(-1, outputs.shape[-1])
    # mask_inputs
    indices = torch.where(targets != IGNORE_INDEX)[0]
    outputs = outputs.index_select(0, indices)
    targets = targets.index_select(0, indices)
    del indices
    hidden_chunks = outputs.tensor_split(num_output_chunks, dim=0)
    target_chunks = targets.tensor_split(num_output_chunks, dim=0)
    del outputs, targets
    total_loss = torch.tensor(0.0, device=hidden_chunks[0].device)
    for hidden_chunk, target_chunk in zip(hidden_chunks, target_chunks, strict=True):
        # compute_cross_entropy
        logits = projection(hidden_chunk)
        loss = F.cross_entropy(logits.float(), target_chunk, reduction="sum", ignore_index=IGNORE_INDEX)
        del logits
        total_loss += loss
        del loss
    del hidden_chunks, target_chunks, hidden_chunk, target_chunk
    return total_loss / total_valid_tokens
