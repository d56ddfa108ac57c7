"""What every spec shares: frozen pydantic models whose errors surface as one clear `SpecError`, and
string enums whose parse errors list the valid values.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..errors import SpecError, did_you_mean


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


_FROZEN = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class SpecModel(BaseModel):
    """Base of every spec: pydantic validation whose errors surface as one clear `SpecError`, whether
    the spec is built with ``Spec(...)`` or ``Spec.model_validate(...)``."""

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
            parts.append(f"{loc}={err['input']!r}: {msg}")
        else:
            parts.append(msg if loc == "spec" else f"{loc}: {msg}")
    return "; ".join(parts)
