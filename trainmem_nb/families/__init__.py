"""One module per model family: each holds the recipe of its Hugging Face forward (see
`trainmem_nb.activations`)."""

from __future__ import annotations

from ..specs import Family
from .gemma import GemmaRecipe
from .llama import LlamaRecipe
from .mistral import MistralRecipe
from .mixtral import MixtralRecipe
from .phi3 import Phi3Recipe

__all__ = ["RECIPES"]

#: The recipe class of every supported family.
RECIPES: dict[Family, type] = {
    Family.LLAMA: LlamaRecipe,
    Family.MISTRAL: MistralRecipe,
    Family.QWEN2: LlamaRecipe,
    Family.GEMMA: GemmaRecipe,
    Family.PHI3: Phi3Recipe,
    Family.MIXTRAL: MixtralRecipe,
}
