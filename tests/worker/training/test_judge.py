"""score_model graders' judges on the training rank (worker/training/judge.py): real tiny models,
loaded, prompted with their chat template and generating; a rigged one whose answer is
known, so that a reward can be traced to it through grading and a GRPO step."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import TypeAdapter

from app.ports import free_port
from contract.graders.models import Grader, ScoreModelGrader
from contract.run_request import RunSpec
from tests.worker.judges import NEWLINE, build_chat_judge, build_rigged_judge
from tests.worker.one_rank import join_one_rank_group, spawn_ranks

CPU = torch.device("cpu")


def judge_grader(model: Path, **fields: Any) -> dict[str, Any]:
    return {
        "type": "score_model",
        "name": "judge",
        "model": str(model),
        "input": [
            {"role": "developer", "content": "Score the answer from 0 to 1."},
            {"role": "user", "content": "Expected {{item.answer}}; got {{sample.output_text}}"},
        ],
        "sampling_params": {"max_completions_tokens": 8},
        **fields,
    }


def parsed(grader: dict[str, Any]) -> ScoreModelGrader:
    value = TypeAdapter(Grader).validate_python(grader)
    assert isinstance(value, ScoreModelGrader)
    return value


def conversation(answer: str, got: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "Score the answer from 0 to 1."},
        {"role": "user", "content": f"Expected {answer}; got {got}"},
    ]


@pytest.fixture(scope="module")
def rigged_judge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_rigged_judge(tmp_path_factory.mktemp("judges") / "rigged", answer="0.7")


@pytest.fixture(scope="module")
def random_judge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_judge(tmp_path_factory.mktemp("judges") / "random", sharpen=5.0)


class TestAnswers:
    def test_the_judge_reads_its_chat_template_and_answers(self, rigged_judge: Path) -> None:
        from worker.training.judge import Judges, _prompt_ids

        judges = Judges(device=CPU)
        loaded = judges.load(str(rigged_judge))
        ids = _prompt_ids(
            loaded.tokenizer,
            [{"role": "developer", "content": "Be fair."}, *conversation("a", "b")],
        )
        prompt = loaded.tokenizer.decode(ids)
        # OpenAI's developer role is the template's system role.
        assert prompt.startswith("<|im_start|>system\nBe fair.<|im_end|>\n")
        assert prompt.endswith("Expected a; got b<|im_end|>\n<|im_start|>assistant\n")
        assert ids[-1] == loaded.tokenizer.convert_tokens_to_ids(NEWLINE)
        replies = judges.answer(parsed(judge_grader(rigged_judge)), [conversation("4", "5")] * 2)
        assert [r.text for r in replies] == ["0.7", "0.7"]
        assert not any(p.requires_grad for p in loaded.model.parameters())
        assert not loaded.model.training

    def test_batches_answer_as_each_conversation_alone(self, random_judge: Path) -> None:
        """Left padding, its attention mask and positions: a random model's greedy answer
        depends on every prompt token, so a batch that padded wrongly would answer
        otherwise than one conversation at a time."""
        from worker.training.judge import Judges

        grader = parsed(judge_grader(random_judge))
        asked = [
            conversation("Paris", "Lyon"),
            conversation("the Lions beat the Tigers in Oslo", "Rovers"),
            conversation("4", "four"),
            conversation("Acme shares rose 3 percent on Monday", "Acme fell"),
            conversation("up", "down, then up again on Friday"),
        ]
        alone = [Judges(device=CPU).answer(grader, [messages])[0] for messages in asked]
        assert all(reply.text is not None for reply in alone)
        assert len({reply.text for reply in alone}) > 1, "the answers should differ"
        # One batch of every length (each shorter prompt padded), and batches of two or
        # three (about 110 prompt tokens and 8 answer tokens a row).
        assert Judges(device=CPU).answer(grader, asked) == alone
        assert Judges(device=CPU, batch_tokens=400).answer(grader, asked) == alone

    def test_sampling_with_a_seed_repeats_and_leaves_the_policys_generator(
        self, random_judge: Path
    ) -> None:
        from worker.training.judge import Judges

        params = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_completions_tokens": 8}
        grader = parsed(judge_grader(random_judge, sampling_params=params))
        asked = [conversation("Paris", "Lyon")] * 3
        judges = Judges(device=CPU)
        state = torch.random.get_rng_state()
        first = judges.answer(grader, asked)
        assert torch.equal(torch.random.get_rng_state(), state)
        assert judges.answer(grader, asked) == first

    def test_a_prompt_past_the_judges_positions_fails_that_answer_only(
        self, random_judge: Path
    ) -> None:
        from worker.training.judge import Judges

        grader = parsed(judge_grader(random_judge, sampling_params={"max_completions_tokens": 8}))
        long = conversation("Paris " * 600, "Lyon")
        replies = Judges(device=CPU).answer(grader, [conversation("Paris", "Lyon"), long])
        assert replies[0].text is not None
        assert replies[1].text is None
        assert "positions" in (replies[1].error or "")

    def test_a_judge_without_a_chat_template_is_refused_saying_so(
        self, tiny_model_dir: Path
    ) -> None:
        from worker.training.judge import Judges

        with pytest.raises(ValueError, match="no chat template"):
            Judges(device=CPU).load(str(tiny_model_dir))


class TestGrading:
    def test_a_multi_grader_mixes_the_judges_score_with_string_check(
        self, rigged_judge: Path
    ) -> None:
        from worker.training.judge import Judges

        grader = {
            "type": "multi",
            "name": "both",
            "graders": {
                "judge": judge_grader(rigged_judge),
                "exact": {
                    "type": "string_check",
                    "name": "exact",
                    "input": "{{sample.output_text}}",
                    "reference": "{{item.answer}}",
                    "operation": "eq",
                },
            },
            "calculate_output": "judge + exact",
        }
        texts = ["4", "5", "4"]
        items = [{"answer": "4"}, {"answer": "4"}, {}]  # the last lacks what both read
        graded = Judges(device=CPU).grade(grader, texts, items)
        assert graded.rewards[:2] == [pytest.approx(1.7), pytest.approx(0.7)]
        assert math.isnan(graded.rewards[2])
        assert graded.sub_rewards["judge"][:2] == [pytest.approx(0.7)] * 2
        assert graded.sub_rewards["exact"][:2] == [1.0, 0.0]
        assert graded.failures == ["invalid_variable_error"]

    def test_a_judge_whose_answer_has_no_score_fails_the_grade(self, random_judge: Path) -> None:
        from worker.training.judge import Judges

        graded = Judges(device=CPU).grade(
            judge_grader(random_judge), ["Lyon"], [{"answer": "Paris"}]
        )
        # A random model writes no number: OpenAI's parse error, a failed grade here.
        assert math.isnan(graded.rewards[0])
        assert graded.failures == ["model_grader_parse_error"]


PROMPTS = [
    {"prompt": "market price", "answer": "up"},
    {"prompt": "storm city", "answer": "rain"},
    {"prompt": "team season", "answer": "win"},
    {"prompt": "bank vote", "answer": "yes"},
]


def _train(rank: int, spec_json: str, port: int, out: str) -> None:
    """One rank: the worker's own build_training (which makes the judged grading), one grpo
    step and an evaluation, grading as the train loop does."""
    from worker.training.grpo import evaluate_reward, grpo_step
    from worker.training.loop import batches_from, build_training

    join_one_rank_group(port)
    spec = RunSpec.model_validate_json(spec_json)
    training = build_training(spec, rank=0)
    batches = batches_from(training.plan, training.data.train, 0)
    common = {"spec": spec, "device": CPU, "group": None, "generator": training.generator}
    result = grpo_step(
        training.engine, batches, reference=training.reference, grade=training.grade, **common
    )
    evaluation = evaluate_reward(
        training.engine, training.data.eval, grade=training.grade, **common
    )
    metrics = result.sums.metrics(result.sums.values)
    Path(out, "result.json").write_text(json.dumps({"step": metrics, "eval": evaluation}))
    # DeepSpeed's shared-memory comm op aborts the interpreter's normal exit.
    os._exit(0)


def test_a_grpo_step_takes_its_rewards_from_the_judge(
    rigged_judge: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """ZeRO-3: the judge loads whole beside a partitioned policy (transformers would
    otherwise create it inside zero.Init)."""
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    grader = {
        "type": "multi",
        "name": "both",
        "graders": {
            "judge": judge_grader(rigged_judge),
            "exact": {
                "type": "string_check",
                "name": "exact",
                "input": "{{sample.output_text}}",
                "reference": "{{item.answer}}",
                "operation": "eq",
            },
        },
        "calculate_output": "judge + exact",
    }
    spec = RunSpec.model_validate(
        {
            "run_id": "run_judged",
            "attempt": 1,
            "storage_path": "/unused",
            "model": str(tiny_llama_dir),
            "dataset": {"source": str(source), "format": "prompt", "eval_source": str(source)},
            "method": {
                "type": "grpo",
                "grader": grader,
                "num_generations": 2,
                "max_completion_tokens": 4,
            },
            "training": {"max_steps": 1, "learning_rate": 1e-2, "batch_size_per_worker": 2},
            "deepspeed": {"zero_stage": 3, "precision": "fp32"},
            "resources": {"num_workers": 1},
        }
    )
    spawn_ranks(_train, args=(spec.model_dump_json(), free_port(), str(tmp_path)), nprocs=1)
    result = json.loads((tmp_path / "result.json").read_text())
    step = result["step"]
    assert step["grade_failures"] == 0
    assert step["rewards/judge/mean"] == pytest.approx(0.7)
    assert step["reward"] == pytest.approx(0.7 + step["rewards/exact/mean"])
    assert result["eval"]["eval_reward"] >= 0.7 - 1e-6
