"""One module per model family: each holds the recipe of its Hugging Face forward (see
`trainmem_nb.activations`)."""

from __future__ import annotations

from ..specs import Family
from .llama import LlamaRecipe

__all__ = ["RECIPES"]

#: The recipe class of every supported family.
RECIPES: dict[Family, type] = {
    Family.LLAMA: LlamaRecipe,
    Family.MISTRAL: LlamaRecipe,
    Family.QWEN2: LlamaRecipe,
    Family.GEMMA: LlamaRecipe,
    Family.PHI3: LlamaRecipe,
    Family.MIXTRAL: LlamaRecipe,
}
