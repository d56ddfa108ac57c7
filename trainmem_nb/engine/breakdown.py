"""The categories one training step's memory is broken into, shared by estimates and measurements.

Keys use slashes, parent first (``activations/layers``): a chart, a table and a test read the same
structure, and the five top-level parents are the JSON contract's ``breakdown_bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["DETAIL_KEYS", "TOP_KEYS", "roll_up"]

#: Top-level categories; ``breakdown_bytes`` always has exactly these and they sum to the peak
#: (the contract's five plus ``overhead``: allocator-counted bytes that are not tensors).
TOP_KEYS: tuple[str, ...] = ("weights", "gradients", "optimizer_states", "activations", "transient", "overhead")

#: Detailed categories (``detail_bytes``), each under one of `TOP_KEYS`.
DETAIL_KEYS: tuple[str, ...] = (
    "weights/params",  # parameters (trainable and frozen, adapters included)
    "weights/buffers",  # registered buffers: rotary inv_freq, position ids
    "weights/gathered",  # full parameters materialized from shards (FSDP / ZeRO-3 all-gather)
    "gradients",  # .grad of trainable parameters
    "optimizer_states",  # tensors in optimizer.state (moments, step counters)
    "activations/inputs",  # input ids and labels
    "activations/embeddings",  # saved by the embedding layers (and rotary cos/sin)
    "activations/layers",  # saved for backward inside the transformer layers
    "activations/weight_copies",  # autocast's 16-bit copies of fp32 weights, kept for backward
    "activations/head",  # final norm, logits and loss tensors kept for backward
    "activations/recomputed",  # re-materialized in backward by activation checkpointing
    "transient/forward",  # forward temporaries (freed within the forward)
    "transient/backward",  # activation gradients and other backward temporaries
    "transient/optimizer",  # temporaries inside optimizer.step (e.g. foreach AdamW's sqrt(v))
    "overhead/workspaces",  # cuBLAS workspaces PyTorch allocates through its caching allocator (cuda)
    "overhead/communication",  # all-gather, reduce-scatter and gradient-bucket buffers of data parallelism
    "weights/fp8_workspaces",  # Transformer Engine's cached fp8 weights and their transposes (Megatron fp8)
)


def roll_up(detail: Mapping[str, int]) -> dict[str, int]:
    """Sum detailed categories into the five `TOP_KEYS` (missing ones are 0).

    >>> roll_up({"activations/layers": 3, "activations/head": 1, "gradients": 2})["activations"]
    4
    """
    out = dict.fromkeys(TOP_KEYS, 0)
    for key, value in detail.items():
        top = key.split("/", 1)[0]
        if top not in out:
            raise KeyError(f"unknown breakdown category {key!r}; top-level keys are {', '.join(TOP_KEYS)}")
        out[top] += int(value)
    return out
