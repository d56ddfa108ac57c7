"""Which recipe runs each family's forward: the one its description names."""

from __future__ import annotations

from ..engine.ops import Ctx
from ..model.families import describe
from ..model.spec import ModelSpec
from ..spec.training import TrainingSpec
from .base import Recipe
from .bert import BertRecipe
from .biased import BiasedDecoderRecipe
from .decoder import DecoderRecipe
from .gpt2 import GPT2Recipe
from .gpt_neox import GPTNeoXRecipe
from .opt import OPTRecipe
from .phi import PhiRecipe

__all__ = ["RECIPES", "recipe_for"]

#: Recipes by the name a description gives (``Description.recipe``): the composed decoder, and the
#: bespoke recipes of the families Hugging Face writes out on their own.
RECIPES: dict[str, type[Recipe]] = {
    "decoder": DecoderRecipe,
    "gpt2": GPT2Recipe,
    "opt": OPTRecipe,
    "bert": BertRecipe,
    "gpt_neox": GPTNeoXRecipe,
    "phi": PhiRecipe,
    "biased_decoder": BiasedDecoderRecipe,
}


def recipe_for(m: ModelSpec, t: TrainingSpec, ctx: Ctx) -> Recipe:
    """The recipe of `m`'s family."""
    return RECIPES[describe(m.family).recipe](m, t, ctx)
