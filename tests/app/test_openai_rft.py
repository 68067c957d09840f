"""OpenAI's reinforcement fine-tuning served by tuneyard, driven by the real `openai`
package: an RFT file (a conversation ending with the turn to answer, and the fields the
grader reads) uploaded with purpose "fine-tune", a job with `method.type: "reinforcement"`
and its grader and hyperparameters, read back in OpenAI's shapes and as the grpo run it
is. Ray is absent here: jobs stay queued (tests/e2e/test_openai_sdk.py trains one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.app.conftest import HTTP_TIMEOUT_S

# OpenAI's RFT guide's shape: the conversation, and a field the grader compares with.
RFT = [
    {
        "messages": [
            {"role": "system", "content": "Answer with one word."},
            {"role": "user", "content": "Capital of France?"},
        ],
        "reference_answer": "Paris",
    },
    *(
        {"messages": [{"role": "user", "content": f"{n}+{n}?"}], "reference_answer": str(2 * n)}
        for n in range(1, 8)
    ),
]
GRADER = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.reference_answer}}",
    "operation": "eq",
}


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def rft_file(openai_sdk: openai.OpenAI, tmp_path: Path) -> Any:
    return openai_sdk.files.create(file=_jsonl(tmp_path / "rft.jsonl", RFT), purpose="fine-tune")


# The tiny GPT-2 has no chat template of its own; the extension gives it one.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Its 128 positions hold no 256-token completion (the grpo default), which OpenAI's request
# has no name for: the extension sets it.
EXTENSION = {
    "tuneyard": {"dataset": {"chat_template": TEMPLATE}, "method": {"max_completion_tokens": 32}}
}


def _create(sdk: openai.OpenAI, model: Path, file_id: str, **reinforcement: Any) -> Any:
    return sdk.fine_tuning.jobs.create(
        model=str(model),
        training_file=file_id,
        method={"type": "reinforcement", "reinforcement": {"grader": GRADER, **reinforcement}},
        extra_body=EXTENSION,
    )


def _run(openai_live: tuple[str, str], run_id: str) -> dict[str, Any]:
    url, key = openai_live
    response = httpx.get(
        f"{url}/v1/runs/{run_id}",
        headers={"Authorization": f"Bearer {key}"},
        timeout=HTTP_TIMEOUT_S,
    )
    return dict(response.json())


def test_an_rft_file_is_told_apart_and_checked_line_by_line(
    openai_sdk: openai.OpenAI, openai_live: tuple[str, str], rft_file: Any, tmp_path: Path
) -> None:
    url, key = openai_live
    view = httpx.get(
        f"{url}/v1/files/{rft_file.id}",
        headers={"Authorization": f"Bearer {key}"},
        timeout=HTTP_TIMEOUT_S,
    ).json()
    assert view["purpose"] == "prompt", view
    answered = {"messages": [*RFT[1]["messages"], {"role": "assistant", "content": "2"}]}
    with pytest.raises(openai.BadRequestError) as refused:
        openai_sdk.files.create(
            file=_jsonl(tmp_path / "bad.jsonl", [RFT[0], answered]), purpose="fine-tune"
        )
    assert "line 2" in refused.value.message, refused.value.message


def test_a_job_is_a_grpo_run_on_the_prompts_with_openais_hyperparameters(
    openai_sdk: openai.OpenAI,
    openai_live: tuple[str, str],
    rft_file: Any,
    tiny_model_dir: Path,
) -> None:
    job = _create(
        openai_sdk,
        tiny_model_dir,
        rft_file.id,
        hyperparameters={
            "n_epochs": 2,
            "batch_size": 4,
            "compute_multiplier": 0.5,
            "eval_interval": 3,
            "reasoning_effort": "high",
        },
    )
    assert job.method.type == "reinforcement"
    rl = job.method.reinforcement
    assert rl is not None and rl.grader.model_dump(exclude_none=True) == GRADER
    assert rl.hyperparameters.compute_multiplier == 0.5
    assert rl.hyperparameters.n_epochs == 2 and rl.hyperparameters.batch_size == 4
    assert rl.hyperparameters.eval_interval == 3

    spec = _run(openai_live, job.id)["spec"]
    assert spec["dataset"]["format"] == "prompt"
    assert spec["dataset"]["prompt_field"] == "messages"
    assert spec["method"]["type"] == "grpo"
    assert spec["method"]["num_generations"] == 4  # 8 at compute_multiplier 1
    assert spec["training"]["epochs"] == 2
    assert spec["training"]["eval_every_n_steps"] == 3
    # 4 prompts a step: 1 a worker on 2 workers, 2 micro-batches.
    assert spec["training"]["gradient_accumulation_steps"] == 2

    events = [e.message for e in openai_sdk.fine_tuning.jobs.list_events(job.id)]
    assert any("reasoning_effort 'high' is accepted and ignored" in m for m in events), events


def test_auto_hyperparameters_resolve_to_the_grpo_defaults(
    openai_sdk: openai.OpenAI,
    openai_live: tuple[str, str],
    rft_file: Any,
    tiny_model_dir: Path,
) -> None:
    job = _create(openai_sdk, tiny_model_dir, rft_file.id)
    spec = _run(openai_live, job.id)["spec"]
    assert spec["method"]["num_generations"] == 8
    assert spec["training"]["epochs"] == 1 and spec["training"]["learning_rate"] == 1e-5
    assert spec["training"]["eval_every_n_steps"] is None
    events = [e.message for e in openai_sdk.fine_tuning.jobs.list_events(job.id)]
    assert not any("accepted and ignored" in m for m in events), events


def test_a_job_on_a_model_without_a_chat_template_is_a_400_naming_it(
    openai_sdk: openai.OpenAI, rft_file: Any, tiny_model_dir: Path
) -> None:
    """An RFT file's prompts are chat messages: rendered with a chat template, which this
    model lacks and the job does not give (the tuneyard extension's dataset.chat_template)."""
    with pytest.raises(openai.BadRequestError) as refused:
        openai_sdk.fine_tuning.jobs.create(
            model=str(tiny_model_dir),
            training_file=rft_file.id,
            method={"type": "reinforcement", "reinforcement": {"grader": GRADER}},
            extra_body={"tuneyard": {"method": {"max_completion_tokens": 32}}},
        )
    assert refused.value.param == "dataset.chat_template", refused.value.body
    message = refused.value.message
    assert f"line 1 of uploaded file {rft_file.id} gives its prompt" in message, message
    assert "(dataset.prompt_field 'messages')" in message
    assert not list(openai_sdk.fine_tuning.jobs.list())


def _judged(model: str) -> dict[str, Any]:
    """OpenAI's multi grader with a score_model judge beside the exact check."""
    judge = {
        "type": "score_model",
        "name": "judge",
        "model": model,
        "input": [
            {"role": "system", "content": "Score the answer from 0 to 1."},
            {"role": "user", "content": "{{item.reference_answer}} / {{sample.output_text}}"},
        ],
        "range": [0, 1],
    }
    return {
        "type": "multi",
        "name": "judged",
        "graders": {"judge": judge, "exact": GRADER},
        "calculate_output": "(judge + exact) / 2",
    }


def test_a_job_graded_by_a_model_is_a_grpo_run_with_its_judge(
    openai_sdk: openai.OpenAI, openai_live: tuple[str, str], rft_file: Any, tiny_model_dir: Path
) -> None:
    grader = _judged("Qwen/Qwen2.5-0.5B-Instruct")
    job = _create(openai_sdk, tiny_model_dir, rft_file.id, grader=grader)
    method = _run(openai_live, job.id)["spec"]["method"]
    assert method["type"] == "grpo"
    assert method["grader"]["graders"]["judge"]["model"] == "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.mark.parametrize(
    ("grader", "param", "words"),
    [
        ({**GRADER, "operation": "regex"}, "method.reinforcement.grader", "'eq'"),
        ({**GRADER, "reference": "{{item.answer}}"}, "method.reinforcement.grader", "'answer'"),
        ({**GRADER, "input": "{{answer}}"}, "method.reinforcement.grader", "namespace"),
        (
            _judged("/nowhere/judge"),
            "method.reinforcement.grader.graders.judge.model",
            "outside the allowed roots",
        ),
        (
            _judged("o4-mini-2025-04-16"),
            "method.reinforcement.grader.graders.judge.model",
            "OpenAI's models",
        ),
    ],
    ids=["operation", "field-the-file-lacks", "template", "judge-path", "openai-judge"],
)
def test_a_bad_grader_is_a_400_naming_it(
    openai_sdk: openai.OpenAI,
    rft_file: Any,
    tiny_model_dir: Path,
    grader: dict[str, Any],
    param: str,
    words: str,
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        openai_sdk.fine_tuning.jobs.create(
            model=str(tiny_model_dir),
            training_file=rft_file.id,
            method={"type": "reinforcement", "reinforcement": {"grader": grader}},
            extra_body=EXTENSION,
        )
    assert refused.value.param is not None
    assert refused.value.param.startswith(param), refused.value.body
    assert words in refused.value.message, refused.value.message
    assert not list(openai_sdk.fine_tuning.jobs.list())
