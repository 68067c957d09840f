"""DPO on the worker (worker/training/dpo.py, worker/data/preference.py, train_step) against TRL
1.16's
DPOTrainer: its loss and reward metrics, its tokenization and collation of the same records,
and a few optimizer steps on a tiny Llama, full-parameter and with LoRA."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from app.ports import free_port
from contract.eval_metrics import PAIR_METRICS
from contract.run_request import RunSpec
from tests.worker.one_rank import join_one_rank_group, spawn_ranks
from worker.data.loading import IGNORE_INDEX
from worker.data.preference import PreferenceCollator, tokenize_preference
from worker.training.dpo import pair_sums, sigmoid_loss, valid_pairs

BETA = 0.1
SEQ_LENGTH = 48
STEPS = 4
BATCH = 2
LEARNING_RATE = 5e-3
TOLERANCE = 2e-5

PAIRS = [
    ("market price", " up", " down low"),
    ("storm city", " rain", " sun"),
    ("team season", " win the league", " lose"),
    ("bank vote", " yes", " storm city team"),
    ("price", " low", " high price"),
    ("city market", " open", " goal"),
    ("league goal", " win", " bank"),
    ("season rain", " cold", " price up"),
]
# Evaluated after the steps, by both: the loss and pair metrics of a trained policy.
EVAL_PAIRS = [
    ("market city", " open", " closed"),
    ("rain storm", " cold", " warm sun"),
    ("vote bank", " no", " yes price"),
    ("goal team", " win", " lose the league"),
]

# Short turns for the tiny tokenizer, which knows no ChatML tokens; each turn ends in eos.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def spec_for(
    model: Path | str,
    source: Path | str = "/unused.jsonl",
    *,
    lora: dict[str, Any] | None = None,
    zero_stage: int = 0,
    accumulation: int = 1,
    **dataset: Any,
) -> RunSpec:
    """BATCH pairs a step, in `accumulation` micro-batches."""
    return RunSpec.model_validate(
        {
            "run_id": "run_dpo",
            "attempt": 1,
            "storage_path": "/unused",
            "model": str(model),
            "dataset": {"source": str(source), "format": "preference", **dataset},
            "method": {"type": "dpo", "beta": BETA},
            "lora": lora,
            "training": {
                "max_steps": STEPS,
                "learning_rate": LEARNING_RATE,
                "batch_size_per_worker": BATCH // accumulation,
                "gradient_accumulation_steps": accumulation,
                "seq_length": SEQ_LENGTH,
                "weight_decay": 0.0,
            },
            "deepspeed": {"zero_stage": zero_stage, "precision": "fp32"},
            "resources": {"num_workers": 1},
        }
    )


def records(pairs: list[tuple[str, str, str]]) -> Any:
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [p for p, _, _ in pairs],
            "chosen": [c for _, c, _ in pairs],
            "rejected": [r for _, _, r in pairs],
        }
    )


@pytest.fixture(scope="module")
def llama_tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


# -- the loss -----------------------------------------------------------------------------


def trl_loss_and_metrics(
    token_logps: torch.Tensor, completion_mask: torch.Tensor, ref: torch.Tensor
) -> tuple[float, dict[str, float]]:
    """TRL's own DPOTrainer._compute_loss on a model that answers with given per-token
    log-probs, its reference log-probs precomputed (`ref`: chosen then rejected)."""
    from trl import DPOTrainer

    shift_mask = completion_mask[:, 1:]
    rows, width = shift_mask.shape

    class Model:
        training = True

        def __call__(self, **_: Any) -> Any:
            return SimpleNamespace(
                log_probs=token_logps * shift_mask,
                entropy=torch.zeros(rows, width),
                mean_logits=torch.zeros(rows, width),
                is_top1=torch.zeros(rows, width, dtype=torch.bool),
            )

    accelerator = SimpleNamespace(
        device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t
    )
    trainer = SimpleNamespace(
        model=Model(),
        accelerator=accelerator,
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        beta=BETA,
        use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    ref_chosen, ref_rejected = ref.chunk(2)
    inputs = {
        "input_ids": torch.zeros(rows, width + 1, dtype=torch.long),
        "attention_mask": torch.ones(rows, width + 1, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    compute: Any = DPOTrainer._compute_loss  # called on a stand-in for the trainer
    loss = compute(trainer, trainer.model, inputs, return_outputs=False)
    logged = {name: trainer._metrics["train"][name][0] for name in PAIR_METRICS}
    return float(loss), logged


def test_loss_and_reward_metrics_are_trls() -> None:
    generator = torch.Generator().manual_seed(0)
    pairs, width = 6, 9
    token_logps = -torch.rand(2 * pairs, width, generator=generator, dtype=torch.float64) * 3
    completion_mask = torch.ones(2 * pairs, width + 1, dtype=torch.long)
    completion_mask[:, :3] = 0  # the prompt
    completion_mask[1, 6:] = 0  # shorter answers
    completion_mask[pairs + 2, 5:] = 0
    ref = -torch.rand(2 * pairs, generator=generator, dtype=torch.float64) * 20

    trl_loss, trl_metrics = trl_loss_and_metrics(token_logps, completion_mask, ref)

    policy = (token_logps * completion_mask[:, 1:]).sum(dim=1)
    terms = sigmoid_loss(*policy.chunk(2), *ref.chunk(2), beta=BETA)
    valid = torch.ones(pairs, dtype=torch.bool)
    ours = dict(zip(PAIR_METRICS, (pair_sums(terms, valid) / pairs).tolist(), strict=True))
    assert float(terms.losses.mean()) == pytest.approx(trl_loss, rel=1e-12)
    assert ours == pytest.approx(trl_metrics, rel=1e-6)
    # Random log-probs: neither all pairs nor none preferred, so accuracy is really checked.
    assert 0 < ours["rewards/accuracies"] < 1


def test_a_pair_without_targets_counts_for_nothing() -> None:
    labels = torch.tensor([[-100, 5, 6], [-100, -100, -100], [-100, 7, -100], [-100, 8, 9]])
    # Pair 0: both rows learn; pair 1: its chosen row was marked ignored (an eval repeat).
    assert valid_pairs(labels).tolist() == [True, False]


# -- tokenization -------------------------------------------------------------------------


def trl_batch(rows: Any, tokenizer: Any, tmp_path: Path) -> dict[str, torch.Tensor]:
    """TRL's own dataset preparation and collator on the same records."""
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    args = DPOConfig(
        output_dir=str(tmp_path), max_length=SEQ_LENGTH, report_to=[], use_cpu=True, bf16=False
    )
    prepare: Any = DPOTrainer._prepare_dataset
    prepared = prepare(SimpleNamespace(_tokenizer=tokenizer), rows, tokenizer, args, "train")
    collate = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=SEQ_LENGTH)
    return collate([prepared[i] for i in range(len(prepared))])


def ours_batch(rows: Any, tokenizer: Any, spec: RunSpec) -> dict[str, torch.Tensor]:
    pairs = tokenize_preference(rows, tokenizer, spec=spec)
    return PreferenceCollator(pad_token_id=tokenizer.pad_token_id)(list(pairs))


def assert_same_batch(ours: dict[str, torch.Tensor], trl: dict[str, torch.Tensor]) -> None:
    assert torch.equal(ours["input_ids"], trl["input_ids"])
    assert torch.equal(ours["attention_mask"], trl["attention_mask"])
    trl_labels = trl["input_ids"].masked_fill(trl["completion_mask"] == 0, IGNORE_INDEX)
    assert torch.equal(ours["labels"], trl_labels)


def test_text_pairs_are_tokenized_as_trl_does(
    llama_tokenizer: Any, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    eos = llama_tokenizer.eos_token
    # An answer that already ends with eos gets no second one.
    rows = records([*PAIRS, ("bank", f" up{eos}", " down")])
    batch = ours_batch(rows, llama_tokenizer, spec_for(tiny_llama_dir))
    assert_same_batch(batch, trl_batch(rows, llama_tokenizer, tmp_path))
    # Chosen rows first, then rejected, each answer ending with eos.
    assert batch["input_ids"].shape[0] == 2 * len(rows)
    for row, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
        end = int(mask.sum())
        assert row[end - 1] == llama_tokenizer.eos_token_id != row[end - 2]


def test_a_token_across_the_boundary_stays_in_the_prompt_unlike_trl(
    llama_tokenizer: Any, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    # "pri" + "ce" merges into one token when tokenized as one string. TRL takes its answer
    # from there, moving the merged token into the answer; here the prompt is tokenized as
    # the model will see it at inference, alone, and the answer follows it.
    rows = records([("The pri", "ce rose", "ce fell")])
    ours = ours_batch(rows, llama_tokenizer, spec_for(tiny_llama_dir))
    trl = trl_batch(rows, llama_tokenizer, tmp_path)
    prompt = llama_tokenizer("The pri")["input_ids"]
    assert ours["input_ids"][0, : len(prompt)].tolist() == prompt
    assert int((ours["labels"][0] == IGNORE_INDEX).sum()) == len(prompt)
    assert int((trl["completion_mask"][0] == 0).sum()) < len(prompt)
    text = llama_tokenizer.decode(ours["input_ids"][0])
    assert text == llama_tokenizer.decode(trl["input_ids"][0]) == "The price rose<|endoftext|>"


def test_chat_pairs_are_tokenized_as_trl_does(
    llama_tokenizer: Any, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from datasets import Dataset

    tokenizer = llama_tokenizer
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        rows = Dataset.from_list(
            [
                {
                    "prompt": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": prompt},
                    ],
                    "chosen": [{"role": "assistant", "content": chosen.strip()}],
                    "rejected": [{"role": "assistant", "content": rejected.strip()}],
                }
                for prompt, chosen, rejected in PAIRS[:4]
            ]
        )
        spec = spec_for(tiny_llama_dir, chat_template=CHAT_TEMPLATE)
        assert_same_batch(ours_batch(rows, tokenizer, spec), trl_batch(rows, tokenizer, tmp_path))
    finally:
        tokenizer.chat_template = None


def test_pairs_are_cut_at_seq_length_and_dropped_when_an_answer_is_cut_away(
    llama_tokenizer: Any, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    long_prompt = " ".join(["market price"] * 30)
    rows = records(
        [("storm", " rain " * 40, " sun"), (long_prompt, " up", " down"), ("team", " win", " no")]
    )
    spec = spec_for(tiny_llama_dir)
    pairs = tokenize_preference(rows, llama_tokenizer, spec=spec)
    assert len(pairs) == 2  # the long prompt leaves neither answer a token
    assert len(pairs[0]["chosen_input_ids"]) == SEQ_LENGTH
    assert len(pairs[0]["chosen_labels"]) == SEQ_LENGTH
    # TRL keeps the same two pairs and cuts them the same way.
    batch = PreferenceCollator(pad_token_id=llama_tokenizer.pad_token_id)(list(pairs))
    assert_same_batch(batch, trl_batch(rows, llama_tokenizer, tmp_path))


# -- evaluation and logged metrics --------------------------------------------------------


class _Engine(torch.nn.Module):
    """A model where evaluation expects a DeepSpeed engine (`engine.module`)."""

    def __init__(self, module: Any) -> None:
        super().__init__()
        self.module = module

    def forward(self, **inputs: Any) -> Any:
        return self.module(**inputs)


def _eval(policy: Any, reference: Any, pairs: Any, sampler: Any = None) -> dict[str, float]:
    from torch.utils.data import DataLoader

    from contract.run_request import DpoMethod
    from worker.training.evaluation import evaluate

    loader = DataLoader(
        pairs,
        batch_size=2,
        sampler=sampler,
        collate_fn=PreferenceCollator(pad_token_id=0),
    )
    method = DpoMethod(type="dpo", beta=BETA)
    return evaluate(
        policy, loader, task="causal_lm", num_labels=1, method=method, reference=reference
    )


def test_eval_leaves_out_the_pairs_the_sampler_repeats(
    llama_tokenizer: Any, tiny_llama_dir: Path
) -> None:
    from torch.utils.data import DistributedSampler
    from transformers import AutoModelForCausalLM

    from worker.training.dpo import FrozenReference

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    reference = FrozenReference(
        engine=AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    )
    pairs = tokenize_preference(records(EVAL_PAIRS[:3]), llama_tokenizer, spec=spec_for("m"))
    # Two ranks over three pairs: rank 1 gets pair 1 and, to even the ranks out, pair 0 again.
    sampler: DistributedSampler[Any] = DistributedSampler(
        pairs, num_replicas=2, rank=1, shuffle=False
    )
    assert list(sampler) == [1, 0]

    padded = _eval(_Engine(policy), reference, pairs, sampler)
    alone = _eval(_Engine(policy), reference, pairs.select([1]))
    both = _eval(_Engine(policy), reference, pairs.select([1, 0]))
    assert padded == pytest.approx(alone, rel=1e-9)
    assert padded["eval_loss"] != pytest.approx(both["eval_loss"], rel=1e-3)


def test_a_logged_step_reports_the_means_over_its_pairs() -> None:
    from worker.reporting.metrics import MetricSinks, StepResult

    engine = SimpleNamespace(get_lr=lambda: [0.1], get_global_grad_norm=lambda: None)
    sinks = MetricSinks(spec_for("m"), rank=1)  # rank 1: no service client
    sums = torch.tensor([0.3, -0.6, 2.0, 0.9, -30.0, -45.0], dtype=torch.float64)
    step = StepResult(loss=torch.tensor(0.6), tokens=40, samples=3, pair_sums=sums, pairs=3)
    sinks.log_step(engine, step=1, epoch=0.5, elapsed=1.0, result=step, total_steps=4)
    logged = sinks.latest
    sinks.close()
    assert {name: logged[name] for name in PAIR_METRICS} == pytest.approx(
        dict(zip(PAIR_METRICS, (sums / 3).tolist(), strict=True))
    )
    assert logged["loss"] == pytest.approx(0.6)


# -- training steps -----------------------------------------------------------------------


def _train_ours(rank: int, spec_json: str, port: int, out: str) -> None:
    """One rank: the worker's own build_training and train_step on the pairs in order."""
    import deepspeed
    from torch.utils.data import DataLoader, DistributedSampler

    from worker.training.evaluation import evaluate
    from worker.training.loop import build_training, train_step

    join_one_rank_group(port)
    spec = RunSpec.model_validate_json(spec_json)
    training = build_training(spec, rank=0)
    module = training.engine.module
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    # Whole, not ZeRO-3's partitions (a no-op at other stages).
    with deepspeed.zero.GatheredParameters([p for _, p in trainable]):
        start = {n: p.detach().clone() for n, p in trainable}
    torch.save(start, Path(out, "start.pt"))
    # The pairs as the run tokenized them (worker.data.preparation.prepare_examples).
    pairs = training.data.train.dataset
    collate = PreferenceCollator(pad_token_id=training.tokenizer.pad_token_id)
    steps = []
    for step in range(STEPS):
        size = spec.training.batch_size_per_worker
        first = step * BATCH
        micro_batches = [
            collate([pairs[i] for i in range(start, start + size)])
            for start in range(first, first + BATCH, size)
        ]
        result = train_step(
            training.engine,
            iter(micro_batches),
            spec=spec,
            device=torch.device("cpu"),
            group=None,
            reference=training.reference,
        )
        rewards = (result.pair_sums / result.pairs).tolist()
        steps.append({"loss": float(result.loss), **dict(zip(PAIR_METRICS, rewards, strict=True))})
    Path(out, "steps.json").write_text(json.dumps(steps))
    eval_pairs = tokenize_preference(records(EVAL_PAIRS), training.tokenizer, spec=spec)
    loader = DataLoader(
        eval_pairs,
        batch_size=BATCH,
        sampler=DistributedSampler(eval_pairs, num_replicas=1, rank=0, shuffle=False),
        collate_fn=collate,
    )
    metrics = evaluate(
        training.engine,
        loader,
        task="causal_lm",
        num_labels=1,
        method=spec.method,
        reference=training.reference,
    )
    Path(out, "eval.json").write_text(json.dumps(metrics))
    # DeepSpeed's shared-memory comm op aborts the interpreter's normal exit.
    os._exit(0)


def train_trl(
    model_dir: Path, rows: Any, lora: dict[str, Any] | None, start: Any, out: Path
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """TRL's DPOTrainer on the same pairs, in the same order, from the same weights; the
    loss and metrics of each step, then its evaluation on EVAL_PAIRS."""
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=lora["r"],
                lora_alpha=lora["alpha"],
                lora_dropout=lora["dropout"],
                target_modules=lora["target_modules"],
                task_type="CAUSAL_LM",
            ),
        )
    # The worker's adapters start from their own random draw: TRL starts from the same.
    missing = set(start) - {n for n, _ in model.named_parameters()}
    assert not missing, missing
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in start:
                param.copy_(start[name])

    steps: list[dict[str, float]] = []

    class Recording(DPOTrainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)  # type: ignore[arg-type]

        def _compute_loss(self, model: Any, inputs: Any, return_outputs: bool) -> Any:
            loss = super()._compute_loss(model, inputs, return_outputs)
            if not model.training:  # evaluate(): its metrics are recorded by TRL itself
                return loss
            metrics = self._metrics["train"]
            steps.append(
                {"loss": loss.item(), **{name: metrics[name][-1] for name in PAIR_METRICS}}
            )
            return loss

    args = DPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=STEPS,
        beta=BETA,
        max_length=SEQ_LENGTH,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        bf16=False,
        optim="adamw_torch",
        dataloader_drop_last=True,
    )
    trainer = Recording(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.train()
    evaluated = trainer.evaluate(records(EVAL_PAIRS))
    return steps, evaluated


# Adapter dropout on: DPO turns dropout off in the policy (TRL's disable_dropout), adapters
# included, or its log-probs would be noisy against the reference's.
LORA = {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize(
    ("lora", "zero_stage", "accumulation"),
    [(None, 0, 1), (None, 2, 2), (None, 3, 1), (LORA, 3, 1)],
    # ZeRO-3: the policy and the full-parameter reference partitioned (each in its own
    # engine), or the adapters disabled on partitioned base weights. Accumulated: TRL's
    # batch of BATCH pairs as micro-batches of one pair, the step still their mean.
    ids=["full", "full-accumulated-zero2", "full-zero3", "lora-zero3"],
)
def test_steps_match_trls_dpo_trainer(
    lora: dict[str, Any] | None,
    zero_stage: int,
    accumulation: int,
    tiny_llama_dir: Path,
    tmp_path: Path,
) -> None:
    if lora is not None:
        pytest.importorskip("worker.model.lora")
    source = tmp_path / "pairs.jsonl"
    source.write_text(
        "".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in PAIRS)
    )
    spec = spec_for(
        tiny_llama_dir, source, lora=lora, zero_stage=zero_stage, accumulation=accumulation
    )
    spawn_ranks(_train_ours, args=(spec.model_dump_json(), free_port(), str(tmp_path)), nprocs=1)
    ours = json.loads((tmp_path / "steps.json").read_text())
    start = torch.load(tmp_path / "start.pt")

    theirs, their_eval = train_trl(tiny_llama_dir, records(PAIRS), lora, start, tmp_path / "trl")

    assert len(theirs) == STEPS
    for step, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        assert mine == pytest.approx(reference, abs=TOLERANCE), f"step {step + 1}"
    # The policy moved: later steps' rewards are not the first step's zeros.
    assert ours[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert abs(ours[-1]["rewards/margins"]) > 10 * TOLERANCE
    # Evaluation after the steps: TRL's eval loss and pair metrics (batch means, equal to
    # means over pairs here: the batches are full).
    our_eval = json.loads((tmp_path / "eval.json").read_text())
    names = ["eval_loss", *(f"eval_{name}" for name in PAIR_METRICS)]
    assert {n: our_eval[n] for n in names} == pytest.approx(
        {n: their_eval[n] for n in names}, abs=TOLERANCE
    )
    assert our_eval["eval_loss"] != pytest.approx(math.log(2), abs=1e-3)
