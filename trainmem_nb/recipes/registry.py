"""Which recipe runs each family's forward."""

from __future__ import annotations

from ..engine.ops import Ctx
from ..model.families import Family
from ..model.spec import ModelSpec
from ..spec.training import TrainingSpec
from .base import Recipe
from .bert import BertRecipe
from .gemma import GemmaRecipe
from .gpt2 import GPT2Recipe
from .gpt_neox import GPTNeoXRecipe
from .llama import LlamaRecipe
from .mistral import MistralRecipe
from .mixtral import MixtralRecipe
from .opt import OPTRecipe
from .phi3 import Phi3Recipe

__all__ = ["RECIPES", "recipe_for"]

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


def recipe_for(m: ModelSpec, t: TrainingSpec, ctx: Ctx) -> Recipe:
    """The recipe of `m`'s family."""
    try:
        cls = RECIPES[m.family]
    except KeyError:
        raise NotImplementedError(f"family {m.family.value!r} has no recipe yet") from None
    return cls(m, t, ctx)
