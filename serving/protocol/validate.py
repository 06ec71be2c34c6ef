"""A parsed JSON body to the route's request model: first the strings' Unicode (lone_surrogate), then pydantic's
validation; what is wrong is a 400 whose one-line message starts with the field's dotted path."""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

from pydantic import ValidationError

from serving.errors import ApiError
from serving.protocol.base import Body

B = TypeVar("B", bound=Body)


def validate_body(model: type[B], data: dict, control_tokens: Sequence[str] = ()) -> B:
    """`data` (a parsed JSON object) as `model`, or ApiError 400 naming the first field that is wrong.
    `control_tokens`: the served tokenizer's special tokens, which no message may spell (base.no_control_tokens)."""
    if field := lone_surrogate(data):
        raise ApiError(400, f"{field}: not valid Unicode (a lone surrogate escape such as \\ud800)", param=field)
    try:
        return model.model_validate(data, context={"control_tokens": control_tokens})
    except ValidationError as e:
        field, message = validation_message(e)
        raise ApiError(400, message, param=field) from None


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string in a parsed JSON value that is not valid Unicode (JSON's "\\ud800"
    escapes decode to lone surrogates, which no tokenizer can encode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate(key, path) or lone_surrogate(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := lone_surrogate(item, f"{path}.{i}" if path else str(i)):
                return found
    return None


def validation_message(e: ValidationError) -> tuple[str, str]:
    """(field, message) of the first problem pydantic found, e.g. ("messages.0.role", "Input should be ...")."""
    err = e.errors()[0]
    field = ".".join(str(part) for part in err["loc"]) or "body"
    message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
    return field, f"{field}: {message}"
