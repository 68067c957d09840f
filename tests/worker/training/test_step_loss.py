"""worker/training/step_loss.py: a step's loss is the mean over all its targets, not over batches.

The end-to-end proof against Hugging Face's Trainer, under real DeepSpeed and Ray, is
tests/e2e/test_loss_normalisation.py; these pin the arithmetic each rank does."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.training.step_loss import step_share, step_targets, targets_in


def _batch(labels: list[list[int]]) -> dict[str, torch.Tensor]:
    return {"labels": torch.tensor(labels)}


def test_causal_targets_are_the_shifted_labels_that_are_not_ignored() -> None:
    # The first position is never a target: the model predicts position t+1 from t.
    batch = _batch([[5, 6, 7, -100], [-100, -100, 3, 4]])
    assert targets_in(batch, task="causal_lm") == 2 + 2


def test_classification_targets_are_the_examples() -> None:
    assert targets_in(_batch([[1], [0], [1]]), task="sequence_classification") == 3
    assert targets_in({"labels": torch.tensor([1, 0])}, task="sequence_classification") == 2


def test_without_a_process_group_the_step_is_this_rank() -> None:
    assert step_targets(17, group=None, tensor_parallel_size=1) == 17


def test_the_shares_of_a_step_add_up_to_its_token_mean() -> None:
    generator = torch.Generator().manual_seed(0)
    # Micro-batches of very different sizes: 1, 9 and 30 target tokens.
    token_losses = [torch.rand(n, generator=generator) * 5 for n in (1, 9, 30)]
    means = [t.mean() for t in token_losses]
    total = sum(len(t) for t in token_losses)

    shares = [
        step_share(m, targets=len(t), step_targets=total)
        for m, t in zip(means, token_losses, strict=True)
    ]

    expected = torch.cat(token_losses).mean()
    assert abs(float(sum(shares)) - float(expected)) < 1e-6
    # Averaging the micro-batch means, as before, gives another number.
    assert abs(float(sum(means)) / 3 - float(expected)) > 0.05


def test_a_micro_batch_without_targets_adds_nothing_but_still_backs_up() -> None:
    logits = torch.randn(1, 3, 5, requires_grad=True)
    nan_mean = F.cross_entropy(
        logits[:, :-1].reshape(-1, 5), torch.tensor([-100, -100]), ignore_index=-100
    )
    assert nan_mean.isnan()
    share = step_share(nan_mean, targets=0, step_targets=10)
    share.backward()
    assert float(share.detach()) == 0.0
    assert logits.grad is not None and not logits.grad.isnan().any()
