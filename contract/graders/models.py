"""The grader objects, in OpenAI's shapes (its SDK's `openai.types.graders`), checked in
full where they arrive: every template names a namespace and variable a grader can read,
a multi grader's formula parses and names only its graders, a metric this service cannot
compute is refused saying why. What passes here grades without a template or formula
error; only the data (an item lacking a field, a sample that is not JSON) can still fail."""

from __future__ import annotations

import ast
from functools import cached_property
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from contract.bounds import refuse_nul
from contract.graders import formula, similarity
from contract.graders.templates import Reference, references

_strict = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

# OpenAI's limit on a Python grader's source; templates and names far above real ones.
MAX_SOURCE_BYTES = 256 * 1024
MAX_TEMPLATE_CHARS = 64 * 1024
MAX_NAME_CHARS = 256
# A multi grader's graders: OpenAI's examples have two to five.
MAX_SUB_GRADERS = 32


def _checked_template(value: str) -> str:
    refuse_nul(value)
    references(value)  # raises TemplateError (a ValueError): pydantic names the field
    return value


Template = Annotated[str, Field(max_length=MAX_TEMPLATE_CHARS), AfterValidator(_checked_template)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(refuse_nul)]


class _Grader(BaseModel):
    model_config = _strict

    name: Name

    def templates(self) -> list[str]:
        """Every template this grader renders."""
        return []

    def item_fields(self) -> set[str]:
        """The dotted item fields its templates read (`item.answer` → `answer`): what each
        line of a dataset graded with it must have."""
        found: list[Reference] = [r for t in self.templates() for r in references(t)]
        return {".".join(r.keys) for r in found if r.namespace == "item"}


class StringCheckGrader(_Grader):
    """1 when `input` and `reference` compare as `operation` says, else 0: `eq` equal,
    `ne` different, `like` input contains reference, `ilike` the same ignoring case."""

    type: Literal["string_check"]
    input: Template
    reference: Template
    operation: Literal["eq", "ne", "like", "ilike"]

    def templates(self) -> list[str]:
        return [self.input, self.reference]


def _computable(metric: str) -> str:
    reason = similarity.unavailable(metric)
    if reason is not None:
        raise ValueError(reason)
    return metric


class TextSimilarityGrader(_Grader):
    """`input`'s similarity to `reference` by `evaluation_metric`, in [0, 1]."""

    type: Literal["text_similarity"]
    input: Template
    reference: Template
    evaluation_metric: Annotated[
        Literal[
            "cosine",
            "fuzzy_match",
            "bleu",
            "gleu",
            "meteor",
            "rouge_1",
            "rouge_2",
            "rouge_3",
            "rouge_4",
            "rouge_5",
            "rouge_l",
        ],
        AfterValidator(_computable),
    ]
    # OpenAI's evals read it; a reward ignores it. Accepted so that an eval's grader
    # can be reused as written.
    pass_threshold: float | None = None

    def templates(self) -> list[str]:
        return [self.input, self.reference]


def _bounded_source(source: str) -> str:
    refuse_nul(source)
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > MAX_SOURCE_BYTES:
        raise ValueError(f"is {size} bytes; the limit is {MAX_SOURCE_BYTES} (256 kB)")
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        raise ValueError(f"is not valid Python: {error.msg} (line {error.lineno})") from None
    except (ValueError, RecursionError, MemoryError) as error:
        raise ValueError(f"is not valid Python: {type(error).__name__}") from None
    grade = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "grade"]
    if not grade:
        raise ValueError("defines no top-level `def grade(sample, item) -> float`")
    arguments = grade[-1].args
    if len(arguments.posonlyargs) + len(arguments.args) < 2 and arguments.vararg is None:
        raise ValueError("`grade` must take two arguments: (sample, item)")
    return source


class PythonGrader(_Grader):
    """`grade(sample, item)` from `source`: untrusted code, run only where the operator
    enabled Python graders, in a sandbox (see the run's checks)."""

    type: Literal["python"]
    source: Annotated[str, AfterValidator(_bounded_source)]
    # OpenAI picks a container image by it; here the cluster's Python runs every grader.
    image_tag: Annotated[str | None, Field(max_length=MAX_NAME_CHARS)] = None


class InputText(BaseModel):
    model_config = _strict
    type: Literal["input_text", "output_text"]
    text: Template


class ScoreModelMessage(BaseModel):
    """One message to the scoring model: its text may hold templates."""

    model_config = _strict
    role: Literal["user", "assistant", "system", "developer"]
    content: Template | Annotated[list[InputText], Field(min_length=1, max_length=64)]
    type: Literal["message"] | None = None

    def texts(self) -> list[str]:
        return [self.content] if isinstance(self.content, str) else [p.text for p in self.content]


class SamplingParams(BaseModel):
    model_config = _strict
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**31)] | None = None
    max_completions_tokens: Annotated[int, Field(ge=1, le=32768)] | None = None
    # OpenAI's reasoning models read it; a local model has no such setting.
    reasoning_effort: str | None = None


class ScoreModelGrader(_Grader):
    """A model (one the cluster can load) reads `input` and answers with a score within
    `range`; the reward is that score."""

    type: Literal["score_model"]
    model: Annotated[str, Field(min_length=1, max_length=512), AfterValidator(refuse_nul)]
    input: Annotated[list[ScoreModelMessage], Field(min_length=1, max_length=64)]
    range: Annotated[list[float], Field(min_length=2, max_length=2)] = [0.0, 1.0]
    sampling_params: SamplingParams | None = None

    @model_validator(mode="after")
    def _range_ascends(self) -> Self:
        low, high = self.range
        if not low < high:
            raise ValueError(f"range must be [low, high] with low < high, not {self.range}")
        return self

    def templates(self) -> list[str]:
        return [text for message in self.input for text in message.texts()]


LeafGrader = Annotated[
    StringCheckGrader | TextSimilarityGrader | PythonGrader | ScoreModelGrader,
    Discriminator("type"),
]


def _graders_by_name(value: Any) -> Any:
    """OpenAI's SDK types `graders` as one grader, its API takes a map name → grader:
    one grader given alone is a map of its own name."""
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        return {str(value.get("name", "")): value}
    return value


class MultiGrader(_Grader):
    """Named graders, each scored, then `calculate_output` over their scores (by the
    names given as keys of `graders`)."""

    type: Literal["multi"]
    graders: Annotated[
        dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")], LeafGrader],
        Field(min_length=1, max_length=MAX_SUB_GRADERS),
        BeforeValidator(_graders_by_name),
    ]
    calculate_output: Annotated[str, Field(min_length=1, max_length=formula.MAX_LENGTH)]

    @field_validator("calculate_output")
    @classmethod
    def _formula_parses(cls, value: str, info: ValidationInfo) -> str:
        graders = info.data.get("graders")
        if graders is not None:  # else `graders` itself was refused
            formula.parse(value, frozenset(graders))  # FormulaError is a ValueError
        return value

    @cached_property
    def parsed_formula(self) -> ast.Expression:
        return formula.parse(self.calculate_output, frozenset(self.graders))

    def templates(self) -> list[str]:
        return [t for grader in self.graders.values() for t in grader.templates()]


Grader = Annotated[
    StringCheckGrader | TextSimilarityGrader | PythonGrader | ScoreModelGrader | MultiGrader,
    Discriminator("type"),
]
AnyGrader = StringCheckGrader | TextSimilarityGrader | PythonGrader | ScoreModelGrader | MultiGrader


def scoring_leaves(grader: AnyGrader) -> list[tuple[str | None, AnyGrader]]:
    """The graders that score: a multi grader's, each with its key, or the grader itself,
    keyed None. (The service names them by field, the worker's judges by key.)"""
    if isinstance(grader, MultiGrader):
        return list(grader.graders.items())
    return [(None, grader)]
