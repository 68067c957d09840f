"""Method grpo in the run request: what the service accepts, its defaults as stored, and
the 422s that name the field and the rule before any compute, with nothing stored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.services.rules.run_rules import completion_room_problem
from app.settings import Settings
from app.storage.models import Run
from contract.run_request import RunRequest
from tests.app.worker_calls import run_location
from tests.factories import run_request

ANSWER_CHECK = {
    "type": "string_check",
    "name": "answer",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "ilike",
}


def _prompts(root: Path, *records: dict[str, Any]) -> Path:
    path = root / "prompts.jsonl"
    rows = records or (
        {"prompt": "2+2=", "answer": "4"},
        {"prompt": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris"},
    )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# The prompts above mix text and chat messages, and the factory's model has no chat
# template of its own: the request gives one.
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


def _grpo(root: Path, *, source: Path | None = None, **method: Any) -> dict[str, Any]:
    return run_request(
        root,
        dataset={
            "source": str(source or _prompts(root)),
            "format": "prompt",
            "chat_template": TEMPLATE,
        },
        method={"type": "grpo", "grader": ANSWER_CHECK, **method},
        training={"max_steps": 2, "learning_rate": 1e-5, "batch_size_per_worker": 1},
    )


def _problems(client: TestClient, auth: dict[str, str], body: dict[str, Any]) -> dict[str, str]:
    r = client.post("/v1/runs/validate", json=body, headers=auth)
    assert r.status_code == 200, r.text
    return {e["field"]: e["message"] for e in r.json()["errors"]}


def _refused(
    client: TestClient,
    auth: dict[str, str],
    body: dict[str, Any],
    session_factory: sessionmaker[Session],
) -> dict[str, str]:
    r = client.post("/v1/runs", json=body, headers=auth)
    assert r.status_code == 422, r.text
    with session_factory() as session:
        assert session.scalar(select(func.count()).select_from(Run)) == 0
    return {e["field"]: e["message"] for e in r.json()["detail"]}


def test_a_grpo_run_with_only_its_grader_is_stored_with_trls_defaults(
    client: TestClient, auth: dict[str, str], tmp_path: Path
) -> None:
    r = client.post("/v1/runs", json=_grpo(tmp_path), headers=auth)
    assert r.status_code == 201, r.text
    method = r.json()["spec"]["method"]
    assert method == {
        "type": "grpo",
        "grader": ANSWER_CHECK,
        "num_generations": 8,
        "max_completion_tokens": 256,
        "temperature": 1.0,
        "beta": 0.0,
        "epsilon": 0.2,
        "epsilon_high": None,
        "loss_type": "dapo",
    }


class TestCombinations:
    def test_grpo_needs_prompt_data(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = run_request(tmp_path, method={"type": "grpo", "grader": ANSWER_CHECK})
        fields = _refused(client, auth, body, session_factory)
        assert "needs dataset.format 'prompt'" in fields["method.type"]

    def test_prompt_data_needs_grpo(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(
            tmp_path, dataset={"source": str(_prompts(tmp_path)), "format": "prompt"}
        )
        assert "grpo" in _problems(client, auth, body)["dataset.format"]

    def test_grpo_does_not_pack(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = _grpo(tmp_path)
        body["training"]["packing"] = True
        assert "prompt" in _problems(client, auth, body)["training.packing"]

    def test_grpo_with_autotp_is_refused_with_the_reason(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = _grpo(tmp_path)
        body["deepspeed"] = {"zero_stage": 1, "tensor_parallel_size": 2}
        assert "AutoTP" in _problems(client, auth, body)["deepspeed.tensor_parallel_size"]

    @pytest.mark.parametrize(
        ("method", "field"),
        [
            ({"num_generations": 1}, "method.grpo.num_generations"),
            ({"epsilon": 1.5}, "method.grpo.epsilon"),
            ({"temperature": 0}, "method.grpo.temperature"),
            ({"loss_type": "bnpo"}, "method.grpo.loss_type"),
            ({"grader": {**ANSWER_CHECK, "operation": "matches"}}, "method.grpo.grader"),
        ],
    )
    def test_a_bad_setting_is_a_422_naming_it(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
        method: dict[str, Any],
        field: str,
    ) -> None:
        fields = _refused(client, auth, _grpo(tmp_path, **method), session_factory)
        assert any(name.startswith(field) for name in fields), fields


class TestGraders:
    def test_a_grader_reading_a_field_the_records_lack_is_a_422(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        grader = {**ANSWER_CHECK, "reference": "{{item.solution}}"}
        r = client.post("/v1/runs", json=_grpo(tmp_path, grader=grader), headers=auth)
        assert r.status_code == 422, r.text
        messages = [e["message"] for e in r.json()["detail"] if e["field"] == "dataset.source"]
        assert any("line 1" in m and "{{item.solution}}" in m for m in messages), messages

    def test_a_null_is_an_absent_field_and_a_path_may_index_a_list(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        # The worker reads records through Arrow, which fills a field some lack with null;
        # the grader follows list indices ({{item.answers.0}}) as keys.
        grader = {**ANSWER_CHECK, "reference": "{{item.answers.0}}"}
        rows = [{"prompt": "2+2=", "answers": ["4", "four"]}, {"prompt": "1+1=", "answers": None}]
        body = _grpo(tmp_path, grader=grader)
        body["dataset"]["source"] = str(_prompts(tmp_path, *rows))
        message = _problems(client, auth, body)["dataset.source"]
        assert "line 2: record's field 'answers' is null (which counts as absent)" in message
        assert "line 1" not in message
        body["dataset"]["source"] = str(_prompts(tmp_path, rows[0]))
        assert _problems(client, auth, body) == {}

    def test_a_grader_reading_a_field_an_upload_lacks_is_a_422_on_the_grader(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        data = _prompts(tmp_path).read_bytes()
        up = client.post(
            "/v1/files",
            files={"file": ("p.jsonl", data)},
            data={"purpose": "prompt"},
            headers=auth,
        )
        assert up.status_code == 201, up.text
        body = _grpo(tmp_path, grader={**ANSWER_CHECK, "reference": "{{item.solution.text}}"})
        body["dataset"]["source"] = up.json()["id"]
        fields = _refused(client, auth, body, session_factory)
        assert "'solution'" in fields["method.grpo.grader"]

    def test_an_upload_whose_some_records_lack_a_field_the_grader_reads_is_a_422_by_line(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = _grpo(tmp_path)
        # Its fields (all records together) have `answer`; record 2 lacks it.
        lacking = _prompts(tmp_path, {"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="})
        body["dataset"]["source"] = _upload(client, auth, lacking)
        fields = _refused(client, auth, body, session_factory)
        message = fields["dataset.source"]
        assert "line 2: record has no field 'answer'" in message, message
        assert body["dataset"]["source"] in message
        assert "checked here" not in message  # the whole file was read

    def test_an_uploads_records_are_read_as_far_as_a_local_files_and_the_bound_is_said(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        rows = [{"prompt": f"{n}+{n}=", "answer": str(2 * n)} for n in range(1_200)]
        rows[2] = {"prompt": "2+2="}
        body = _grpo(tmp_path)
        body["dataset"]["source"] = _upload(client, auth, _prompts(tmp_path, *rows))
        message = _refused(client, auth, body, session_factory)["dataset.source"]
        assert "line 3: record has no field 'answer'" in message, message
        assert "the first 1,000 of its 1,200 records were checked here" in message

    def test_python_graders_are_refused_where_the_operator_left_them_off(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        python = {"type": "python", "name": "p", "source": "def grade(s, i):\n    return 1.0\n"}
        multi = {
            "type": "multi",
            "name": "m",
            "graders": {"a": ANSWER_CHECK, "code": python},
            "calculate_output": "a + code",
        }
        fields = _refused(client, auth, _grpo(tmp_path, grader=multi), session_factory)
        assert "TUNEYARD_PYTHON_GRADERS" in fields["method.grpo.grader.graders.code.type"]


def _judge_folder(folder: Path, *, chat_template: bool = True) -> Path:
    """What the service reads of a judge: its config.json and its tokenizer's template."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if chat_template:
        template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


def _loaded(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def _judged(model: str) -> dict[str, Any]:
    """A multi grader: a judge beside a string check."""
    judge = {
        "type": "score_model",
        "name": "judge",
        "model": model,
        "input": [
            {"role": "system", "content": "Answer with a score from 0 to 1."},
            {"role": "user", "content": "Expected {{item.answer}}; got {{sample.output_text}}"},
        ],
        "range": [0, 1],
        "sampling_params": {"temperature": 0, "max_completions_tokens": 16},
    }
    return {
        "type": "multi",
        "name": "judged",
        "graders": {"judge": judge, "answer": ANSWER_CHECK},
        "calculate_output": "0.5 * judge + 0.5 * answer",
    }


class TestScoreModelGraders:
    """A score_model grader's model is checked as the run's `model` is, by its field."""

    JUDGE_MODEL = "method.grpo.grader.graders.judge.model"

    def test_a_local_judge_is_stored_as_its_real_path(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        folder = _judge_folder(tmp_path / "judge")
        (tmp_path / "link").symlink_to(folder)
        r = client.post(
            "/v1/runs", json=_grpo(tmp_path, grader=_judged(str(tmp_path / "link"))), headers=auth
        )
        assert r.status_code == 201, r.text
        stored = r.json()["spec"]["method"]["grader"]["graders"]
        assert stored["judge"]["model"] == str(folder)
        assert stored["answer"] == ANSWER_CHECK

    def test_a_hub_judge_alone_is_accepted(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        judge = _judged("Qwen/Qwen2.5-0.5B-Instruct")["graders"]["judge"]
        r = client.post("/v1/runs", json=_grpo(tmp_path, grader=judge), headers=auth)
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["method"]["grader"]["model"] == "Qwen/Qwen2.5-0.5B-Instruct"

    def test_an_earlier_runs_export_can_judge(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, worker = started
        export = Path(run_location(settings, run_id, "export"))
        _judge_folder(export)
        checkpoint = {"attempt": 1, "step": 5, "path": str(export), "kind": "hf"}
        r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=checkpoint, headers=worker)
        assert r.status_code == 200, r.text
        r = client.post("/v1/runs", json=_grpo(tmp_path, grader=_judged(run_id)), headers=auth)
        assert r.status_code == 201, r.text
        judge = r.json()["spec"]["method"]["grader"]["graders"]["judge"]
        assert judge["model"] == str(export)

    def test_validate_counts_the_judges_weights_on_each_worker(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        from contract.graders.score_model import BATCH_TOKENS
        from tests.worker.judges import build_chat_judge

        judge = build_chat_judge(tmp_path / "judge")
        body = _grpo(tmp_path, grader=_judged(str(judge)), max_completion_tokens=16)
        body["model"] = str(tiny_model_dir)
        r = client.post("/v1/runs/validate", json=body, headers=auth)
        assert r.status_code == 200 and r.json()["valid"], r.text
        memory = r.json()["estimate"]["memory_per_worker"]
        # The tiny Llama: 2 layers, 2 key/value heads of 16; fp32 on CPU.
        config = json.loads((judge / "config.json").read_text())
        parameters = sum(p.numel() for p in _loaded(judge).parameters())
        kv = config["num_key_value_heads"] * config["hidden_size"] // config["num_attention_heads"]
        expected = 4 * (parameters + BATCH_TOKENS * config["num_hidden_layers"] * 2 * kv)
        assert memory["lines"]["judge_models"] == {"device": 0, "host": expected}
        assert str(judge) in memory["formulas"]["judge_models"]

    @pytest.mark.parametrize(
        ("model", "words"),
        [
            ("{tmp}/missing", "does not exist"),
            ("/outside/the/roots", "outside the allowed roots"),
            ("{tmp}/judge-without-template", "no chat template"),
            ("https://example.com/judge", "tuneyard never fetches URLs"),
            ("gpt-4o-mini-2024-07-18", "OpenAI's models"),
            ("run_" + "0" * 20, "no run"),
        ],
        ids=["missing", "outside-roots", "no-chat-template", "url", "openai-model", "no-run"],
    )
    def test_a_judge_the_cluster_cannot_load_is_refused_naming_its_field(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
        model: str,
        words: str,
    ) -> None:
        _judge_folder(tmp_path / "judge-without-template", chat_template=False)
        body = _grpo(tmp_path, grader=_judged(model.format(tmp=tmp_path)))
        fields = _refused(client, auth, body, session_factory)
        assert words in fields[self.JUDGE_MODEL], fields
        assert list(fields) == [self.JUDGE_MODEL]


def _upload(client: TestClient, auth: dict[str, str], path: Path) -> str:
    r = client.post(
        "/v1/files",
        files={"file": (path.name, path.read_bytes())},
        data={"purpose": "prompt"},
        headers=auth,
    )
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


class TestPositions:
    def test_prompts_of_seq_length_and_completions_must_fit_together(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        body = _grpo(tmp_path, max_completion_tokens=120)  # with seq_length 32
        body["model"] = str(tiny_model_dir)  # 128 positions
        message = _problems(client, auth, body)["method.grpo.max_completion_tokens"]
        assert "prompts of up to 32 tokens (training.seq_length)" in message, message
        assert "maximum positions (128)" in message
        assert "at most 96 completion tokens fit with prompts of 32" in message
        assert "prompts of at most 8 tokens fit with it" in message
        body["method"]["max_completion_tokens"] = 64
        assert _problems(client, auth, body) == {}

    def test_a_default_request_is_told_what_fits_without_a_seq_length_it_never_set(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        tiny_model_dir: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = _grpo(tmp_path)  # max_completion_tokens 256, TRL's default
        body["model"] = str(tiny_model_dir)
        del body["training"]["seq_length"]
        fields = _refused(client, auth, body, session_factory)
        message = fields["method.grpo.max_completion_tokens"]
        assert message.startswith(
            "max_completion_tokens (256) leaves no room for a prompt in the model's maximum "
            "positions (128)"
        ), message
        assert "at most 126 completion tokens fit, and those with prompts of 2 tokens" in message
        assert "seq_length" not in message

    def test_an_unset_seq_length_leaves_prompts_the_shortest_length_the_worker_chooses(
        self, tmp_path: Path
    ) -> None:
        # The worker refuses fewer than 2 positions for the prompts (worker/data/preparation.py).
        def problem(tokens: int, seq_length: int | None = None) -> Any:
            body = _grpo(tmp_path, max_completion_tokens=tokens)
            body["training"]["seq_length"] = seq_length
            return completion_room_problem(RunRequest.model_validate(body), 128)

        assert problem(126) is None
        assert problem(127)["field"] == "method.grpo.max_completion_tokens"
        assert problem(96, seq_length=32) is None
        assert "at most 96" in problem(97, seq_length=32)["message"]
        too_long = problem(8, seq_length=128)
        assert too_long["field"] == "training.seq_length"
        assert "prompts of at most 120 tokens fit" in too_long["message"]


class TestChatTemplates:
    """Prompts given as chat messages are rendered with a chat template, as chat data is:
    the request's, or the model's own. Text prompts need none."""

    def test_prompts_as_messages_on_a_model_without_a_template_are_refused_by_create(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = _grpo(tmp_path)
        del body["dataset"]["chat_template"], body["training"]["seq_length"]
        fields = _refused(client, auth, body, session_factory)
        message = fields["dataset.chat_template"]
        assert message.startswith(
            "line 2 of prompts.jsonl gives its prompt (dataset.prompt_field 'prompt') as chat "
            "messages, which format 'prompt' renders with a chat template"
        ), message
        assert "has none: give dataset.chat_template" in message
        assert list(fields) == ["dataset.chat_template"]
        assert _problems(client, auth, body) == fields  # validate says the same

    def test_an_uploads_prompts_as_messages_are_refused_alike(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = _grpo(tmp_path, grader={**ANSWER_CHECK, "reference": "Paris"})  # reads no field
        del body["dataset"]["chat_template"]
        file_id = _upload(client, auth, _prompts(tmp_path))
        body["dataset"]["source"] = file_id
        message = _refused(client, auth, body, session_factory)["dataset.chat_template"]
        assert f"line 2 of uploaded file {file_id} gives its prompt" in message, message

    def test_text_prompts_need_no_template(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = _grpo(tmp_path, source=_prompts(tmp_path, {"prompt": "2+2=", "answer": "4"}))
        del body["dataset"]["chat_template"]
        r = client.post("/v1/runs", json=body, headers=auth)
        assert r.status_code == 201, r.text

    def test_the_models_own_template_will_do(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = _grpo(tmp_path)
        del body["dataset"]["chat_template"]
        (tmp_path / "model" / "chat_template.jinja").write_text(TEMPLATE)
        r = client.post("/v1/runs", json=body, headers=auth)
        assert r.status_code == 201, r.text


def test_an_upload_for_prompts_is_checked_line_by_line(
    client: TestClient, auth: dict[str, str]
) -> None:
    bad = json.dumps({"prompt": [{"role": "assistant", "content": "hi"}]}) + "\n"
    r = client.post(
        "/v1/files",
        files={"file": ("p.jsonl", bad.encode())},
        data={"purpose": "prompt"},
        headers=auth,
    )
    assert r.status_code == 422, r.text
    assert "ends with the user turn that the completions reply to" in r.text
