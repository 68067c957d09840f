"""The bodies of OpenAI's grader routes (`/v1/fine_tuning/alpha/graders/run|validate`), as
its SDK sends and reads them (`openai.types.fine_tuning.alpha`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from contract.graders.models import Grader

# A model's answer in full: far above a completion a grader reads in training.
MAX_SAMPLE_CHARS = 1_000_000

_EXAMPLE_GRADER: dict[str, JsonValue] = {
    "type": "string_check",
    "name": "exact answer",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


class GraderRun(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"grader": _EXAMPLE_GRADER, "model_sample": "42", "item": {"answer": "42"}}
            ]
        },
    )

    grader: Grader
    model_sample: str = Field(
        max_length=MAX_SAMPLE_CHARS,
        description="What the model wrote: `{{sample.output_text}}`, and "
        "`{{sample.output_json}}` when it is JSON",
    )
    item: dict[str, Any] | None = Field(
        default=None, description="The dataset line: `{{item.<field>}}` reads it"
    )


class GraderValidate(BaseModel):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"grader": _EXAMPLE_GRADER}]}
    )

    grader: Grader


class GraderValidated(BaseModel):
    grader: Grader


class GraderErrors(BaseModel):
    formula_parse_error: bool
    invalid_variable_error: bool
    model_grader_parse_error: bool
    model_grader_refusal_error: bool
    model_grader_server_error: bool
    model_grader_server_error_details: str | None
    other_error: bool
    python_grader_runtime_error: bool
    python_grader_runtime_error_details: str | None
    python_grader_server_error: bool
    python_grader_server_error_type: str | None
    sample_parse_error: bool
    truncated_observation_error: bool
    unresponsive_reward_error: bool


class GraderRunMetadata(BaseModel):
    name: str
    type: str
    errors: GraderErrors
    execution_time: float = Field(description="Seconds")
    scores: dict[str, float]
    token_usage: int | None
    sampled_model_name: str | None


class GraderRunResult(BaseModel):
    """The reward; a grader that could not score (a field the item lacks, a sample that
    is not JSON) scores 0 and says why in `metadata.errors`."""

    reward: float
    metadata: GraderRunMetadata
    sub_rewards: dict[str, float] = Field(description="A multi grader's graders' scores")
    model_grader_token_usage_per_model: dict[str, Any]
