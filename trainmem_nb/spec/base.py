"""What every spec shares: frozen pydantic models whose errors surface as one clear `SpecError`, and
string enums whose parse errors list the valid values.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from enum import Enum
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator

from ..errors import SpecError, did_you_mean, show_value


class _Choice(str, Enum):
    """A string enum whose parse error lists the valid values and the closest match."""

    @classmethod
    def parse(cls, value: Any, field: str) -> Any:
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower().replace("_", "-")
        for member in cls:
            if text in (member.value, member.name.lower().replace("_", "-")):
                return member
        valid = [m.value for m in cls]
        raise SpecError(
            f"{field}={value!r} is not supported{did_you_mean(str(value), valid)}; "
            f"valid values: {', '.join(valid)}"
        )


def _is_bool(value: Any) -> bool:
    """True for Python and numpy booleans (numpy's is not a subclass of bool)."""
    return isinstance(value, bool) or type(value).__name__ == "bool_"


def strict_count(value: Any) -> int:
    """An integer option: ints and numpy integers; a float only when it is finite and whole (``2.0``);
    never a bool, bytes or text, which pydantic's lax mode would turn into 1 or 4 silently."""
    if _is_bool(value):
        raise ValueError("must be an integer, not a bool")
    if isinstance(value, (str, bytes, bytearray)):
        raise ValueError(f"must be an integer, not {type(value).__name__}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError("must be a finite whole number")
        return int(value)
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"must be an integer, not {type(value).__name__}") from None


def strict_real(value: Any) -> Any:
    """A float option: any real number but a bool or text (finiteness is the model config's
    ``allow_inf_nan=False``)."""
    if _is_bool(value):
        raise ValueError("must be a number, not a bool")
    if isinstance(value, (str, bytes, bytearray)):
        raise ValueError(f"must be a number, not {type(value).__name__}")
    if not isinstance(value, (int, float)) and hasattr(value, "__float__"):
        return float(value)  # numpy scalars
    return value


def strict_flag(value: Any) -> bool:
    """A yes/no option: True or False (numpy's too); never 1, 0 or a string."""
    if _is_bool(value):
        return bool(value)
    raise ValueError("must be True or False")


#: An integer field that refuses bools, bytes, text and fractional or non-finite floats.
Count = Annotated[int, BeforeValidator(strict_count)]
#: A float field that refuses bools and text (and, with `_FROZEN`, NaN and infinities).
Real = Annotated[float, BeforeValidator(strict_real)]
#: A boolean field that refuses anything but True and False.
Flag = Annotated[bool, BeforeValidator(strict_flag)]

#: The config every spec shares: frozen, no unknown fields, defaults validated, no NaN or infinity.
_FROZEN = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)


def _kind(annotation: Any) -> str:
    """'int', 'float', 'bool' or '' for a field's annotation (``X | None`` counts as X)."""
    args = [a for a in get_args(annotation) if a is not type(None)] if get_origin(annotation) in (Union, UnionType) \
        else [annotation]
    if len(args) != 1:
        return ""
    return {int: "int", float: "float", bool: "bool"}.get(args[0], "")


_STRICT = {"int": strict_count, "float": strict_real, "bool": strict_flag}
_FIELDS: dict[type, tuple[tuple[str, str], ...]] = {}


def _strict_fields(cls: type[BaseModel]) -> tuple[tuple[str, str], ...]:
    """(name, kind) of the fields of `cls` that take strict values, found once per class (every estimate
    builds its specs: reading the annotations each time cost a tenth of a millisecond)."""
    hit = _FIELDS.get(cls)
    if hit is None:
        hit = _FIELDS[cls] = tuple((name, kind) for name, info in cls.model_fields.items()
                                   if (kind := _kind(info.annotation)))
    return hit


class SpecModel(BaseModel):
    """Base of every spec: pydantic validation whose errors surface as one clear `SpecError`, whether
    the spec is built with ``Spec(...)`` or ``Spec.model_validate(...)``.

    Every ``int`` field takes integers only (numpy's too; no bools, bytes, text or fractional floats),
    every ``float`` field finite numbers (no bools or text) and every ``bool`` field True or False:
    pydantic's lax mode would run ``micro_batch=True`` as 1 and ``gpus=b'4'`` on 4 GPUs."""

    @model_validator(mode="before")
    @classmethod
    def _strict_values(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        out = dict(data)
        for name, kind in _strict_fields(cls):
            if name not in out or out[name] is None:
                continue
            try:
                out[name] = _STRICT[kind](out[name])
            except ValueError as exc:
                raise ValueError(f"{name}={show_value(out[name])} {exc}") from None
        return out

    def __init__(self, **data: Any) -> None:
        from pydantic import ValidationError

        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise SpecError(format_validation_error(exc)) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:
        """`BaseModel.model_validate`, raising `SpecError`."""
        from pydantic import ValidationError

        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise SpecError(format_validation_error(exc)) from None


def _validate(cls: type[BaseModel], data: Mapping[str, Any]) -> Any:
    """`model_validate` that turns pydantic's multi-line report into one clear `SpecError`."""
    from pydantic import ValidationError

    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc)) from None


def format_validation_error(exc: Any) -> str:
    """One line per problem: ``field=value: what is wrong`` (pydantic's own text, without its URL)."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err.get("loc", ())) or "spec"
        msg = str(err.get("msg", "invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if "input" in err and loc != "spec" and not isinstance(err["input"], (dict, list)):
            parts.append(f"{loc}={show_value(err['input'])}: {msg}")
        else:
            parts.append(msg if loc == "spec" else f"{loc}: {msg}")
    return "; ".join(parts)
