"""One module per model family: each holds the recipe of its Hugging Face forward (see
`trainmem_nb.activations`)."""

from __future__ import annotations

from ..specs import Family
from .bert import BertRecipe
from .gemma import GemmaRecipe
from .gpt2 import GPT2Recipe
from .gpt_neox import GPTNeoXRecipe
from .llama import LlamaRecipe
from .mistral import MistralRecipe
from .mixtral import MixtralRecipe
from .opt import OPTRecipe
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
    Family.GPT2: GPT2Recipe,
    Family.OPT: OPTRecipe,
    Family.BERT: BertRecipe,
    Family.GPT_NEOX: GPTNeoXRecipe,
}
