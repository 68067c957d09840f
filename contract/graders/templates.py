"""OpenAI's grader templates: `{{ item.<path> }}`, `{{ sample.output_text }}` and
`{{ sample.output_json.<path> }}` in any string a grader reads, each replaced by the value
it names. A template naming another namespace or variable is refused where the grader is
checked, so a typo never reaches a run as an empty string."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# `{{ namespace.path }}` with optional spaces inside the braces, as OpenAI's guide writes it.
# No lazy quantifier next to `\s*`: that pair backtracks cubically on "{{" and spaces with no
# closing braces; one greedy run that stops at any brace is linear (the spaces are stripped).
_PLACEHOLDER = re.compile(r"\{\{([^{}]*)\}\}")
_SEGMENT = re.compile(r"[A-Za-z0-9_\-]+")
_SAMPLE_VARIABLES = ("output_text", "output_json")
# A rendered string's length past which the grade is OpenAI's truncated_observation_error:
# a template that repeats a placeholder of a long field would otherwise build gigabytes
# from a request of kilobytes (on /graders/run, in the service's own process).
MAX_RENDERED_CHARS = 1_000_000


class TemplateError(ValueError):
    """A placeholder that names nothing a grader can read."""


class RenderedTooLong(ValueError):
    """A template whose values make a string past MAX_RENDERED_CHARS."""


class MissingValue(LookupError):
    """A placeholder whose value this sample or item lacks. `namespace` says which."""

    def __init__(self, namespace: str, path: str) -> None:
        super().__init__(f"{{{{{path}}}}}: the {namespace} has no such field")
        self.namespace = namespace
        self.path = path


@dataclass(frozen=True)
class Reference:
    """One placeholder: its namespace (`item` or `sample`) and the keys below it."""

    namespace: str
    keys: tuple[str, ...]

    @property
    def path(self) -> str:
        return ".".join((self.namespace, *self.keys))


def _parse(expression: str) -> Reference:
    expression = expression.strip()
    parts = expression.split(".")
    if not all(_SEGMENT.fullmatch(p) for p in parts):
        raise TemplateError(f"{{{{{expression}}}}} is not a dotted name")
    namespace, keys = parts[0], tuple(parts[1:])
    if namespace == "item":
        if not keys:
            raise TemplateError(f"{{{{{expression}}}}} names no field of the item")
    elif namespace == "sample":
        if not keys or keys[0] not in _SAMPLE_VARIABLES:
            raise TemplateError(
                f"{{{{{expression}}}}}: a sample has only "
                + " and ".join(f"sample.{v}" for v in _SAMPLE_VARIABLES)
            )
        if keys[0] == "output_text" and len(keys) > 1:
            raise TemplateError(f"{{{{{expression}}}}}: sample.output_text is a string")
    else:
        raise TemplateError(
            f"{{{{{expression}}}}}: the namespaces are `item` and `sample`, not `{namespace}`"
        )
    return Reference(namespace, keys)


def references(template: str) -> list[Reference]:
    """Every placeholder in `template`, checked; raises TemplateError for the first bad one,
    and for a `{{` that no `}}` closes (`{{ item.answer }`): read as text, it would grade
    every sample against the literal braces, silently."""
    found = [_parse(m.group(1)) for m in _PLACEHOLDER.finditer(template)]
    if "{{" in _PLACEHOLDER.sub("", template):
        raise TemplateError(
            "a '{{' opens no placeholder: write each as {{ item.<field> }} or "
            "{{ sample.output_text }}, closed by '}}'"
        )
    return found


@dataclass(frozen=True)
class Sample:
    """What a model wrote: its text, and that text as JSON when it parses as JSON."""

    output_text: str
    output_json: Any = None
    is_json: bool = False

    @classmethod
    def of(cls, text: str) -> Sample:
        try:
            return cls(text, json.loads(text), True)
        except (ValueError, RecursionError):  # RecursionError: JSON nested past the stack
            return cls(text)


def _lookup(value: Any, keys: tuple[str, ...], namespace: str, path: str) -> Any:
    for key in keys:
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            raise MissingValue(namespace, path)
    return value


def value_of(reference: Reference, sample: Sample, item: Any) -> Any:
    """The value a placeholder names. Raises MissingValue when the sample or item lacks it
    (a sample that is not JSON has no `output_json`)."""
    if reference.namespace == "item":
        return _lookup(item, reference.keys, "item", reference.path)
    if reference.keys[0] == "output_text":
        return sample.output_text
    if not sample.is_json:
        raise MissingValue("sample", reference.path)
    return _lookup(sample.output_json, reference.keys[1:], "sample", reference.path)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render(template: str, sample: Sample, item: Any) -> str:
    """`template` with each placeholder replaced by its value; a value that is not a
    string is written as JSON. Raises RenderedTooLong as soon as the result would pass
    MAX_RENDERED_CHARS."""
    parts: list[str] = []
    size, end = 0, 0
    for m in _PLACEHOLDER.finditer(template):
        value = _as_text(value_of(_parse(m.group(1)), sample, item))
        parts += [template[end : m.start()], value]
        size += m.start() - end + len(value)
        end = m.end()
        if size > MAX_RENDERED_CHARS:
            raise RenderedTooLong(
                f"the template's values make a text of over {MAX_RENDERED_CHARS:,} characters"
            )
    parts.append(template[end:])
    return "".join(parts)
