"""Which recipe runs each family's forward: the one its description names."""

from __future__ import annotations

from ..engine.ops import Ctx
from ..model.families import Family, describe
from ..model.spec import ModelSpec
from ..spec.choices import LossImpl
from ..spec.training import TrainingSpec
from .base import Recipe
from .bert import BertRecipe
from .biased import BiasedDecoderRecipe
from .decoder import DecoderRecipe
from .gpt2 import GPT2Recipe
from .gpt_neox import GPTNeoXRecipe
from .opt import OPTRecipe
from .phi import PhiRecipe

__all__ = ["RECIPES", "loss_gap", "recipe_for", "runs_loss", "separate_head"]

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


def separate_head(family: Family) -> bool:
    """Does the family's recipe give its output projection's weight on its own (`Recipe.lm_head_weight`), as
    lit-gpt's chunked head needs?"""
    return RECIPES[describe(family).recipe].lm_head_weight is not Recipe.lm_head_weight


def loss_gap(m: ModelSpec, t: TrainingSpec) -> str:
    """Why `t.loss_impl` is not modelled on `m`'s head ('' when it is): the memory-efficient losses replace a
    composed decoder's head (lit-gpt's chunked head any recipe's that gives its head's weight on its own,
    `Recipe.lm_head_weight`, soft-capped or not); none replaces a logits multiplier, a biased head or a
    sequence classifier's."""
    if t.loss_impl is LossImpl.STANDARD:
        return ""
    if m.num_labels:
        return f"a sequence classifier (num_labels={m.num_labels}) has no language-model head"
    d = describe(m.family)
    litgpt = t.loss_impl is LossImpl.LITGPT
    if not (d.composed or (litgpt and separate_head(m.family))):
        return "its head is bespoke"
    if m.final_softcap and not litgpt:  # lit-gpt's chunked head soft-caps each chunk (clamp_head)
        return "its final-logit soft-capping"
    if d.multipliers:
        return "its logits multiplier"
    return "its lm_head bias" if m.lm_head_bias else ""


def runs_loss(m: ModelSpec, t: TrainingSpec) -> LossImpl:
    """The loss the step runs: `t.loss_impl`, or transformers' standard loss where a stack's (not the user's)
    lit-gpt head is not modelled for `m` (`loss_gap`; the estimate's notes say so)."""
    if t.loss_impl is LossImpl.LITGPT and "loss_impl" not in t.model_fields_set and loss_gap(m, t):
        return LossImpl.STANDARD
    return t.loss_impl

