"""Training stacks: what a named stack (HF Trainer, torchtune, litgpt, ...) and the versions of its
components (torch, transformers, bitsandbytes, peft, CUDA) switch on in a training step.

A stack is a data file (``trainmem_nb/data/stacks/NAME.json``, or a user's own file): the training options
it sets (its loss, its dropout, ...), each with the source line it comes from, and the mechanisms of it
that are known but not modelled. ``data/stacks/components.json`` holds today's component versions and
the rules by which an older version switches a mechanism on (``torch < 2.0``: ``zero_grad`` keeps the
gradients), each with its source. `resolve_stack` turns ``"hf-trainer@4.38"`` plus any component
versions into a `Stack`: the options it implies and where each comes from.

>>> s = resolve_stack("hf-trainer@4.38", "torch=1.13")
>>> s.label, s.components["transformers"], s.options["zero_grad_set_to_none"].value
('hf-trainer@4.38', '4.38', False)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import SpecError, did_you_mean

__all__ = ["COMPONENTS", "Stack", "list_stacks", "parse_versions", "resolve_stack"]

#: The components whose versions change what a step allocates (`components.json` has a rule for each).
COMPONENTS = ("torch", "transformers", "bitsandbytes", "peft", "cuda")


def version_tuple(text: str) -> tuple[int, ...]:
    """``"4.38.2"`` -> ``(4, 38, 2)``: dotted integers, compared with missing parts as 0. A local tag or a
    pre-release (``2.1.0+cu118``, ``2.0.0rc1``, ``4.38.0.dev0``) counts as its release."""
    core = re.split(r"[+]|(?:\.?(?:a|b|rc|dev|post)\d*)$", str(text).strip())[0]
    parts = core.split(".")
    if not core or not all(p.isascii() and p.isdigit() for p in parts):
        raise ValueError(f"version {text!r} must be dotted numbers such as 4.38 or 0.43.2")
    out = [int(p) for p in parts]
    while len(out) > 1 and out[-1] == 0:
        out.pop()
    return tuple(out)


def _version_field(v: str) -> str:
    """A version field of a stack file, checked (`version_tuple`); ``""`` means not stated."""
    if v:
        version_tuple(v)
    return v


class _Setting(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    value: Any
    source: str = Field(min_length=1)


class _Rule(BaseModel):
    """`option` takes `value` when `component`'s version is below `below` (and at least `since`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    component: str
    option: str
    value: Any
    below: str = Field(min_length=1)
    since: str = "0"
    #: the rule holds only while these other components are below these versions as well
    also_below: dict[str, str] = {}
    source: str = Field(min_length=1)

    @field_validator("below", "since")
    @classmethod
    def _dotted(cls, v: str) -> str:
        return _version_field(v)

    def applies(self, version: str, comps: Mapping[str, str] | None = None) -> bool:
        others = all(version_tuple(comps.get(k, "0")) < version_tuple(v) for k, v in self.also_below.items()) \
            if comps is not None else not self.also_below
        return others and version_tuple(self.since) <= version_tuple(version) < version_tuple(self.below)


class _Unmodelled(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    mechanism: str = Field(min_length=1)
    source: str = Field(min_length=1)
    below: str = ""  #: only when the key library is older than this version ("" always)

    @field_validator("below")
    @classmethod
    def _dotted(cls, v: str) -> str:
        return _version_field(v)


class StackFile(BaseModel):
    """A stack's data file, validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    title: str = Field(min_length=1)
    library: str = Field(min_length=1, description="the key library: what NAME@VERSION's version is of")
    version: str = Field(default="", description="the key library's version today's stack is ('': not stated)")
    source: str = Field(min_length=1, description="where the stack's defaults were read")
    settings: dict[str, _Setting] = {}
    rules: tuple[_Rule, ...] = ()
    not_modelled: tuple[_Unmodelled, ...] = ()

    @field_validator("version")
    @classmethod
    def _dotted(cls, v: str) -> str:
        return _version_field(v)

    @model_validator(mode="after")
    def _rule_components(self) -> StackFile:
        for r in self.rules:
            if r.component != self.library and r.component not in COMPONENTS:
                raise ValueError(f"rule on {r.component!r}: a stack's rule is on its library ({self.library!r}) or "
                                 f"a component ({', '.join(COMPONENTS)})")
        return self


class Applied(NamedTuple):
    """One training option a stack sets, and why."""

    value: Any
    source: str


class Stack(NamedTuple):
    """A resolved stack: its name and key-library version, every component's version, the training
    options it implies (`Applied`, with their sources) and the mechanisms it has that are not modelled."""

    name: str
    title: str
    library: str
    version: str
    components: dict[str, str]
    options: dict[str, Applied]
    not_modelled: tuple[str, ...]

    @property
    def label(self) -> str:
        """``"hf-trainer@4.38"`` (``"default"`` for today's stack at today's versions)."""
        return self.name if self.name == "default" or not self.version else f"{self.name}@{self.version}"

    def to_dict(self, given: frozenset[str] = frozenset()) -> dict[str, Any]:
        """JSON-ready: the versions, each option the stack sets with its source (``overridden`` when it is
        among `given`, the options a spec was given itself) and the mechanisms not modelled."""
        return {"name": self.name, "label": self.label, "title": self.title, "library": self.library,
                "version": self.version, "components": dict(self.components),
                "options": {k: {"value": a.value, "source": a.source, "overridden": k in given}
                            for k, a in self.options.items()},
                "not_modelled": list(self.not_modelled)}

    def describe(self) -> str:
        """One line: the stack and every component version it assumes."""
        comps = ", ".join(f"{k} {v}" for k, v in self.components.items())
        return f"stack {self.label} ({self.title}): {comps}"


def _data(name: str) -> str:
    return resources.files("trainmem_nb").joinpath(f"data/stacks/{name}").read_text()


@lru_cache(maxsize=1)
def _components() -> tuple[dict[str, _Setting], tuple[_Rule, ...], dict[str, _Setting]]:
    """Today's component versions, the rules of older ones, and the oldest version of each a published check ran."""
    raw = json.loads(_data("components.json"))
    defaults = {k: _Setting.model_validate(v) for k, v in raw["defaults"].items()}
    oldest = {k: _Setting.model_validate(v) for k, v in raw["checked_from"].items()}
    return defaults, tuple(_Rule.model_validate(r) for r in raw["rules"]), oldest


def _out_of_range(comps: Mapping[str, str], defaults: Mapping[str, _Setting],
                  oldest: Mapping[str, _Setting]) -> tuple[str, ...]:
    """A line for each component version outside what is modelled: newer than today's (taken as today's) or older
    than any release a published check ran (its own mechanisms not known)."""
    out = []
    for k in COMPONENTS:
        v, today = version_tuple(comps[k]), version_tuple(defaults[k].value)
        if v[:len(today)] > today:  # a patch release of today's (2.13.1 of 2.13) is today's
            out.append(f"{k} {comps[k]}: newer than the newest release modelled ({k} {defaults[k].value}); "
                       f"its mechanisms are taken as {defaults[k].value}'s")
        elif v < version_tuple(oldest[k].value):
            out.append(f"{k} {comps[k]}: older than any release a published check ran ({k} {oldest[k].value}); "
                       f"what it does differently before that is not modelled")
    return tuple(out)


@lru_cache(maxsize=1)
def _named() -> dict[str, StackFile]:
    files = resources.files("trainmem_nb").joinpath("data/stacks")
    out = {}
    for f in sorted(files.iterdir(), key=lambda f: f.name):
        if f.name.endswith(".json") and f.name != "components.json":
            s = StackFile.model_validate_json(f.read_text())
            out[s.name] = s
    return out


def list_stacks() -> list[str]:
    """The named stacks, ``"default"`` first."""
    return ["default", *_named()]


@lru_cache(maxsize=64)
def _user_file(path: str, mtime: float) -> StackFile:
    try:
        return StackFile.model_validate_json(Path(path).read_text())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "the file"
        raise SpecError(f"stack file {path}: {where}: {first['msg']} (see trainmem_nb/data/stacks/*.json for the "
                        "format)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"stack file {path} cannot be read: {exc}") from None


def _stack_file(name: str) -> StackFile:
    if _is_path(name):
        p = Path(name).expanduser()
        if not p.is_file():
            raise SpecError(f"stack file {name} does not exist; pass a named stack ({', '.join(list_stacks())}) "
                            "or the path of a stack file")
        return _user_file(str(p.resolve()), p.stat().st_mtime)
    named = _named()
    key = name.strip().lower().replace("_", "-")
    for s in named.values():
        if key == s.name.replace("_", "-"):
            return s
    raise SpecError(f"stack={name!r} is not a named stack{did_you_mean(name, list(named))}; named stacks: "
                    f"{', '.join(list_stacks())} (NAME or NAME@VERSION, or the path of a stack file)")


def parse_versions(versions: str | Mapping[str, Any] | None) -> dict[str, str]:
    """Component versions from ``"torch=1.13,cuda=11.6"`` or a dict, each checked."""
    if not versions:
        return {}
    if isinstance(versions, str):
        pairs = [item.split("=", 1) for item in versions.split(",") if item.strip()]
        if any(len(p) != 2 for p in pairs):
            raise SpecError(f"versions={versions!r} must be COMPONENT=VERSION pairs, e.g. 'torch=1.13,cuda=11.6'")
        items = {k.strip().lower(): v.strip() for k, v in pairs}
        if len(items) < len(pairs):
            raise SpecError(f"versions={versions!r} names a component twice; give each once")
    elif isinstance(versions, Mapping):
        for k, v in versions.items():
            if not isinstance(v, str):
                raise SpecError(f"versions: {k}={v!r} must be a string such as '4.40' (a number loses its trailing "
                                "zeros: 4.40 reads as 4.4)")
        items = {str(k).strip().lower(): v.strip() for k, v in versions.items()}
    else:
        raise SpecError(f"versions must be a dict or 'torch=1.13,cuda=11.6', got {type(versions).__name__}")
    for k, v in items.items():
        if k not in COMPONENTS:
            raise SpecError(f"versions: {k!r} is not a component{did_you_mean(k, list(COMPONENTS))}; components: "
                            f"{', '.join(COMPONENTS)}")
        try:
            version_tuple(v)
        except ValueError as exc:
            raise SpecError(f"versions: {k}={v!r}: {exc}") from None
    return dict(sorted(items.items()))


def resolve_stack(stack: str = "", versions: str | Mapping[str, Any] | None = None) -> Stack:
    """The options `stack` (``""``/``"default"``, ``NAME``, ``NAME@VERSION`` or a file path) implies at
    `versions` (component versions; the stack's key-library version when it is a component too). A stack
    file is read again when it changes."""
    stack = stack.strip()
    stamp: tuple[str, float] | None = None
    if _is_path(stack):
        p = Path(stack).expanduser()
        stamp = (str(p.resolve()), p.stat().st_mtime) if p.is_file() else None
    return _resolve(stack, tuple(parse_versions(versions).items()), stamp)


def _is_path(stack: str) -> bool:
    return stack.endswith(".json") or "/" in stack or "\\" in stack


@lru_cache(maxsize=256)
def _resolve(stack: str, versions: tuple[tuple[str, str], ...], stamp: tuple[str, float] | None) -> Stack:
    defaults, rules, oldest = _components()
    comps = {k: s.value for k, s in defaults.items()}
    name, at, version = stack.partition("@") if not _is_path(stack) else (stack, "", "")
    if at and not version:
        raise SpecError(f"stack={stack!r} names no version after '@'; give NAME or NAME@VERSION (e.g. hf-trainer@4.38)")
    options: dict[str, Applied] = {}
    if name.lower() in ("", "default"):
        if version:
            raise SpecError(f"stack={stack!r}: the default stack has no version; give component versions instead "
                            f"({', '.join(COMPONENTS)})")
        sf = None
        title, library, version = "today's versions", "", ""
    else:
        sf = _stack_file(name)
        title, library = sf.title, sf.library
        if version:
            try:
                version_tuple(version)
            except ValueError as exc:
                raise SpecError(f"stack={stack!r}: {exc}") from None
        version = version or sf.version
        if library in comps:
            comps[library] = version
    given = dict(versions)
    if (library in given and sf is not None and at
            and version_tuple(given[library]) != version_tuple(version)):
        raise SpecError(f"stack={stack!r} says {library} {version} but versions says {library}={given[library]}; "
                        "give it once")
    comps.update(given)
    if sf is not None:
        if library in comps:
            version = comps[library]
        options.update({k: Applied(s.value, s.source) for k, s in sf.settings.items()})
        for r in sf.rules:  # rules on the stack's own library version, or on a component's
            of = comps.get(r.component) if r.component in COMPONENTS else version
            if of and r.applies(of, comps):
                options[r.option] = Applied(r.value, r.source)
    for r in rules:  # rules on the component versions
        if r.applies(comps[r.component], comps):
            options[r.option] = Applied(r.value, r.source)
    missing = tuple(u.mechanism for u in (sf.not_modelled if sf else ())
                    if not u.below or (version and version_tuple(version) < version_tuple(u.below)))
    missing += _out_of_range(comps, defaults, oldest)
    return Stack(sf.name if sf else "default", title, library, version or "", comps, options, missing)
