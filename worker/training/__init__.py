"""The training loop on every rank, the Ray Train trainer that runs it, and what a step
needs: the optimizer, the loss over a step, evaluation, preemption, and the methods beyond
plain fine-tuning (DPO; GRPO with its sampling, grading and judges)."""
