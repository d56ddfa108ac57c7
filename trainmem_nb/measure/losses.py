"""The losses a measured step runs: transformers' own (the model's ``.loss``), torchtune's
``LinearCrossEntropyLoss`` (``TrainingSpec.loss_impl='chunked'``) on the model's last hidden state, or
lit-gpt's chunked head and ``chunked_cross_entropy`` (``loss_impl='litgpt'``).

torchtune is not a dependency (it pulls torchao and its own model zoo), so its loss is reproduced here
statement by statement from torchtune 0.7.0 (pytorch/torchtune@bd2a0fc7,
torchtune/modules/loss/cross_entropy_loss.py, BSD-3-Clause: ``forward``, ``mask_inputs``,
``compute_cross_entropy``, eager) with the model's ``lm_head`` as its ``linear_projection``; the
targets are the token ids, none ignored (torchtune's datasets shift them on the host).

lit-gpt is not a dependency either: its finetune step's head and loss are reproduced from litgpt 0.5.13
(Lightning-AI/litgpt@26857050, Apache-2.0: ``GPT.forward``'s ``lm_head_chunk_size`` branch in
litgpt/model.py, the three statements of litgpt/finetune/lora.py lines 355-358 and ``chunked_cross_entropy``
in litgpt/utils.py lines 302-331) on the transformers model's decoder and ``lm_head``."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from ..spec.choices import LossImpl
from ..spec.training import TrainingSpec

__all__ = ["litgpt_chunked_loss", "step_loss", "torchtune_linear_cross_entropy"]

IGNORE_INDEX = -100  # torchtune's and transformers' default ignore_index (lit-gpt's chunked_cross_entropy's too)


def step_loss(model: Any, inputs: dict[str, torch.Tensor], t: TrainingSpec,
              forward_context: Any = None) -> torch.Tensor:
    """The loss of one forward: ``model(**inputs).loss``, or the chunked loss `t.loss_impl` names; the
    forward runs in `forward_context` (autocast for a mixed precision), with the loss inside it except for
    lit-gpt's, whose loop computes it after Fabric's forward returns."""
    ctx = contextlib.nullcontext() if forward_context is None else forward_context
    if t.loss_impl is LossImpl.LITGPT:
        return litgpt_chunked_loss(model, inputs["input_ids"], inputs["labels"], ctx)
    with ctx:
        if t.loss_impl is LossImpl.CHUNKED:
            return torchtune_linear_cross_entropy(model, inputs["input_ids"], inputs["labels"], t.loss_chunks)
        return model(**inputs).loss


def litgpt_chunked_loss(model: Any, input_ids: torch.Tensor, targets: torch.Tensor,
                        forward_context: Any = None) -> torch.Tensor:
    """lit-gpt's finetune step under Fabric: ``logits = model(input_ids, lm_head_chunk_size=128)`` (the model,
    in Fabric's forward context, returns a list of 128-token logit chunks and its hidden state goes; Fabric's
    ``_FabricModule.forward`` then converts the output to fp32, ``precision.convert_output``, for every
    precision but 32-true), ``logits[-1] = logits[-1][..., :-1, :]`` and ``loss = chunked_cross_entropy(logits,
    targets[..., 1:])``, outside the forward context."""
    from ..recipes.head import LITGPT_CHUNK

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model's transformers model
    with contextlib.nullcontext() if forward_context is None else forward_context:
        x = lm.get_decoder()(input_ids=input_ids).last_hidden_state
        head = lm.get_output_embeddings()
        thresh = getattr(lm.config, "final_logit_softcapping", None)  # GPT.forward's clamp_head (do_softcapping)
        clamp_head = (lambda x: torch.tanh(x / thresh) * thresh) if thresh else (lambda x: x)
        output = [clamp_head(head(x_i)) for x_i in x.split(LITGPT_CHUNK, dim=1)]
        del x
    # lightning 2.4 fabric/wrappers.py:138 `output = precision.convert_output(output)`: apply_to_collection(...,
    # _convert_fp_tensor, dst_type=torch.get_default_dtype()), a new list (.to is a no-op for fp32 chunks)
    logits = [chunk.to(torch.get_default_dtype()) for chunk in output]
    del output
    logits[-1] = logits[-1][..., :-1, :]
    return _chunked_cross_entropy(logits, targets[..., 1:])


def _chunked_cross_entropy(logits: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """litgpt/utils.py ``chunked_cross_entropy`` for a list of logits (the chunked head's), ``chunk_size=128``."""
    logit_chunks = [logit_chunk.reshape(-1, logit_chunk.size(-1)) for logit_chunk in logits]
    target_chunks = [target_chunk.reshape(-1) for target_chunk in targets.split(logits[0].size(1), dim=1)]
    loss_chunks = [
        torch.nn.functional.cross_entropy(logit_chunk, target_chunk, ignore_index=IGNORE_INDEX, reduction="none")
        for logit_chunk, target_chunk in zip(logit_chunks, target_chunks, strict=False)
    ]
    non_masked_elems = (targets != IGNORE_INDEX).sum()
    return torch.cat(loss_chunks).sum() / non_masked_elems.maximum(torch.ones_like(non_masked_elems))


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
