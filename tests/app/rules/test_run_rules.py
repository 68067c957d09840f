"""Every rule of a run request, through the API: a named field, a rule in words, nothing stored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.storage.models import Run
from tests.factories import run_request


def _refused(client: TestClient, auth: dict[str, str], body: dict[str, Any]) -> dict[str, str]:
    """POST the body; assert 422 and return {field: message}."""
    response = client.post("/v1/runs", json=body, headers=auth)
    assert response.status_code == 422, response.text
    problems: dict[str, str] = {}
    for p in response.json()["detail"]:
        problems[p["field"]] = " | ".join(filter(None, [problems.get(p["field"]), p["message"]]))
    return problems


def _model_with_config(root: Path, **config: Any) -> Path:
    folder = root / "configured-model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class TestCrossFieldRules:
    def test_tensor_parallel_size_must_divide_num_workers(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(
            tmp_path,
            deepspeed={"zero_stage": 1, "tensor_parallel_size": 2},
            resources={"num_workers": 3},
        )
        message = _refused(client, auth, body)["deepspeed.tensor_parallel_size"]
        assert "tensor_parallel_size (2) * data-parallel size must equal num_workers (3)" in message

    def test_offload_params_needs_stage_3(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, deepspeed={"zero_stage": 2, "offload_params": "cpu"})
        problems = _refused(client, auth, body)
        assert problems["deepspeed.offload_params"] == "offload_params needs zero_stage 3, got 2"

    def test_offload_optimizer_needs_a_zero_stage(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, deepspeed={"zero_stage": 0, "offload_optimizer": "cpu"})
        problems = _refused(client, auth, body)
        assert "needs zero_stage 1, 2 or 3, got 0" in problems["deepspeed.offload_optimizer"]

    def test_fp16_needs_a_gpu(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, deepspeed={"precision": "fp16"})
        assert "fp16 needs a GPU" in _refused(client, auth, body)["deepspeed.precision"]

    def test_gpus_per_worker_needs_use_gpu(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, resources={"gpus_per_worker": 1})
        assert "use_gpu" in _refused(client, auth, body)["resources.gpus_per_worker"]

    def test_warmup_cannot_exceed_max_steps(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, training={"max_steps": 5, "warmup_steps": 10})
        message = _refused(client, auth, body)["training.warmup_steps"]
        assert message == "warmup_steps (10) exceeds max_steps (5)"

    def test_needs_epochs_or_max_steps(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, training={"max_steps": None, "epochs": None})
        assert "epochs or training.max_steps" in _refused(client, auth, body)["training"]

    def test_a_local_dataset_has_only_the_train_split(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(
            tmp_path, dataset={"source": str(tmp_path / "data.jsonl"), "eval_split": "validation"}
        )
        message = _refused(client, auth, body)["dataset.eval_split"]
        assert "single split 'train'" in message and "train[90%:]" in message
        sliced = run_request(
            tmp_path,
            dataset={
                "source": str(tmp_path / "data.jsonl"),
                "split": "train[:90%]",
                "eval_split": "train[90%:]",
            },
        )
        assert client.post("/v1/runs", json=sliced, headers=auth).status_code == 201

    def test_classification_fields_belong_to_classification(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(
            tmp_path, dataset={"source": str(tmp_path / "data.jsonl"), "label_field": "label"}
        )
        assert "sequence_classification only" in _refused(client, auth, body)["dataset.label_field"]

    @pytest.mark.parametrize(
        ("group", "name", "value"),
        [
            ("training", "learning_rate", 0),
            ("training", "learning_rate", -1e-4),
            ("training", "batch_size_per_worker", 0),
            ("training", "seq_length", 1),
            ("training", "gradient_accumulation_steps", 0),
            ("resources", "num_workers", 0),
            ("resources", "cpus_per_worker", 0),
            ("deepspeed", "zero_stage", 4),
            ("deepspeed", "precision", "fp8"),
            ("checkpointing", "keep_last", 0),
            ("fault_tolerance", "max_failures", -1),
        ],
    )
    def test_sizes_rates_and_choices_are_checked(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        group: str,
        name: str,
        value: Any,
    ) -> None:
        body = run_request(tmp_path, **{group: {name: value}})
        assert f"{group}.{name}" in _refused(client, auth, body)

    @pytest.mark.parametrize("field", ["id", "status", "attempt", "owner", "created_at"])
    def test_server_owned_fields_cannot_be_set(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, field: str
    ) -> None:
        body = {**run_request(tmp_path), field: "x"}
        assert _refused(client, auth, body)[field] == (
            f"{field} is set by the server and cannot be given"
        )

    def test_metadata_is_small_string_pairs(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        too_many = {f"k{i}": "v" for i in range(17)}
        assert "metadata" in _refused(client, auth, run_request(tmp_path, metadata=too_many))
        long_key = {"k" * 65: "v"}
        assert any(
            f.startswith("metadata")
            for f in _refused(client, auth, run_request(tmp_path, metadata=long_key))
        )
        not_a_string = run_request(tmp_path, metadata={"team": 3})
        assert "metadata.team" in _refused(client, auth, not_a_string)

    def test_all_problems_are_reported_at_once_and_nothing_is_stored(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = run_request(
            tmp_path,
            model=str(tmp_path / "missing"),
            deepspeed={"zero_stage": 1, "offload_params": "cpu"},
            training={"max_steps": 2, "warmup_steps": 3},
        )
        problems = _refused(client, auth, body)
        assert {"model", "deepspeed.offload_params", "training.warmup_steps"} <= set(problems)
        with session_factory() as session:
            assert session.scalar(select(func.count()).select_from(Run)) == 0


class TestModelConfigRules:
    def test_heads_must_divide_by_tensor_parallel_size(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        model = _model_with_config(
            tmp_path,
            model_type="llama",
            num_attention_heads=6,
            num_key_value_heads=3,
            max_position_embeddings=128,
        )
        body = run_request(
            tmp_path,
            model=str(model),
            deepspeed={"zero_stage": 1, "tensor_parallel_size": 2},
            resources={"num_workers": 2},
        )
        response = client.post("/v1/runs/validate", json=body, headers=auth).json()
        messages = [
            e["message"]
            for e in response["errors"]
            if e["field"] == "deepspeed.tensor_parallel_size"
        ]
        assert any("3 key/value heads" in m for m in messages), messages
        assert not any("6 attention heads" in m for m in messages)

    def test_seq_length_within_the_models_positions(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        model = _model_with_config(tmp_path, model_type="gpt2", n_head=2, n_positions=64)
        body = run_request(tmp_path, model=str(model), training={"seq_length": 128})
        message = _refused(client, auth, body)["training.seq_length"]
        assert message == "seq_length (128) exceeds the model's maximum positions (64)"

    def test_architecture_must_fit_the_task(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        model = _model_with_config(tmp_path, model_type="vit")
        message = _refused(client, auth, run_request(tmp_path, model=str(model)))["model"]
        assert "model type 'vit' cannot be trained for task 'causal_lm'" in message

    def test_a_local_model_needs_a_config(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        empty = tmp_path / "empty-model"
        empty.mkdir()
        problems = _refused(client, auth, run_request(tmp_path, model=str(empty)))
        assert "has no config.json" in problems["model"]

    def test_a_dataset_file_of_another_type_is_refused(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        (tmp_path / "data.txt").write_text("hello\n")
        body = run_request(tmp_path, dataset={"source": str(tmp_path / "data.txt")})
        assert "must be one of" in _refused(client, auth, body)["dataset.source"]


class TestLocalSources:
    """A local source is a path that resolves, every link followed, inside the allowed roots
    (and, for a folder, so does every file in it); anything else is a hub id by the hub's
    rule. Issue 20: `.`, `..` and `~` slipped through, links inside a folder were not
    re-checked, and the messages told whether any path on the machine existed."""

    def test_outside_the_roots_the_answer_never_says_whether_a_path_exists(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, tmp_path_factory: Any
    ) -> None:
        outside = tmp_path_factory.mktemp("outside")
        (outside / "exists.jsonl").write_text('{"text": "x"}\n')
        answers = set()
        for name in ("exists.jsonl", "missing.jsonl", "missing/deeper.jsonl"):
            source = str(outside / name)
            message = _refused(client, auth, run_request(tmp_path, dataset={"source": source}))
            assert "outside the allowed roots" in message["dataset.source"]
            answers.add(message["dataset.source"].replace(source, "<path>"))
        assert len(answers) == 1, answers
        # /etc/passwd and a path that does not exist get the same answer too.
        for source in ("/etc/passwd", "/etc/no-such-file.jsonl", "/proc/1/environ"):
            message = _refused(client, auth, run_request(tmp_path, model=source))["model"]
            assert "outside the allowed roots" in message and "exist" not in message

    def test_inside_the_roots_a_missing_path_is_named(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, dataset={"source": str(tmp_path / "nope.jsonl")})
        assert "does not exist" in _refused(client, auth, body)["dataset.source"]

    @pytest.mark.parametrize("what", ["dataset", "model"])
    def test_a_link_inside_a_folder_cannot_leave_the_roots(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        tmp_path_factory: Any,
        what: str,
    ) -> None:
        secret = tmp_path_factory.mktemp("secret")
        (secret / "private.jsonl").write_text('{"text": "private"}\n')
        folder = tmp_path / "folder"
        if what == "model":
            folder = _model_with_config(tmp_path, model_type="gpt2")
            (folder / "tokenizer.json").symlink_to(secret / "private.jsonl")
            body = run_request(tmp_path, model=str(folder))
            field = "model"
        else:
            (folder / "nested").mkdir(parents=True)
            (folder / "train.jsonl").write_text('{"text": "a b"}\n')
            (folder / "nested" / "more.jsonl").symlink_to(secret / "private.jsonl")
            body = run_request(tmp_path, dataset={"source": str(folder)})
            field = "dataset.source"
        message = _refused(client, auth, body)[field]
        assert "leads outside the allowed roots" in message

    def test_a_link_cycle_in_a_folder_ends_the_walk(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        folder = tmp_path / "cyclic"
        folder.mkdir()
        (folder / "train.jsonl").write_text('{"text": "a b"}\n')
        (folder / "again").symlink_to(folder)
        body = run_request(tmp_path, dataset={"source": str(folder)})
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 201, response.text

    def test_a_huge_folder_is_refused_rather_than_walked(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        from app.services.rules import path_rules

        monkeypatch.setattr(path_rules, "MAX_FOLDER_ENTRIES", 3)
        folder = tmp_path / "many"
        folder.mkdir()
        for i in range(4):
            (folder / f"part-{i}.jsonl").write_text('{"text": "a b"}\n')
        body = run_request(tmp_path, dataset={"source": str(folder)})
        assert "more than 3 files" in _refused(client, auth, body)["dataset.source"]

    @pytest.mark.parametrize("source", [".", "..", "a/..", "../../.."])
    def test_dot_folders_are_not_hub_ids(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        source: str,
    ) -> None:
        # As hub ids they loaded from the worker's working directory, out of every root.
        monkeypatch.chdir(tmp_path / "home")
        problems = _refused(client, auth, run_request(tmp_path, model=source))
        assert any(word in problems["model"] for word in ("neither a local path", "outside"))

    @pytest.mark.parametrize("field", ["model", "dataset.source"])
    def test_home_folders_are_refused_not_expanded(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, field: str
    ) -> None:
        value = "~/model" if field == "model" else "~/data.jsonl"
        body = (
            run_request(tmp_path, model=value)
            if field == "model"
            else run_request(tmp_path, dataset={"source": value})
        )
        assert "home folders are not expanded" in _refused(client, auth, body)[field]

    @pytest.mark.parametrize(
        "path",
        [
            "d" * 256,  # one component past NAME_MAX: ENAMETOOLONG from the OS
            "/".join(["d" * 255] * 17),  # past PATH_MAX
            "da\x00ta.jsonl",  # an embedded NUL: ValueError from the OS call
        ],
    )
    @pytest.mark.parametrize("field", ["model", "dataset.source"])
    def test_paths_the_os_refuses_are_422_naming_the_field(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, path: str, field: str
    ) -> None:
        value = f"{tmp_path}/{path}"
        body = (
            run_request(tmp_path, model=value)
            if field == "model"
            else run_request(tmp_path, dataset={"source": value})
        )
        assert field in _refused(client, auth, body)
