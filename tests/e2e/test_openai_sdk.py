"""The `openai` package as a team leaving OpenAI's fine-tuning would use it, pointed at the
real service with a real local Ray cluster: upload, create, follow the events until the job
succeeds, list its checkpoints, load the model; graders; and the errors it raises on the way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import Service
from tests.e2e.helpers import rft_records

pytestmark = pytest.mark.e2e

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WORDS = ["market", "team", "storm", "bank", "city", "vote", "price", "goal"]


def _conversations(n: int) -> str:
    return "".join(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": WORDS[i % len(WORDS)]},
                    {"role": "assistant", "content": WORDS[(i + 3) % len(WORDS)]},
                ]
            }
        )
        + "\n"
        for i in range(n)
    )


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{service.base_url}/v1", api_key=service.api_key, max_retries=0
    ) as sdk:
        yield sdk


def _upload(client: openai.OpenAI, path: Path, text: str) -> Any:
    path.write_text(text)
    return client.files.create(file=path, purpose="fine-tune")


def _until_done(client: openai.OpenAI, job_id: str, timeout_s: float = 600) -> list[Any]:
    """Follow the job as OpenAI's examples do, by its events; all of them, oldest first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in ("succeeded", "failed", "cancelled"):
            return list(reversed(list(client.fine_tuning.jobs.list_events(job_id, limit=50))))
        client.fine_tuning.jobs.list_events(job_id, limit=5)
        time.sleep(1)
    raise AssertionError(f"job {job_id} not done after {timeout_s}s")


def test_a_job_from_upload_to_a_loadable_model(
    client: openai.OpenAI, service: Service, tiny_llama_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    training = _upload(client, service.data_dir / "sdk-train.jsonl", _conversations(8))
    validation = _upload(client, service.data_dir / "sdk-valid.jsonl", _conversations(2))
    job = client.fine_tuning.jobs.create(
        model=str(tiny_llama_dir),
        training_file=training.id,
        validation_file=validation.id,
        hyperparameters={"batch_size": 4, "learning_rate_multiplier": 100},
        suffix="sdk",
        extra_body={
            "tuneyard": {
                "dataset": {"chat_template": TEMPLATE},
                "training": {"max_steps": 3, "seq_length": 96},
                "deepspeed": {"zero_stage": 2, "precision": "fp32"},
                "fault_tolerance": {"max_failures": 0},
            }
        },
    )
    assert job.status == "queued"

    events = _until_done(client, job.id)
    done = client.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded", (done.error, [e.message for e in events])
    assert done.error is None and done.finished_at is not None
    assert [e.data["status"] for e in events if e.data and e.data["type"] == "status"] == [
        "queued",
        "starting",
        "running",
        "succeeded",
    ]
    # Every input token of 3 steps of 4 conversations (the tokens metric, summed).
    assert done.trained_tokens is not None and done.trained_tokens > 3 * 4 * 5

    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert checkpoints and all(c.fine_tuning_job_id == job.id for c in checkpoints)
    # The DeepSpeed checkpoint and the exported model, which is the job's model.
    paths = {c.fine_tuned_model_checkpoint for c in checkpoints}
    assert done.fine_tuned_model in paths and len(paths) == 2
    final = next(c for c in checkpoints if c.metrics.valid_loss is not None)
    assert final.step_number == 3 and final.metrics.train_loss is not None

    assert done.fine_tuned_model is not None
    model = AutoModelForCausalLM.from_pretrained(done.fine_tuned_model)
    assert model.config.model_type == "llama"

    with pytest.raises(openai.ConflictError) as finished:
        client.fine_tuning.jobs.cancel(job.id)
    assert "succeeded" in finished.value.message


def test_errors_come_back_as_the_sdks_exceptions(
    client: openai.OpenAI, service: Service, tiny_llama_dir: Path
) -> None:
    bad = service.data_dir / "sdk-bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "hi"}]}) + "\n")
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=bad, purpose="fine-tune")
    assert refused.value.param == "file" and "'robot'" in refused.value.message

    training = _upload(client, service.data_dir / "sdk-train-2.jsonl", _conversations(4))
    missing = str(tiny_llama_dir.parent / "no-such-model")
    with pytest.raises(openai.BadRequestError) as unknown:
        client.fine_tuning.jobs.create(model=missing, training_file=training.id)
    assert unknown.value.param == "model" and "does not exist" in unknown.value.message


GRADER = {
    "type": "text_similarity",
    "name": "close",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "fuzzy_match",
}


def test_graders_and_a_refused_reinforcement_job(
    client: openai.OpenAI, service: Service, tiny_llama_dir: Path
) -> None:
    """The grader as OpenAI's SDK checks and runs it, on this service, and an RFT job whose
    grader cannot run refused before any compute. (The README's RFT snippet, which
    tests/e2e/test_documented_examples.py runs as written, trains one to its end.)"""
    assert client.fine_tuning.alpha.graders.validate(grader=GRADER).grader is not None
    graded = client.fine_tuning.alpha.graders.run(
        grader=GRADER, model_sample="market", item={"answer": "market"}
    )
    assert graded.reward == 1.0

    text = "".join(json.dumps(r) + "\n" for r in rft_records(8))
    training = _upload(client, service.data_dir / "sdk-rft.jsonl", text)
    with pytest.raises(openai.BadRequestError) as refused:
        client.fine_tuning.jobs.create(
            model=str(tiny_llama_dir),
            training_file=training.id,
            method={
                "type": "reinforcement",
                "reinforcement": {"grader": {**GRADER, "evaluation_metric": "cosine"}},
            },
        )
    assert refused.value.param is not None and "grader" in refused.value.param
