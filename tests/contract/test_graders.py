"""Graders as OpenAI's guide defines them: each type on worked examples whose scores follow
from the definitions (worked out by hand here, not read back from the code), the templates,
the formula of a multi grader and the checks that refuse a grader before it is used."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from contract.graders.grading import Grade, Runners, grade
from contract.graders.models import AnyGrader, Grader
from contract.graders.templates import Sample, TemplateError, references, render

GRADER: TypeAdapter[AnyGrader] = TypeAdapter(Grader)


def grader(**fields: Any) -> AnyGrader:
    return GRADER.validate_python({"name": "g", **fields})


def string_check(operation: str, reference: str = "{{item.answer}}") -> AnyGrader:
    return grader(
        type="string_check",
        input="{{sample.output_text}}",
        reference=reference,
        operation=operation,
    )


def similarity(metric: str) -> AnyGrader:
    return grader(
        type="text_similarity",
        input="{{sample.output_text}}",
        reference="{{item.answer}}",
        evaluation_metric=metric,
    )


def refusal(fields: dict[str, Any]) -> tuple[str, str]:
    """(where, message) of the first problem validating `fields` as a grader."""
    with pytest.raises(ValidationError) as raised:
        GRADER.validate_python({"name": "g", **fields})
    first = raised.value.errors()[0]
    return ".".join(str(p) for p in first["loc"]), first["msg"]


class TestStringCheck:
    """1 or 0: eq equal, ne different, like contains, ilike contains ignoring case."""

    @pytest.mark.parametrize(
        ("operation", "sample", "answer", "reward"),
        [
            ("eq", "Paris", "Paris", 1.0),
            ("eq", "paris", "Paris", 0.0),  # case-sensitive
            ("ne", "Lyon", "Paris", 1.0),
            ("ne", "Paris", "Paris", 0.0),
            ("like", "The capital is Paris.", "Paris", 1.0),
            ("like", "The capital is paris.", "Paris", 0.0),
            ("ilike", "THE CAPITAL IS PARIS.", "Paris", 1.0),
            ("ilike", "The capital is Lyon.", "Paris", 0.0),
        ],
    )
    def test_each_operation(self, operation: str, sample: str, answer: str, reward: float) -> None:
        result = grade(string_check(operation), sample, {"answer": answer})
        assert (result.reward, result.errors.any()) == (reward, False)

    def test_a_number_in_the_item_is_compared_as_its_json_text(self) -> None:
        assert grade(string_check("eq"), "42", {"answer": 42}).reward == 1.0

    def test_output_json_reads_a_field_of_a_json_sample(self) -> None:
        check = grader(
            type="string_check",
            input="{{ sample.output_json.label }}",  # spaces inside the braces, as the guide
            reference="{{item.label}}",
            operation="eq",
        )
        assert grade(check, '{"label": "spam", "why": "..."}', {"label": "spam"}).reward == 1.0
        # A sample that is not JSON has no output_json: a sample parse error, reward 0.
        broken = grade(check, "spam", {"label": "spam"})
        assert (broken.reward, broken.errors.sample_parse_error) == (0.0, True)


class TestTextSimilarity:
    def test_identical_texts_score_one_by_every_metric(self) -> None:
        text = "fuzzy wuzzy was a bear"
        for metric in ("fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_l"):
            assert grade(similarity(metric), text, {"answer": text}).reward == 1.0, metric

    def test_rouge_is_the_f_measure_of_overlapping_n_grams(self) -> None:
        # "the cat" against "the cat sat on the mat": unigrams precision 2/2, recall 2/6,
        # F = 2PR/(P+R) = 0.5; bigrams: "the cat" of 1 and of 5, F = 2*1*0.2/1.2 = 1/3.
        item = {"answer": "the cat sat on the mat"}
        assert grade(similarity("rouge_1"), "the cat", item).reward == pytest.approx(0.5)
        assert grade(similarity("rouge_2"), "the cat", item).reward == pytest.approx(1 / 3)
        # Longest common subsequence "the cat": the same as unigrams here.
        assert grade(similarity("rouge_l"), "the cat", item).reward == pytest.approx(0.5)

    def test_disjoint_texts_score_zero(self) -> None:
        for metric in ("bleu", "gleu", "rouge_1", "rouge_l"):
            assert grade(similarity(metric), "alpha beta", {"answer": "gamma delta"}).reward == 0.0

    def test_rouge_l_of_texts_too_long_to_compare_is_an_error(self) -> None:
        words = " ".join(["word"] * 1_001)
        result = grade(similarity("rouge_l"), words, {"answer": words})
        assert (result.reward, result.errors.truncated_observation_error) == (0.0, True)
        # rouge_1 counts words: up to MAX_TOKENS each.
        assert grade(similarity("rouge_1"), words, {"answer": words}).reward == 1.0
        # Tokens as rouge-score splits them, not words: 1,001 hyphenated tokens are one
        # word to str.split() (a reviewer's way past a bound that counted words).
        hyphens = "-".join(["word"] * 1_001)
        result = grade(similarity("rouge_l"), hyphens, {"answer": hyphens})
        assert result.errors.truncated_observation_error

    @pytest.mark.parametrize("metric", ["bleu", "gleu", "rouge_1", "rouge_2", "fuzzy_match"])
    def test_every_metric_has_a_bound_that_keeps_a_grade_short(self, metric: str) -> None:
        """Past it the grade is an error at once; at it, a grade takes well under a second
        of CPU (measured on a 2-core machine: BLEU, GLEU and ROUGE-n about linear, ROUGE
        stemming each word in Python)."""
        from contract.graders.similarity import MAX_ALIGNMENT_CELLS, MAX_TOKENS

        if metric == "fuzzy_match":
            # The shorter aligned along the longer: characters x characters.
            long, short = "abcdefghij" * 2_000, "abcdefghij" * (MAX_ALIGNMENT_CELLS // 200_000)
            fits = grade(similarity(metric), long, {"answer": short})
            too_long = grade(similarity(metric), long, {"answer": short + "x"})
        else:
            text = " ".join(f"w{i % 300}" for i in range(MAX_TOKENS))
            fits = grade(similarity(metric), text, {"answer": text})
            too_long = grade(similarity(metric), text + " w", {"answer": text})
        assert not fits.errors.any() and fits.reward > 0.0
        assert (too_long.reward, too_long.errors.truncated_observation_error) == (0.0, True)

    def test_fuzzy_match_is_a_fraction_not_a_percentage(self) -> None:
        reward = grade(similarity("fuzzy_match"), "color", {"answer": "colour"}).reward
        assert 0.8 < reward < 1.0

    def test_cosine_is_refused_naming_why(self) -> None:
        where, message = refusal(
            {
                "type": "text_similarity",
                "input": "{{sample.output_text}}",
                "reference": "x",
                "evaluation_metric": "cosine",
            }
        )
        assert where == "text_similarity.evaluation_metric"
        assert "text-embedding-3-large" in message


class TestMulti:
    def multi(self, calculate_output: str) -> AnyGrader:
        return grader(
            type="multi",
            graders={
                "exact": {
                    "type": "string_check",
                    "name": "exact",
                    "input": "{{sample.output_text}}",
                    "reference": "{{item.answer}}",
                    "operation": "eq",
                },
                "overlap": {
                    "type": "text_similarity",
                    "name": "overlap",
                    "input": "{{sample.output_text}}",
                    "reference": "{{item.answer}}",
                    "evaluation_metric": "rouge_1",
                },
            },
            calculate_output=calculate_output,
        )

    def test_the_formula_combines_the_named_scores(self) -> None:
        result = grade(
            self.multi("0.9 * exact + 0.1 * overlap"),
            "the cat",
            {"answer": "the cat sat on the mat"},
        )
        assert result.sub_rewards == pytest.approx({"exact": 0.0, "overlap": 0.5})
        assert result.reward == pytest.approx(0.05)

    @pytest.mark.parametrize(
        ("formula", "reward"),
        [
            ("overlap ^ 2", 0.25),  # ^ is a power, as in OpenAI's guide...
            ("overlap ^ 2 + 1", 1.25),  # ...binding tighter than + and *...
            ("2 * overlap ^ 2", 0.5),
            ("2 ^ 1 ^ 2", 2.0),  # ...and from the right
            ("overlap ** 2", 0.25),
            ("max(exact, overlap)", 0.5),
            ("min(exact, overlap, 1)", 0.0),
            ("abs(exact - overlap)", 0.5),
            ("floor(overlap * 3) + ceil(overlap)", 2.0),
            ("sqrt(overlap) * sqrt(overlap)", 0.5),
            ("log(exp(overlap))", 0.5),
            ("-exact + 1", 1.0),
            ("(exact + overlap) / 2", 0.25),
        ],
    )
    def test_operators_and_functions(self, formula: str, reward: float) -> None:
        result = grade(self.multi(formula), "the cat", {"answer": "the cat sat on the mat"})
        assert result.reward == pytest.approx(reward)

    @pytest.mark.parametrize(
        ("formula", "says"),
        [
            ("__import__('os').system('true')", "is not allowed"),
            ("exact.__class__", "is not allowed"),
            ("(lambda: 1)()", "is not allowed"),
            ("[x for x in (1,)]", "is not allowed"),
            ("exact if overlap else 1", "is not allowed"),
            ("'a' * 10", "is not allowed"),
            ("print(exact)", "is not allowed"),
            ("exact + missing", "`missing` is not one of the graders"),
            ("exact +", "does not parse"),
            ("sqrt(exact, overlap)", "sqrt() takes one argument"),
            ("-" * 3000 + "exact", "nested deeper than 64 levels"),
            ("abs(" * 70 + "exact" + ")" * 70, "nested deeper than 64 levels"),
        ],
    )
    def test_a_formula_that_is_not_arithmetic_over_the_graders_is_refused(
        self, formula: str, says: str
    ) -> None:
        with pytest.raises(ValidationError) as raised:
            self.multi(formula)
        [problem] = raised.value.errors()
        assert problem["loc"] == ("multi", "calculate_output")
        assert says in problem["msg"]

    def test_arithmetic_without_a_value_is_an_error_not_a_crash(self) -> None:
        item = {"answer": "the cat sat on the mat"}
        for formula in ("overlap / exact", "log(exact)", "10 ^ 10 ^ 10"):
            result = grade(self.multi(formula), "the cat", item)
            assert result.reward == 0.0
            assert result.errors.other_error, formula

    def test_a_result_that_is_not_a_real_number_is_an_error(self) -> None:
        # Python's power of a negative number to a fraction is complex.
        result = grade(self.multi("(exact - 1) ^ 0.5"), "x", {"answer": "y"})
        assert (result.reward, result.errors.other_error) == (0.0, True)

    def test_python_graders_share_one_time_budget_per_grade(self) -> None:
        source = "def grade(sample, item):\n    return 1.0\n"
        given: list[float] = []

        def slow(grader: Any, sample: Sample, item: Any, timeout_s: float) -> float:
            given.append(timeout_s)
            time.sleep(0.3)
            return 1.0

        multi = grader(
            type="multi",
            graders={k: {"type": "python", "name": k, "source": source} for k in "abc"},
            calculate_output="a + b + c",
        )
        result = grade(multi, "x", {}, Runners(python=slow, python_budget_s=0.5))
        # The first two ran (each given what was left); the third found none left.
        assert len(given) == 2 and given[0] > given[1]
        assert result.errors.python_grader_runtime_error and result.reward == 0.0

    def test_a_sub_grader_without_its_field_fails_the_whole(self) -> None:
        result = grade(self.multi("exact + overlap"), "the cat", {"question": "?"})
        assert (result.reward, result.errors.invalid_variable_error) == (0.0, True)

    def test_one_grader_given_alone_is_keyed_by_its_name(self) -> None:
        # OpenAI's SDK types `graders` as a single grader; its API takes a map.
        alone = grader(
            type="multi",
            graders={
                "type": "string_check",
                "name": "exact",
                "input": "{{sample.output_text}}",
                "reference": "yes",
                "operation": "eq",
            },
            calculate_output="exact * 2",
        )
        assert grade(alone, "yes", None).reward == 2.0

    def test_item_fields_are_every_item_field_any_grader_reads(self) -> None:
        assert self.multi("exact").item_fields() == {"answer"}


class TestTemplates:
    def test_a_template_that_renders_past_its_bound_is_an_error_at_once(self) -> None:
        """A reviewer's request: a 64 kB template repeating {{item.a}}, with a 50 kB `a`,
        made the service hold 1.3 GB; the text stops at MAX_RENDERED_CHARS, unbuilt."""
        from contract.graders.templates import MAX_RENDERED_CHARS

        repeated = grader(
            type="string_check",
            name="big",
            input="{{item.a}}" * 6_553,
            reference="x",
            operation="eq",
        )
        started = time.perf_counter()
        result = grade(repeated, "x", {"a": "x" * 50_000})
        assert (result.reward, result.errors.truncated_observation_error) == (0.0, True)
        assert time.perf_counter() - started < 2.0
        fits = {"a": "x" * (MAX_RENDERED_CHARS // 6_553)}
        assert not grade(repeated, "x", fits).errors.any()

    def test_render_replaces_each_placeholder(self) -> None:
        sample = Sample.of('{"a": {"b": [10, 20]}}')
        item = {"q": "why", "n": {"k": 3}}
        text = "{{item.q}} {{ item.n.k }} {{sample.output_json.a.b.1}} {{item.n}}"
        assert render(text, sample, item) == 'why 3 20 {"k": 3}'

    @pytest.mark.parametrize(
        ("template", "says"),
        [
            ("{{foo.bar}}", "the namespaces are `item` and `sample`"),
            ("{{item}}", "names no field of the item"),
            ("{{sample.output_tools}}", "a sample has only sample.output_text"),
            ("{{sample.output_text.x}}", "sample.output_text is a string"),
            ("{{item.a b}}", "is not a dotted name"),
            ("{{ item.answer }", "a '{{' opens no placeholder"),
            ("{{item.answer}} and {{", "a '{{' opens no placeholder"),
        ],
    )
    def test_a_placeholder_that_names_nothing_is_refused_naming_the_field(
        self, template: str, says: str
    ) -> None:
        where, message = refusal(
            {"type": "string_check", "input": template, "reference": "x", "operation": "eq"}
        )
        assert where == "string_check.input"
        assert says in message

    def test_open_braces_without_an_end_are_read_in_linear_time(self) -> None:
        started = time.monotonic()
        for unclosed in ("{{" + " " * 60_000, "{{ item.a " * 5_000):
            with pytest.raises(TemplateError, match="opens no placeholder"):
                references(unclosed)
        assert time.monotonic() - started < 5  # the backtracking pattern took hours

    def test_a_sample_nested_past_the_stack_is_not_json(self) -> None:
        check = string_check("eq", reference="{{sample.output_json.a}}")
        result = grade(check, "[" * 100_000, {})
        assert (result.reward, result.errors.sample_parse_error) == (0.0, True)

    def test_text_without_placeholders_is_itself(self) -> None:
        assert references("plain {text}") == []
        assert render("plain {text}", Sample.of("x"), {}) == "plain {text}"


class TestOtherTypesAndLimits:
    def test_a_python_grader_must_define_grade(self) -> None:
        where, message = refusal({"type": "python", "source": "def score(sample, item): return 1"})
        assert (where, "defines no top-level `def grade(sample, item) -> float`" in message) == (
            "python.source",
            True,
        )
        where, message = refusal({"type": "python", "source": "def grade(:"})
        assert "is not valid Python" in message
        assert "256 kB" in refusal({"type": "python", "source": "#" * (256 * 1024 + 1)})[1]

    def test_a_python_grader_where_none_may_run_scores_zero_saying_why(self) -> None:
        check = grader(type="python", source="def grade(sample, item):\n    return 1.0\n")
        result = grade(check, "x", {})
        assert result.reward == 0.0
        assert (result.errors.python_grader_server_error_type) == "disabled"

    def test_a_python_grader_runs_where_a_runner_is_given(self) -> None:
        check = grader(type="python", source="def grade(sample, item):\n    return 1.0\n")
        runners = Runners(python=lambda g, sample, item, timeout_s: len(sample.output_text) / 10)
        assert grade(check, "abcde", {}, runners).reward == 0.5
        runners = Runners(python=lambda g, sample, item, timeout_s: math.nan)
        assert grade(check, "abcde", {}, runners).errors.unresponsive_reward_error

    def test_score_model_range_must_ascend_and_templates_are_checked(self) -> None:
        base = {
            "type": "score_model",
            "model": "grader-model",
            "input": [{"role": "user", "content": "Rate {{sample.output_text}}"}],
        }
        assert grader(**base).range == [0.0, 1.0]
        assert "low < high" in refusal({**base, "range": [1, 0]})[1]
        where, _ = refusal(
            {
                **base,
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "{{x.y}}"}]}],
            }
        )
        assert where.startswith("score_model.input.0.content")

    def test_unknown_fields_and_types_are_refused(self) -> None:
        assert (
            refusal(
                {
                    "type": "string_check",
                    "input": "a",
                    "reference": "b",
                    "operation": "eq",
                    "extra": 1,
                }
            )[0]
            == "string_check.extra"
        )
        assert "does not match any of the expected tags" in refusal({"type": "label_model"})[1]


def test_the_openai_run_answer_has_every_field_the_sdk_reads() -> None:
    from openai.types.fine_tuning.alpha import GraderRunResponse

    answer = grade(string_check("eq"), "Paris", {"answer": "Paris"}).as_openai()
    parsed = GraderRunResponse.model_validate(answer)
    assert parsed.reward == 1.0
    assert parsed.metadata.errors.sample_parse_error is False
    assert isinstance(grade(string_check("eq"), "x", {}), Grade)
