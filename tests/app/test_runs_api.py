"""/v1/runs on a real database (SQLite file and PostgreSQL), without Ray."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.storage.models import Event, Run
from tests.conftest import make_api_key
from tests.factories import run_request


def _count_runs(session_factory: sessionmaker[Session]) -> int:
    with session_factory() as session:
        return int(session.scalar(select(func.count()).select_from(Run)) or 0)


def _problems(response: Any) -> dict[str, str]:
    body = response.json()
    assert body["error"] == "validation_error"
    return {p["field"]: p["message"] for p in body["detail"]}


class TestCreateRun:
    def test_creates_a_queued_run_with_defaults_filled_in(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        response = client.post("/v1/runs", json=run_request(tmp_path), headers=auth)

        assert response.status_code == 201, response.text
        run = response.json()
        assert run["id"].startswith("run_")
        assert run["status"] == "queued"
        assert run["attempt"] == 1
        assert run["error"] is None
        assert run["spec"]["task"] == "causal_lm"
        assert run["spec"]["training"]["max_steps"] == 5
        assert run["spec"]["training"]["lr_scheduler"] == "constant"
        assert run["spec"]["checkpointing"]["keep_last"] == 2
        assert run["progress"] == {
            "step": 0,
            "total_steps": None,
            "epoch": None,
            "fraction": None,
            "eta_seconds": None,
            "estimated_finish": None,
        }
        assert run["output"] == {"model_path": None, "latest_checkpoint": None}

    def test_records_a_queued_event(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id = client.post("/v1/runs", json=run_request(tmp_path), headers=auth).json()["id"]
        with session_factory() as session:
            events = list(session.scalars(select(Event).where(Event.run_id == run_id)))
        assert [(e.type, e.status) for e in events] == [("status", "queued")]

    def test_stores_absolute_paths_for_local_inputs(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, monkeypatch: Any
    ) -> None:
        monkeypatch.chdir(tmp_path)
        body = run_request(
            tmp_path, model="./model", dataset={"source": "./data.jsonl", "text_field": "text"}
        )
        run = client.post("/v1/runs", json=body, headers=auth).json()
        assert run["spec"]["model"] == str((tmp_path / "model").resolve())
        assert run["spec"]["dataset"]["source"] == str((tmp_path / "data.jsonl").resolve())

    def test_unknown_field_is_refused_naming_it(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = run_request(tmp_path, training={"max_stepz": 3})
        response = client.post("/v1/runs", json=body, headers=auth)

        assert response.status_code == 422
        assert "training.max_stepz" in _problems(response)
        assert "unknown field" in _problems(response)["training.max_stepz"]
        assert _count_runs(session_factory) == 0

    def test_wrong_type_is_refused_naming_the_field(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, training={"learning_rate": "fast"})
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        assert "training.learning_rate" in _problems(response)

    def test_missing_model_is_refused(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path)
        del body["model"]
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        assert "model" in _problems(response)

    def test_nonexistent_local_paths_are_refused_naming_the_path(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        missing_model = tmp_path / "no-such-model"
        missing_data = tmp_path / "no-such.jsonl"
        body = run_request(
            tmp_path,
            model=str(missing_model),
            dataset={"source": str(missing_data), "text_field": "text"},
        )
        response = client.post("/v1/runs", json=body, headers=auth)

        assert response.status_code == 422
        problems = _problems(response)
        assert str(missing_model) in problems["model"]
        assert "does not exist" in problems["model"]
        assert str(missing_data) in problems["dataset.source"]
        assert _count_runs(session_factory) == 0

    def test_paths_outside_the_allowed_roots_are_refused(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        tmp_path_factory: Any,
    ) -> None:
        outside = tmp_path_factory.mktemp("outside")
        (outside / "config.json").write_text("{}")
        body = run_request(tmp_path, model=str(outside))
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        assert "outside the allowed roots" in _problems(response)["model"]

    def test_a_symlink_cannot_leave_the_allowed_roots(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, tmp_path_factory: Any
    ) -> None:
        outside = tmp_path_factory.mktemp("secret")
        (outside / "data.jsonl").write_text('{"text": "x y"}\n')
        link = tmp_path / "innocent.jsonl"
        link.symlink_to(outside / "data.jsonl")
        body = run_request(tmp_path, dataset={"source": str(link), "text_field": "text"})
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        assert "outside the allowed roots" in _problems(response)["dataset.source"]

    def test_a_url_is_not_a_local_path(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, model="https://example.com/model")
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        assert "URL" in _problems(response)["model"]

    def test_hub_ids_are_accepted_without_a_local_check(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(
            tmp_path,
            model="openai-community/gpt2",
            dataset={"source": "ag_news", "text_field": "text"},
        )
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 201, response.text
        assert response.json()["spec"]["model"] == "openai-community/gpt2"

    def test_cross_field_rules_are_reported_together(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(
            tmp_path,
            deepspeed={"zero_stage": 1, "offload_params": "cpu", "precision": "fp16"},
            resources={"num_workers": 3, "use_gpu": False},
        )
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        message = " ".join(_problems(response).values())
        assert "offload_params needs zero_stage 3, got 1" in message
        assert "fp16 needs a GPU" in message

    def test_non_finite_numbers_are_refused(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path)
        raw = client.post(
            "/v1/runs",
            content=str(body).replace("'", '"').replace("0.001", "NaN"),
            headers={**auth, "Content-Type": "application/json"},
        )
        assert raw.status_code == 422
        assert "training.learning_rate" in _problems(raw)

    def test_needs_an_api_key(self, client: TestClient, tmp_path: Path) -> None:
        response = client.post("/v1/runs", json=run_request(tmp_path))
        assert response.status_code == 401
        assert response.json()["error"] == "unauthorized"

    def test_a_wrong_api_key_is_refused(self, client: TestClient, tmp_path: Path) -> None:
        response = client.post(
            "/v1/runs", json=run_request(tmp_path), headers={"Authorization": "Bearer ty_nope"}
        )
        assert response.status_code == 401


class TestGetRun:
    def test_returns_the_run(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        created = client.post("/v1/runs", json=run_request(tmp_path), headers=auth).json()
        fetched = client.get(f"/v1/runs/{created['id']}", headers=auth)
        assert fetched.status_code == 200
        assert fetched.json() == created

    def test_unknown_run_is_404(self, client: TestClient, auth: dict[str, str]) -> None:
        response = client.get("/v1/runs/run_doesnotexist", headers=auth)
        assert response.status_code == 404
        assert response.json()["error"] == "not_found"

    def test_another_principals_run_is_404(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id = client.post("/v1/runs", json=run_request(tmp_path), headers=auth).json()["id"]
        other = {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}
        for path in ("", "/metrics", "/checkpoints"):
            assert client.get(f"/v1/runs/{run_id}{path}", headers=other).status_code == 404
        assert client.get("/v1/runs", headers=other).json()["data"] == []


class TestListRuns:
    def test_newest_first_with_cursor_pages(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        ids = [
            client.post("/v1/runs", json=run_request(tmp_path), headers=auth).json()["id"]
            for _ in range(5)
        ]
        first = client.get("/v1/runs", params={"limit": 2}, headers=auth).json()
        assert [r["id"] for r in first["data"]] == ids[::-1][:2]
        assert first["next_cursor"]

        # A run created between pages must not shift or repeat the older pages.
        client.post("/v1/runs", json=run_request(tmp_path), headers=auth)
        seen = [r["id"] for r in first["data"]]
        cursor = first["next_cursor"]
        while cursor:
            page = client.get(
                "/v1/runs", params={"limit": 2, "cursor": cursor}, headers=auth
            ).json()
            seen += [r["id"] for r in page["data"]]
            cursor = page["next_cursor"]
        assert seen == ids[::-1]

    def test_filters_by_status(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        client.post("/v1/runs", json=run_request(tmp_path), headers=auth)
        queued = client.get("/v1/runs", params={"status": "queued"}, headers=auth).json()
        running = client.get("/v1/runs", params={"status": "running"}, headers=auth).json()
        assert len(queued["data"]) == 1
        assert running["data"] == []

    def test_bad_status_and_limit_are_422(self, client: TestClient, auth: dict[str, str]) -> None:
        assert client.get("/v1/runs", params={"status": "done"}, headers=auth).status_code == 422
        response = client.get("/v1/runs", params={"limit": 101}, headers=auth)
        assert response.status_code == 422
        assert "limit" in _problems(response)

    @pytest.mark.parametrize("key", ["it's", "clé", 'a"b', "日本", "a.b", "a b"])
    def test_filters_by_any_metadata_key_on_both_databases(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, key: str
    ) -> None:
        # SQLite's JSON path missed keys with a double quote, and non-ASCII keys (stored as
        # \u escapes), where PostgreSQL found them: the same filter, two answers.
        wanted = client.post(
            "/v1/runs", json=run_request(tmp_path, metadata={key: "été"}), headers=auth
        ).json()["id"]
        client.post("/v1/runs", json=run_request(tmp_path, metadata={key: "hiver"}), headers=auth)
        client.post("/v1/runs", json=run_request(tmp_path, metadata={"other": "été"}), headers=auth)

        found = client.get("/v1/runs", params={f"metadata.{key}": "été"}, headers=auth)
        assert found.status_code == 200, found.text
        assert [r["id"] for r in found.json()["data"]] == [wanted]

    @pytest.mark.parametrize(
        ("key", "value"), [("team", "a\x00b"), ("te\x00am", "a"), ("team", "v" * 257)]
    )
    def test_a_metadata_filter_no_run_can_match_is_422_not_500(
        self, client: TestClient, auth: dict[str, str], key: str, value: str
    ) -> None:
        # A NUL reached PostgreSQL, which cannot compare it: a 500 on every try.
        response = client.get("/v1/runs", params={f"metadata.{key}": value}, headers=auth)
        assert response.status_code == 422, response.text
        ((field, message),) = _problems(response).items()
        assert field.startswith("metadata")
        assert "NUL" in message or "at most 256 characters" in message

    def test_a_forged_cursor_is_422(self, client: TestClient, auth: dict[str, str]) -> None:
        response = client.get("/v1/runs", params={"cursor": "garbage!"}, headers=auth)
        assert response.status_code == 422
        assert "cursor" in _problems(response)


class TestHealth:
    def test_reports_database_and_ray(self, client: TestClient) -> None:
        body = client.get("/healthz").json()
        assert body["database"] == "ok"
        # The HTTP-only app has no Ray attached: degraded, not an error.
        assert body["ray"]["reachable"] is False
        assert body["status"] == "degraded"


class TestLocalDataChecked:
    """A local file's first records are read at create: a run whose data has no record
    with the field it reads is refused before any compute, whatever the rest of the
    request (`seq_length` set, as the README's examples set it, once let it through to
    fail on the cluster). Values are the worker's to take as they come."""

    @pytest.mark.parametrize(
        ("dataset", "missing"),
        [
            ({"text_field": "nope"}, "'nope' (dataset.text_field names it)"),
            (
                {"format": "prompt_completion", "completion_field": "answer"},
                "'prompt' (dataset.prompt_field names it)",
            ),
        ],
    )
    def test_a_field_the_run_reads_missing_from_the_file_is_422(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
        dataset: dict[str, Any],
        missing: str,
    ) -> None:
        data = tmp_path / "news.jsonl"
        data.write_text('{"text": "a b c"}\n' * 3)
        body = run_request(
            tmp_path,
            dataset={"source": str(data), **dataset},
            training={"max_steps": 2, "seq_length": 64},
        )
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422, response.text
        said = [p["message"] for p in response.json()["detail"] if p["field"] == "dataset.source"]
        assert f"news.jsonl has no field {missing} in its records; its fields are ['text']" in said
        assert _count_runs(session_factory) == 0

    def test_empty_or_missing_values_are_the_workers_to_take(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        """A raw corpus with blank lines and a record without the field trains as before:
        the worker reads them as empty text and leaves them out."""
        data = tmp_path / "corpus.jsonl"
        rows = [{"text": "a b c d"}, {"text": ""}, {"text": None}, {"other": 1}] * 3
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        body = run_request(tmp_path, dataset={"source": str(data), "text_field": "text"})
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 201, response.text
