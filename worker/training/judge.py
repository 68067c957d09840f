"""The judges of `score_model` graders, on the training rank: the model a grader names reads
each completion's messages (its `input`, templated) and answers with a score.

A judge runs where the rank's policy runs, on its device, as TRL's reward models do: the
training workers hold the cluster's GPUs for the whole run, and a CPU judge of a real
model would take longer than the step. Each judge is loaded once per rank, when a step
first needs it, in bf16 on a GPU with native bf16 and in fp32 elsewhere (fp16 can
overflow in a model that was not trained in it), in eval mode and without gradients, and
kept for the run. Under ZeRO-3 it loads whole, outside DeepSpeed's partitioning: it is not
trained, and a partitioned judge would make every rank wait on every other's generation.

A step's completions are judged in batches of at most BATCH_TOKENS prompt and answer
tokens, shortest prompts together, left-padded. The messages are rendered with the judge
tokenizer's chat template (OpenAI's `developer` role as `system`, which chat templates
know); a judge without one is refused, as chat data is (worker/data/chat.py): a raw
transcript would be a prompt format the judge was never trained on. `sampling_params` as
OpenAI names them: `temperature` (unset or 0: greedy, so that two equal completions score
alike and the reward adds no noise of its own to the group's advantages), `top_p`, `seed`
(the judge's sampling then repeats, and the policy's random stream is left as it was) and
`max_completions_tokens` (unset: DEFAULT_MAX_TOKENS); `reasoning_effort` names no setting
of a local model and is ignored.

The answers go with the completions to the grading task (worker/training/grading_tasks.py), which
reads each as a score (contract/graders/score_model.py) and computes the rest of the grade.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from contract.graders.models import Grader, SamplingParams, ScoreModelGrader
from contract.graders.score_model import (
    BATCH_TOKENS,
    DEFAULT_MAX_TOKENS,
    JudgeReply,
    UnreadableScore,
    judged_leaves,
    messages_of,
    read_score,
)
from contract.graders.templates import MissingValue, RenderedTooLong, Sample

log = logging.getLogger("tuneyard.worker")


@dataclass(slots=True)
class LoadedJudge:
    model: Any
    tokenizer: Any
    stop_ids: list[int]  # the tokens that end an answer
    max_positions: int | None


class Judges:
    """This rank's judges, by model, and the grading that asks them first."""

    def __init__(
        self, *, device: Any, zero3_config: Any = None, batch_tokens: int = BATCH_TOKENS
    ) -> None:
        self.device = device
        self.zero3_config = zero3_config
        self.batch_tokens = batch_tokens
        self._loaded: dict[str, LoadedJudge] = {}

    def grade(self, grader: dict[str, Any], texts: list[str], items: list[Any]) -> Any:
        """worker.training.grading_tasks.grade_off_rank, with the answers of the grader's judges."""
        from pydantic import TypeAdapter

        from worker.training.grading_tasks import grade_off_rank

        leaves = judged_leaves(TypeAdapter(Grader).validate_python(grader))
        if not leaves:
            return grade_off_rank(grader, texts, items)
        samples = [Sample.of(text) for text in texts]
        replies = {key: self.replies(leaf, samples, items) for key, leaf in leaves}
        return grade_off_rank(grader, texts, items, replies)

    def replies(
        self, grader: ScoreModelGrader, samples: list[Sample], items: list[Any]
    ) -> list[JudgeReply]:
        """The judge's answer to each sample's messages. A sample whose messages cannot be
        rendered (an item without a field the input reads) is not judged: the grade flags
        its template."""
        replies = [JudgeReply(error="not judged") for _ in samples]
        asked: list[tuple[int, list[dict[str, str]]]] = []
        for index, (sample, item) in enumerate(zip(samples, items, strict=True)):
            with contextlib.suppress(MissingValue, RenderedTooLong):
                asked.append((index, messages_of(grader, sample, {} if item is None else item)))
        answers = self.answer(grader, [messages for _, messages in asked])
        for (index, _), reply in zip(asked, answers, strict=True):
            replies[index] = reply
        _log_unreadable(grader, answers)
        return replies

    def answer(
        self, grader: ScoreModelGrader, conversations: list[list[dict[str, str]]]
    ) -> list[JudgeReply]:
        """The judge's answer to each conversation, in order."""
        judge = self.load(grader.model)
        params = grader.sampling_params or SamplingParams()
        new_tokens = params.max_completions_tokens or DEFAULT_MAX_TOKENS
        prompts = [_prompt_ids(judge.tokenizer, messages) for messages in conversations]
        replies: list[JudgeReply] = [JudgeReply(error="not judged") for _ in prompts]
        fitting = []
        for index, ids in enumerate(prompts):
            room = judge.max_positions
            if room is not None and len(ids) + new_tokens > room:
                replies[index] = JudgeReply(
                    error=f"the judge's prompt is {len(ids)} tokens: with "
                    f"max_completions_tokens ({new_tokens}) it passes the {room} positions of "
                    f"{grader.model!r}"
                )
            else:
                fitting.append(index)
        for batch in _batches(fitting, prompts, new_tokens, self.batch_tokens):
            texts = self._generate(judge, [prompts[i] for i in batch], params, new_tokens)
            for index, text in zip(batch, texts, strict=True):
                replies[index] = JudgeReply(text=text)
        return replies

    def load(self, model: str) -> LoadedJudge:
        """The judge `model` (a local folder, a hub id or a URI of object storage), loaded
        the first time it is asked for."""
        if model not in self._loaded:
            self._loaded[model] = _load(model, device=self.device, zero3_config=self.zero3_config)
        return self._loaded[model]

    def _generate(
        self, judge: LoadedJudge, prompts: list[list[int]], params: SamplingParams, new_tokens: int
    ) -> list[str]:
        import torch
        from transformers import GenerationConfig

        pad = judge.tokenizer.pad_token_id
        longest = max(len(ids) for ids in prompts)
        ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, longest - len(prompt) :] = 1
        sample = bool(params.temperature)
        # A config of its own, as worker/training/generation.py's: the model's may carry a
        # repetition penalty, top-k or a length limit.
        config = GenerationConfig(
            max_new_tokens=new_tokens,
            do_sample=sample,
            temperature=params.temperature if sample else None,
            top_p=(params.top_p if params.top_p is not None else 1.0) if sample else None,
            top_k=0 if sample else None,
            eos_token_id=judge.stop_ids,
            pad_token_id=pad,
            use_cache=True,
        )
        with torch.no_grad(), _seeded(params.seed, self.device):
            out = judge.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=config,
            )
        answers = []
        for row in out[:, longest:].tolist():
            ends = [i for i, token in enumerate(row) if token in judge.stop_ids]
            answers.append(row[: ends[0]] if ends else row)
        return [t.strip() for t in judge.tokenizer.batch_decode(answers, skip_special_tokens=True)]


def _load(model: str, *, device: Any, zero3_config: Any) -> LoadedJudge:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from contract.seq_length import max_positions_of
    from worker.data.remote_sources import local_copy
    from worker.data.sources import refuse_shadowed_hub_id
    from worker.model.loading import loading_whole

    refuse_shadowed_hub_id("the score_model grader's model", model)
    where = local_copy(model)
    native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    dtype = torch.bfloat16 if native_bf16 else torch.float32
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
        with loading_whole(zero3_config):
            judge = AutoModelForCausalLM.from_pretrained(where, dtype=dtype)
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"cannot load the score_model grader's model {model!r}: {first}") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the score_model grader's model {model!r} has no chat template to render its "
            "input messages with: give a model whose tokenizer has one (an instruct or chat "
            "model's)"
        )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {model!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    judge.to(device).eval().requires_grad_(False)
    stop_ids = _stop_ids(judge.generation_config.eos_token_id, tokenizer.eos_token_id)
    log.info("loaded the judge %s (%s on %s)", model, str(dtype).removeprefix("torch."), device)
    return LoadedJudge(
        model=judge,
        tokenizer=tokenizer,
        stop_ids=stop_ids,
        max_positions=max_positions_of(judge.config.to_dict()),
    )


def _stop_ids(*given: int | list[int] | None) -> list[int]:
    """Every id that ends an answer: the model's generation config may name several (an
    instruct model's end-of-turn beside its end of text)."""
    found: list[int] = []
    for value in given:
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in found:
                found.append(int(token))
    return found


def _prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    chat = [
        {"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
        for m in messages
    ]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    # The template writes the special tokens it wants, as apply_chat_template's own
    # tokenizing assumes.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _batches(
    indices: list[int], prompts: list[list[int]], new_tokens: int, budget: int
) -> Iterator[list[int]]:
    """`indices` in batches of similar prompt lengths, each of at most `budget` tokens
    (rows x longest prompt and answer), one row at least."""
    batch: list[int] = []
    for index in sorted(indices, key=lambda i: len(prompts[i])):
        # Sorted: this row is the batch's longest.
        if batch and (len(batch) + 1) * (len(prompts[index]) + new_tokens) > budget:
            yield batch
            batch = []
        batch.append(index)
    if batch:
        yield batch


@contextlib.contextmanager
def _seeded(seed: int | None, device: Any) -> Iterator[None]:
    """The judge's sampling from `seed`, the generator's state restored afterwards."""
    if seed is None:
        yield
        return
    import torch

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.random.fork_rng(devices=[index]), torch.cuda.device(index):
            torch.cuda.manual_seed(seed)
            yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        yield


def _log_unreadable(grader: ScoreModelGrader, replies: list[JudgeReply]) -> None:
    """The grade says only `model_grader_parse_error`; the log shows what the judge said."""
    unreadable = []
    for reply in replies:
        if reply.text is None:
            continue
        try:
            read_score(reply.text)
        except UnreadableScore as exc:
            unreadable.append(str(exc))
    if unreadable:
        log.warning(
            "score_model grader %r: %d of %d answers hold no score; the first: %s",
            grader.name,
            len(unreadable),
            len(replies),
            unreadable[0],
        )
