"""OpenAI's fine-tuning API served by tuneyard, driven by the real `openai` package against a
real HTTP server (uvicorn in a thread) on SQLite and PostgreSQL. Ray is absent here: jobs
stay queued (tests/e2e/test_openai_sdk.py trains one).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from tests.app.conftest import HTTP_TIMEOUT_S
from tests.conftest import make_api_key

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT = [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Rain"},
        ]
    },
]


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def chat_file(openai_sdk: openai.OpenAI, tmp_path: Path) -> Any:
    return openai_sdk.files.create(file=_jsonl(tmp_path / "chat.jsonl", CHAT), purpose="fine-tune")


def _job(openai_sdk: openai.OpenAI, model: Path, training_file: str, **kwargs: Any) -> Any:
    extension = {"dataset": {"chat_template": TEMPLATE}, "training": {"seq_length": 64}}
    return openai_sdk.fine_tuning.jobs.create(
        model=str(model),
        training_file=training_file,
        extra_body={"tuneyard": extension},
        **kwargs,
    )


class TestFiles:
    def test_upload_retrieve_list_delete(
        self, openai_sdk: openai.OpenAI, chat_file: Any, tmp_path: Path, settings: Settings
    ) -> None:
        assert chat_file.object == "file" and chat_file.purpose == "fine-tune"
        assert chat_file.filename == "chat.jsonl" and chat_file.status == "processed"
        assert isinstance(chat_file.created_at, int)
        assert chat_file.bytes == (tmp_path / "chat.jsonl").stat().st_size
        # tuneyard's own fields ride along for those who read them.
        extra = chat_file.model_extra or {}
        assert extra["dataset_format"] == "chat" and extra["records"] == 2
        assert openai_sdk.files.retrieve(chat_file.id).id == chat_file.id

        second = openai_sdk.files.create(
            file=_jsonl(
                tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}]
            ),
            purpose="fine-tune",
        )
        page = openai_sdk.files.list(limit=1)
        assert [f.id for f in page.data] == [second.id] and page.has_more
        # The SDK follows `after` through every page.
        assert [f.id for f in openai_sdk.files.list(limit=1)] == [second.id, chat_file.id]

        stored = list(settings.uploads_dir.glob(f"{chat_file.id}.*"))
        assert [p.name for p in stored] == [f"{chat_file.id}.jsonl"]
        deleted = openai_sdk.files.delete(chat_file.id)
        assert deleted.deleted and deleted.id == chat_file.id
        # The bytes go too, once the row's removal is committed (just after the answer).
        deadline = time.monotonic() + 10
        while stored[0].exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not stored[0].exists()
        with pytest.raises(openai.NotFoundError) as missing:
            openai_sdk.files.retrieve(chat_file.id)
        assert chat_file.id in missing.value.message

    def test_a_bad_file_is_refused_with_the_line(
        self, openai_sdk: openai.OpenAI, tmp_path: Path
    ) -> None:
        bad = _jsonl(
            tmp_path / "bad.jsonl", [CHAT[0], {"messages": [{"role": "user", "content": "x"}]}]
        )
        with pytest.raises(openai.BadRequestError) as refused:
            openai_sdk.files.create(file=bad, purpose="fine-tune")
        assert refused.value.param == "file"
        assert "line 2" in refused.value.message and "assistant" in refused.value.message

    def test_a_file_of_no_known_kind_is_refused(
        self, openai_sdk: openai.OpenAI, tmp_path: Path
    ) -> None:
        odd = _jsonl(tmp_path / "odd.jsonl", [{"question": "a", "answer": "b"}])
        with pytest.raises(openai.BadRequestError) as refused:
            openai_sdk.files.create(file=odd, purpose="fine-tune")
        assert "chat records ('messages')" in refused.value.message

    @pytest.mark.parametrize(
        ("record", "kind"),
        [
            (CHAT[0], "chat"),
            ({"prompt": "2+2=", "completion": " 4"}, "prompt_completion"),
            ({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, "preference"),
        ],
    )
    def test_a_fine_tune_file_is_checked_as_what_its_records_are(
        self,
        openai_sdk: openai.OpenAI,
        openai_live: tuple[str, str],
        tmp_path: Path,
        record: dict[str, Any],
        kind: str,
    ) -> None:
        uploaded = openai_sdk.files.create(
            file=_jsonl(tmp_path / "data.jsonl", [record]), purpose="fine-tune"
        )
        url, key = openai_live
        view = httpx.get(
            f"{url}/v1/files/{uploaded.id}",
            headers={"Authorization": f"Bearer {key}"},
            timeout=HTTP_TIMEOUT_S,
        ).json()
        assert view["purpose"] == kind and view["fields"] == list(record)

    def test_tuneyard_clients_keep_tuneyard_shapes(
        self, openai_live: tuple[str, str], chat_file: Any
    ) -> None:
        url, key = openai_live
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=HTTP_TIMEOUT_S
        ) as http:
            view = http.get(f"/v1/files/{chat_file.id}").json()
            assert view["purpose"] == "chat" and view["records"] == 2
            assert view["status"] == "processed"  # OpenAI's field beside tuneyard's
            assert view["created_at"].endswith(("Z", "+00:00"))  # ISO 8601
            listed = http.get("/v1/files", params={"limit": 1}).json()
            assert listed["data"][0]["id"] == chat_file.id and listed["next_cursor"] is None
            missing = http.get("/v1/files/file_nope")
            assert missing.status_code == 404 and missing.json()["error"] == "not_found"
            # A client without OpenAI's SDK may ask for OpenAI's shapes itself.
            opted = {"OpenAI-Shapes": "true"}
            view = http.get(f"/v1/files/{chat_file.id}", headers=opted).json()
            assert view["purpose"] == "fine-tune" and view["created_at"] == chat_file.created_at
            missing = http.get("/v1/files/file_nope", headers=opted)
            assert missing.json()["error"]["code"] == "not_found"


class TestJobs:
    def test_create_resolves_openais_hyperparameters_into_the_run(
        self,
        openai_sdk: openai.OpenAI,
        openai_live: tuple[str, str],
        tiny_model_dir: Path,
        tmp_path: Path,
    ) -> None:
        # 8 conversations: 2 epochs of 4-row steps on 2 workers.
        chat_file = openai_sdk.files.create(
            file=_jsonl(tmp_path / "more.jsonl", CHAT * 4), purpose="fine-tune"
        )
        validation = openai_sdk.files.create(
            file=_jsonl(tmp_path / "valid.jsonl", CHAT[:1]), purpose="fine-tune"
        )
        job = _job(
            openai_sdk,
            tiny_model_dir,
            chat_file.id,
            validation_file=validation.id,
            hyperparameters={"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 2.0},
            suffix="support-bot",
            seed=7,
            metadata={"team": "nlp"},
        )
        assert job.object == "fine_tuning.job" and job.status == "queued"
        assert job.model == str(tiny_model_dir) and job.fine_tuned_model is None
        assert (job.training_file, job.validation_file) == (chat_file.id, validation.id)
        assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 4
        assert job.hyperparameters.learning_rate_multiplier == pytest.approx(2.0)
        assert job.method is not None and job.method.type == "supervised"
        assert job.seed == 7 and job.metadata == {"team": "nlp"}
        assert job.user_provided_suffix == "support-bot"  # type: ignore[attr-defined]

        # The same job is a tuneyard run, its spec what the hyperparameters resolve to.
        url, key = openai_live
        run = httpx.get(
            f"{url}/v1/runs/{job.id}",
            headers={"Authorization": f"Bearer {key}"},
            timeout=HTTP_TIMEOUT_S,
        )
        spec = run.json()["spec"]
        assert spec["training"]["epochs"] == 2
        # 2 workers x 1 row x 2 accumulated micro-batches = batch_size 4.
        assert spec["training"]["gradient_accumulation_steps"] == 2
        assert spec["training"]["learning_rate"] == pytest.approx(2e-5)
        assert spec["training"]["seed"] == 7
        assert spec["dataset"]["format"] == "chat"
        assert spec["dataset"]["eval_source"].endswith(f"{validation.id}.jsonl")

        assert openai_sdk.fine_tuning.jobs.retrieve(job.id).id == job.id

    def test_a_model_with_fewer_positions_than_any_fixed_default_is_taken(
        self,
        openai_sdk: openai.OpenAI,
        openai_live: tuple[str, str],
        tiny_model_dir: Path,
        chat_file: Any,
    ) -> None:
        # OpenAI clients have no seq_length to give: the tiny GPT-2 has 128 positions, fewer
        # than the 512 a fixed default asked for. The worker chooses it from the data.
        job = openai_sdk.fine_tuning.jobs.create(
            model=str(tiny_model_dir),
            training_file=chat_file.id,
            extra_body={"tuneyard": {"dataset": {"chat_template": TEMPLATE}}},
        )
        assert job.status == "queued"
        url, key = openai_live
        run = httpx.get(
            f"{url}/v1/runs/{job.id}",
            headers={"Authorization": f"Bearer {key}"},
            timeout=HTTP_TIMEOUT_S,
        )
        assert run.json()["spec"]["training"]["seq_length"] is None

    def test_the_extension_sets_priority_and_preemptible(
        self,
        openai_sdk: openai.OpenAI,
        openai_live: tuple[str, str],
        tiny_model_dir: Path,
        chat_file: Any,
    ) -> None:
        extension = {
            "dataset": {"chat_template": TEMPLATE},
            "training": {"seq_length": 64},
            "priority": 80,
            "preemptible": False,
        }
        job = openai_sdk.fine_tuning.jobs.create(
            model=str(tiny_model_dir),
            training_file=chat_file.id,
            extra_body={"tuneyard": extension},
        )
        url, key = openai_live
        run = httpx.get(
            f"{url}/v1/runs/{job.id}",
            headers={"Authorization": f"Bearer {key}"},
            timeout=HTTP_TIMEOUT_S,
        )
        assert (run.json()["spec"]["priority"], run.json()["spec"]["preemptible"]) == (80, False)

    def test_dpo_on_preference_pairs_with_auto_beta(
        self, openai_sdk: openai.OpenAI, tiny_model_dir: Path, tmp_path: Path
    ) -> None:
        pair = {"prompt": "a", "chosen": "b", "rejected": "c"}
        pairs = openai_sdk.files.create(
            file=_jsonl(tmp_path / "p.jsonl", [pair] * 2), purpose="fine-tune"
        )
        job = _job(openai_sdk, tiny_model_dir, pairs.id, method={"type": "dpo"})
        assert job.method is not None and job.method.type == "dpo"
        assert job.method.dpo is not None and job.method.dpo.hyperparameters is not None
        assert job.method.dpo.hyperparameters.beta == pytest.approx(0.1)

    @pytest.mark.parametrize(
        ("change", "param", "words"),
        [
            ({"model": "/elsewhere/model"}, "model", "outside the allowed roots"),
            ({"training_file": "file_nope"}, "training_file", "no uploaded file"),
            ({"hyperparameters": {"batch_size": 3}}, "hyperparameters.batch_size", "multiple"),
            ({"method": {"type": "reinforcement"}}, "method.reinforcement", "its grader"),
            ({"method": {"type": "dpo"}}, "method.type", "preference"),
            ({"extra_body": {"tuneyard": {"lora": {"r": 0}}}}, "lora.r", "greater than 0"),
            ({"extra_body": {"tuneyard": {"zero": 3}}}, "tuneyard.zero", "unknown group"),
            # Once taken as no settings at all, and the job made on the defaults.
            ({"extra_body": {"tuneyard": {"training": [1, 2]}}}, "tuneyard.training", "object"),
            ({"extra_body": {"tuneyard": {"method": "x"}}}, "tuneyard.method", "object"),
            # Once trained on what the job does not name, its training_file still shown.
            (
                {
                    "extra_body": {
                        "tuneyard": {"dataset": {"chat_template": TEMPLATE, "source": "ag_news"}}
                    }
                },
                "tuneyard.dataset.source",
                "its training_file",
            ),
        ],
    )
    def test_bad_requests_are_400s_naming_the_param_with_nothing_stored(
        self,
        openai_sdk: openai.OpenAI,
        chat_file: Any,
        tiny_model_dir: Path,
        change: dict[str, Any],
        param: str,
        words: str,
    ) -> None:
        body: dict[str, Any] = {
            "model": str(tiny_model_dir),
            "training_file": chat_file.id,
            "extra_body": {"tuneyard": {"dataset": {"chat_template": TEMPLATE}}},
            **change,
        }
        with pytest.raises(openai.BadRequestError) as refused:
            openai_sdk.fine_tuning.jobs.create(**body)
        assert refused.value.param == param, refused.value.body
        assert words in refused.value.message, refused.value.message
        assert refused.value.code == "validation_error"
        assert list(openai_sdk.fine_tuning.jobs.list()) == []

    def test_a_null_group_is_the_run_requests_none(
        self, openai_sdk: openai.OpenAI, chat_file: Any, tiny_model_dir: Path
    ) -> None:
        """`lora: null` is a full fine-tune, as in a run request; only a group that is
        neither an object nor null is refused."""
        job = openai_sdk.fine_tuning.jobs.create(
            model=str(tiny_model_dir),
            training_file=chat_file.id,
            extra_body={
                "tuneyard": {
                    "dataset": {"chat_template": TEMPLATE},
                    "training": {"seq_length": 64},
                    "lora": None,
                }
            },
        )
        assert job.status == "queued"

    def test_list_pages_and_filters_by_metadata(
        self, openai_sdk: openai.OpenAI, chat_file: Any, tiny_model_dir: Path
    ) -> None:
        first = _job(openai_sdk, tiny_model_dir, chat_file.id, metadata={"team": "a"})
        second = _job(openai_sdk, tiny_model_dir, chat_file.id, metadata={"team": "b"})
        page = openai_sdk.fine_tuning.jobs.list(limit=1)
        assert [j.id for j in page.data] == [second.id] and page.has_more
        assert [j.id for j in openai_sdk.fine_tuning.jobs.list(limit=1)] == [second.id, first.id]
        assert [j.id for j in openai_sdk.fine_tuning.jobs.list(metadata={"team": "a"})] == [
            first.id
        ]

    def test_cancel_events_and_a_file_in_use(
        self, openai_sdk: openai.OpenAI, chat_file: Any, tiny_model_dir: Path
    ) -> None:
        job = _job(openai_sdk, tiny_model_dir, chat_file.id)
        with pytest.raises(openai.ConflictError) as in_use:
            openai_sdk.files.delete(chat_file.id)
        assert job.id in in_use.value.message

        cancelled = openai_sdk.fine_tuning.jobs.cancel(job.id)
        assert cancelled.status == "cancelled" and cancelled.finished_at is not None
        assert openai_sdk.fine_tuning.jobs.cancel(job.id).status == "cancelled"  # harmless again

        events = openai_sdk.fine_tuning.jobs.list_events(job.id, limit=1)
        assert len(events.data) == 1 and events.has_more
        # Newest first, every page through `after`.
        everything = list(openai_sdk.fine_tuning.jobs.list_events(job.id, limit=1))
        assert everything[0].message == "cancelled before it started"
        assert all(e.object == "fine_tuning.job.event" for e in everything)
        assert [e.id for e in everything] == sorted(
            (e.id for e in everything), key=lambda i: int(i.split("-")[1]), reverse=True
        )
        assert list(openai_sdk.fine_tuning.jobs.checkpoints.list(job.id)) == []
        # Once no unfinished job reads it, the file may go.
        assert openai_sdk.files.delete(chat_file.id).deleted

    def test_resume_requeues_a_cancelled_job(
        self, openai_sdk: openai.OpenAI, chat_file: Any, tiny_model_dir: Path
    ) -> None:
        job = _job(openai_sdk, tiny_model_dir, chat_file.id)
        assert openai_sdk.fine_tuning.jobs.pause(job.id).status == "cancelled"
        assert openai_sdk.fine_tuning.jobs.resume(job.id).status == "queued"

    def test_a_job_whose_file_was_deleted_is_not_resumed(
        self, openai_sdk: openai.OpenAI, chat_file: Any, tiny_model_dir: Path
    ) -> None:
        job = _job(openai_sdk, tiny_model_dir, chat_file.id)
        openai_sdk.fine_tuning.jobs.cancel(job.id)
        openai_sdk.files.delete(chat_file.id)
        deadline = time.monotonic() + 10  # the bytes go just after the answer
        while time.monotonic() < deadline:
            try:
                openai_sdk.fine_tuning.jobs.resume(job.id)
            except openai.ConflictError as refused:
                assert "no longer exists" in refused.message
                break
            openai_sdk.fine_tuning.jobs.cancel(job.id)
            time.sleep(0.05)
        else:
            raise AssertionError("resumed a job whose training file is gone")
        assert openai_sdk.fine_tuning.jobs.retrieve(job.id).status == "cancelled"

    def test_another_key_sees_no_job(
        self,
        openai_sdk: openai.OpenAI,
        openai_live: tuple[str, str],
        chat_file: Any,
        tiny_model_dir: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        job = _job(openai_sdk, tiny_model_dir, chat_file.id)
        url, _ = openai_live
        other_key = make_api_key(session_factory, "team-b")
        with openai.OpenAI(base_url=f"{url}/v1", api_key=other_key, max_retries=0) as other:
            with pytest.raises(openai.NotFoundError):
                other.fine_tuning.jobs.retrieve(job.id)
            assert list(other.fine_tuning.jobs.list()) == []
        with (
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0) as stranger,
            pytest.raises(openai.AuthenticationError),
        ):
            stranger.fine_tuning.jobs.list()
