"""contract/run_request.py: the one definition of a run, read by the service and the worker."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from contract.job_env import SPEC_ENV
from contract.run_request import DatasetSpec, RunRequest, RunSpec


def _request(**overrides: Any) -> dict[str, Any]:
    return {"model": "/models/m", "dataset": {"source": "/data/d.jsonl"}, **overrides}


def _spec(**overrides: Any) -> RunSpec:
    return RunSpec.for_attempt(
        RunRequest.model_validate(_request(**overrides)).worker_fields(),
        run_id="run_x",
        attempt=2,
        storage_path="/srv/storage",
    )


class TestWhatTheWorkerReceives:
    def test_the_stored_request_plus_its_attempt_round_trips_through_json(self) -> None:
        spec = _spec(training={"max_steps": 5, "learning_rate": 3e-4}, deepspeed={"zero_stage": 2})
        again = RunSpec.model_validate_json(spec.model_dump_json())
        assert again == spec
        assert (again.run_id, again.attempt, again.storage_path) == ("run_x", 2, "/srv/storage")
        assert again.training.max_steps == 5

    def test_metadata_stays_with_the_service(self) -> None:
        request = RunRequest.model_validate(_request(metadata={"team": "a"}))
        assert "metadata" not in request.worker_fields()

    def test_from_env_reads_the_spec(self, monkeypatch: pytest.MonkeyPatch) -> None:
        spec = _spec()
        monkeypatch.setenv(SPEC_ENV, spec.model_dump_json())
        assert RunSpec.from_env() == spec

    def test_from_env_without_the_variable_names_it(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(SPEC_ENV, raising=False)
        with pytest.raises(RuntimeError, match=SPEC_ENV):
            RunSpec.from_env()

    def test_a_spec_without_its_attempt_is_refused(self) -> None:
        with pytest.raises(ValidationError, match="run_id"):
            RunSpec.model_validate({"model": "/m", "dataset": {"source": "/d"}})

    def test_data_parallel_size_divides_workers_by_tensor_parallel(self) -> None:
        spec = _spec(resources={"num_workers": 8}, deepspeed={"tensor_parallel_size": 2})
        assert spec.data_parallel_size == 4


GRADER = {
    "type": "string_check",
    "name": "answer",
    "operation": "eq",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
}


class TestTheMetricThatRanksCheckpoints:
    """Unnamed, it is the method's first evaluation metric: a grpo run has eval_reward and
    no eval_loss (its export from the best checkpoint once failed at the first evaluation,
    asking for eval_loss)."""

    def test_export_from_best_ranks_by_eval_loss_or_a_grpo_runs_eval_reward(self) -> None:
        best = {"export": {"from": "best"}}
        assert _spec(**best).best_criterion == ("eval_loss", "min")
        grpo = {"method": {"type": "grpo", "grader": GRADER}}
        assert _spec(**best, **grpo).best_criterion == ("eval_reward", "max")
        assert _spec(**grpo).best_criterion is None

    def test_early_stopping_watches_the_same_unless_named(self) -> None:
        grpo = {"method": {"type": "grpo", "grader": GRADER}}
        spec = _spec(early_stopping={"patience": 2}, **grpo)
        assert spec.early_stopping is not None
        assert (spec.early_stopping.metric, spec.early_stopping.resolved_mode) == (
            "eval_reward",
            "max",
        )
        assert spec.best_criterion == ("eval_reward", "max")
        # Stored and read back (the worker's copy), it stays what it resolved to.
        assert RunSpec.model_validate_json(spec.model_dump_json()) == spec
        named = _spec(early_stopping={"metric": "eval_loss"}, **grpo)
        assert named.early_stopping is not None and named.early_stopping.metric == "eval_loss"
        assert _spec(early_stopping={}).early_stopping.metric == "eval_loss"  # type: ignore[union-attr]


class TestFaultToleranceBudgets:
    def test_both_budgets_have_defaults(self) -> None:
        budgets = RunRequest.model_validate(_request()).fault_tolerance
        assert (budgets.max_failures, budgets.max_resubmits) == (1, 1)

    def test_max_failures_is_still_accepted_as_the_in_job_budget(self) -> None:
        budgets = RunRequest.model_validate(
            _request(fault_tolerance={"max_failures": 3})
        ).fault_tolerance
        assert (budgets.max_failures, budgets.max_resubmits) == (3, 1)

    def test_the_stored_specs_of_older_runs_still_load(self) -> None:
        old = RunRequest.model_validate(_request()).worker_fields()
        old["fault_tolerance"] = {"max_failures": 2}
        assert RunRequest.model_validate(old).fault_tolerance.max_resubmits == 1


class TestRefused:
    @pytest.mark.parametrize(
        "body",
        [
            _request(learning_rat=0.1),
            _request(dataset={"source": "/d.jsonl", "txt_field": "body"}),
            _request(deepspeed={"zero_stage": 4}),
            _request(training={"epochs": None}),
        ],
    )
    def test_unknown_or_out_of_range_fields(self, body: dict[str, Any]) -> None:
        with pytest.raises(ValidationError):
            RunRequest.model_validate(body)

    @pytest.mark.parametrize(("epochs", "max_steps"), [(None, 10), (2, None), (2, 10)])
    def test_either_length_is_enough(self, epochs: int | None, max_steps: int | None) -> None:
        training = RunRequest.model_validate(
            _request(training={"epochs": epochs, "max_steps": max_steps})
        ).training
        assert (training.epochs, training.max_steps) == (epochs, max_steps)

    @pytest.mark.parametrize("gpus", [0.5, 1.5, 0.25])
    def test_a_fraction_of_a_gpu_is_refused_with_the_reason(self, gpus: float) -> None:
        with pytest.raises(ValidationError) as caught:
            RunRequest.model_validate(
                _request(resources={"use_gpu": True, "gpus_per_worker": gpus})
            )
        (error,) = caught.value.errors()
        assert error["loc"] == ("resources", "gpus_per_worker")
        assert "whole number" in error["msg"] and "two ranks on one device" in error["msg"]

    @pytest.mark.parametrize(("given", "kept"), [(1, 1), (2.0, 2), (8, 8)])
    def test_whole_gpus_are_accepted(self, given: float, kept: int) -> None:
        resources = RunRequest.model_validate(
            _request(resources={"use_gpu": True, "gpus_per_worker": given})
        ).resources
        assert resources.gpus_per_worker == kept and isinstance(resources.gpus_per_worker, int)

    def test_zero_gpus_and_zero_threads_are_refused(self) -> None:
        for resources in ({"gpus_per_worker": 0}, {"cpu_threads_per_worker": 0}):
            with pytest.raises(ValidationError):
                RunRequest.model_validate(_request(resources=resources))


def test_the_contract_imports_neither_torch_nor_the_service() -> None:
    """It ships to the cluster without the service, and validation must not load torch."""
    code = (
        "import sys, contract.run_request, contract.datasets, contract.steps, contract.job_env;"
        "print(sorted(m for m in ('torch', 'app', 'worker', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.replace("'", '"')) == []


def _refused_at(body: dict[str, Any]) -> dict[str, str]:
    """{dotted field: message} of a body the schema refuses."""
    with pytest.raises(ValidationError) as caught:
        RunRequest.model_validate(body)
    return {".".join(map(str, e["loc"])): e["msg"] for e in caught.value.errors()}


# Every string field but the sources, which have a rule of their own (below).
_NAMES = [
    ("dataset", "split"),
    ("dataset", "config"),
    ("dataset", "text_field"),
    ("dataset", "text_pair_field"),
    ("dataset", "label_field"),
    ("dataset", "prompt_field"),
    ("dataset", "completion_field"),
    ("dataset", "eval_split"),
]


def _with(group: str, name: str, value: Any) -> dict[str, Any]:
    base = _request()
    if group == "dataset":
        return {**base, "dataset": {**base["dataset"], name: value}}
    return {**base, group: {name: value}}


class TestBounds:
    """Issue 20: a 40 MiB `model` was stored, a NUL made PostgreSQL fail, and integers past
    2**31 overflowed the INTEGER columns. Every string and number has a bound now."""

    def test_a_40_mib_model_is_refused_without_echoing_it(self) -> None:
        problems = _refused_at(_request(model="/m" + "x" * (40 << 20)))
        assert problems == {"model": "String should have at most 4095 characters"}

    def test_a_long_hub_id_is_refused_by_the_hubs_rule(self) -> None:
        assert "maximum length is 96" in _refused_at(_request(model="a" * 97))["model"]

    @pytest.mark.parametrize(("group", "name"), _NAMES)
    def test_every_name_is_bounded(self, group: str, name: str) -> None:
        problems = _refused_at(_with(group, name, "x" * 257))
        assert problems == {f"{group}.{name}": "String should have at most 256 characters"}
        RunRequest.model_validate(_with(group, name, "x" * 256))

    @pytest.mark.parametrize(("group", "name"), [*_NAMES, ("dataset", "source"), ("", "model")])
    @pytest.mark.parametrize("bad", ["a\x00b", "a\nb", "a\tb", "\x7f"])
    def test_no_string_holds_nul_or_control_characters(
        self, group: str, name: str, bad: str
    ) -> None:
        body = _with(group, name, bad) if group else _request(**{name: bad})
        field = f"{group}.{name}" if group else name
        message = _refused_at(body)[field]
        assert "NUL" in message or "control characters" in message

    def test_metadata_keys_and_values_refuse_nul(self) -> None:
        assert "NUL" in " ".join(_refused_at(_request(metadata={"team": "a\x00"})).values())
        assert "NUL" in " ".join(_refused_at(_request(metadata={"te\x00am": "a"})).values())
        assert "metadata.team" in _refused_at(_request(metadata={"team": "\ud800"}))

    def test_metadata_keys_may_be_any_printable_text(self) -> None:
        keys = {"it's": "1", "clé": "é", 'a"b': "x", "日本": "y", "a b.c": "z"}
        assert RunRequest.model_validate(_request(metadata=keys)).metadata == keys

    @pytest.mark.parametrize(
        ("group", "name", "too_big"),
        [
            ("training", "max_steps", 100_000_001),
            ("training", "epochs", 1_001),
            ("training", "warmup_steps", 100_000_001),
            ("training", "seed", 2**31),
            ("training", "log_every_n_steps", 100_000_001),
            ("training", "eval_every_n_steps", 100_000_001),
            ("training", "weight_decay", 1.5),
            ("training", "max_grad_norm", 1e9),
            ("dataset", "max_samples", 2**31),
            ("checkpointing", "every_n_steps", 100_000_001),
            ("checkpointing", "keep_last", 1_001),
            ("deepspeed", "tensor_parallel_size", 1_025),
            ("resources", "cpus_per_worker", 1e9),
            ("resources", "gpus_per_worker", 65),
        ],
    )
    @pytest.mark.parametrize("scale", [1, 2**32, 10**30])
    def test_every_number_has_a_ceiling_below_the_databases_integer(
        self, group: str, name: str, too_big: float, scale: int
    ) -> None:
        value = too_big * scale
        body = _with(group, name, value)
        if group == "resources":
            body["resources"]["use_gpu"] = True
        assert f"{group}.{name}" in _refused_at(body)

    def test_the_ceilings_are_themselves_accepted(self) -> None:
        request = RunRequest.model_validate(
            _request(
                training={"max_steps": 100_000_000, "warmup_steps": 100_000_000, "seed": 2**31 - 1},
                dataset={"source": "/d.jsonl", "max_samples": 2**31 - 1},
                checkpointing={"keep_last": 1_000, "every_n_steps": 100_000_000},
            )
        )
        assert request.training.seed == 2**31 - 1


class TestSources:
    """A source is a local path (absolute, or ./ or ../) or a hub id by the hub's own rule."""

    @pytest.mark.parametrize(
        "model", ["gpt2", "openai-community/gpt2", "Qwen/Qwen2.5-0.5B", "/models/m", "./m", "../m"]
    )
    def test_hub_ids_and_paths(self, model: str) -> None:
        assert RunRequest.model_validate(_request(model=model)).model == model

    @pytest.mark.parametrize(
        "model", [".", "..", "a/../b", "a/b/c", "-gpt2", "gpt2.", "a--b", "m.git", "gpt 2", "é"]
    )
    def test_what_is_neither_is_refused_with_the_hubs_rule(self, model: str) -> None:
        message = _refused_at(_request(model=model))["model"]
        assert "neither a local path" in message and "hub id" in message

    @pytest.mark.parametrize("field", ["model", "dataset.source"])
    @pytest.mark.parametrize("home", ["~/models/m", "~root/.ssh"])
    def test_home_folders_are_refused(self, field: str, home: str) -> None:
        body = _request(model=home) if field == "model" else _request(dataset={"source": home})
        assert "home folders are not expanded" in _refused_at(body)[field]

    def test_a_path_component_longer_than_the_os_allows_is_refused(self) -> None:
        message = _refused_at(_request(dataset={"source": "/data/" + "d" * 256}))["dataset.source"]
        assert "at most 255 bytes" in message
        # Counted in bytes, as the OS counts: 128 two-byte characters are 256 bytes.
        assert "dataset.source" in _refused_at(_request(dataset={"source": "/" + "é" * 128}))


SPLITS = [
    "train",
    "train_sft",
    "a.b",
    "train[:1000]",
    "train[:1_000]",
    "train[-5:]",
    "train[:]",
    "train[10%:20%]",
    "train[-10%:]",
    "train[:10%](closest)",
    "train[:10%](pct1_dropremainder)",
    "train+test",
    "train[:5] + test[2:]",
    "validation[:50%]+validation[60%:]",
    "train[abc]",
    "train[",
    "train[:5](closest)",
    "train[:10%](nearest)",
    "test-clean",
    "train+",
    "train[200%:]",
    "train[-100%:100%]",
    "train[_:5]",
    "train[:1__0]",
]


@pytest.mark.parametrize("split", SPLITS)
def test_a_split_is_read_as_the_datasets_library_reads_it(split: str) -> None:
    """dataset.split and eval_split are refused at the request exactly where `datasets`
    (which the worker loads with) would refuse them on the cluster."""
    from datasets import ReadInstruction

    from contract.run_request import split_problem

    try:
        ReadInstruction.from_spec(split)
        readable = True
    except (ValueError, AssertionError):
        readable = False
    assert (split_problem(split) is None) is readable
    if not readable:
        for field in ("split", "eval_split"):
            with pytest.raises(ValidationError, match=field):
                DatasetSpec.model_validate({"source": "ag_news", field: split})


def test_a_stored_runs_split_stays_readable_under_the_rule() -> None:
    """A run stored before the split rule (or a tighter one) still loads: its queue, its
    resume and every read of it go through its stored spec; a new request is refused."""
    request = {"model": "gpt2", "dataset": {"source": "librispeech", "split": "test-clean"}}
    stored = {**request, "run_id": "run_old", "attempt": 1, "storage_path": "/s"}
    assert RunSpec.model_validate(stored).dataset.split == "test-clean"
    assert RunSpec.for_attempt(request, run_id="run_old", attempt=2, storage_path="/s")
    with pytest.raises(ValidationError, match=r"dataset\.split"):
        RunRequest.model_validate(request)
