"""Rules for what evaluations decide: early stopping and the best checkpoint.

Each names the field that asked and says what to change, before any compute is spent: a
metric the run never reports would otherwise make a run that never stops early, and a
best checkpoint without evaluations has nothing to be best by.
"""

from __future__ import annotations

from app.errors import field_problem
from contract.eval_metrics import eval_metric_names
from contract.run_request import RunRequest


def evaluation_problems(req: RunRequest) -> list[dict[str, str]]:
    problems: list[dict[str, str]] = []
    criterion = req.best_criterion
    if criterion is None:
        return problems
    tr, ck, es = req.training, req.checkpointing, req.early_stopping

    def add(name: str, message: str) -> None:
        problems.append(field_problem(name, message))

    # The field that asked for ranking: the first of these that is set.
    if ck.best_metric is not None:
        asker = "checkpointing.best_metric"
    elif es is not None:
        asker = "early_stopping"
    else:
        asker = "export.from"
    if req.dataset.eval_wanted() is None:
        add(
            asker,
            f"{asker} needs evaluations: set dataset.eval_split or dataset.eval_source",
        )
    names = eval_metric_names(task=req.task, method=req.method.type)
    what = f"task {req.task}" + (
        f" with method {req.method.type}" if req.method.type != "sft" else ""
    )
    for field, metric in (
        ("checkpointing.best_metric", ck.best_metric),
        ("early_stopping.metric", es.metric if es else None),
    ):
        if metric is not None and metric not in names:
            add(
                field,
                f"{metric!r} is not an evaluation metric of {what}: one of " + ", ".join(names),
            )
    if es is not None and tr.eval_every_n_steps is None and req.dataset.eval_wanted():
        add(
            "early_stopping",
            "early_stopping needs training.eval_every_n_steps: without it the run "
            "evaluates only once, at the end",
        )
    every, evals = ck.every_n_steps, tr.eval_every_n_steps
    if every is not None and (evals is None or every % evals):
        add(
            "checkpointing.every_n_steps",
            f"with a best metric ({criterion[0]}), every_n_steps ({ck.every_n_steps}) must "
            f"be a multiple of training.eval_every_n_steps "
            f"({tr.eval_every_n_steps}): checkpoints are ranked by the evaluation at "
            "their step (one is also saved at every evaluation)",
        )
    if req.export.from_ == "best" and not ck.export_hf:
        add("export.from", "export.from 'best' needs checkpointing.export_hf true")
    return problems
