"""Sampling completions from the policy being trained: the one seam every generation of a
run goes through (method grpo's rollouts and its evaluation).

`HfGenerator` runs Hugging Face's `generate` on the engine's own module, with a KV cache,
in eval mode (no dropout: the completions come from the policy the loss scores) and without
gradient checkpointing (which turns the cache off). Under ZeRO-3 the weights are gathered
once for all of a step's generation and DeepSpeed's per-module hooks are taken off
meanwhile, as TRL's `unwrap_model_for_generation` does: every token would otherwise gather
every layer again, and ranks whose completions end at different lengths would wait on one
another's gathers. Under LoRA the module is peft's, which generates through the adapter.

A GPU engine (vLLM) would go behind the same `sample`: given the policy's weights after
each optimizer step, it returns the same `Completions`; the loss never sees how they were
made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Completions:
    """Sampled completions, one row per prompt row: token ids right-padded, the mask of the
    tokens that count (up to and including the first eos) and the decoded text."""

    ids: Any
    mask: Any
    texts: list[str]
    ended: Any  # bool per row: it produced eos (the others ran to max_new_tokens)


@contextlib.contextmanager
def policy_for_generation(engine: Any) -> Iterator[Any]:
    """The engine's module, ready to generate; as it was afterwards."""
    module = engine.module
    was_training = module.training
    checkpointing = bool(getattr(module, "is_gradient_checkpointing", False))
    if checkpointing:
        module.gradient_checkpointing_disable()
    module.eval()
    try:
        if engine.zero_optimization_stage() == 3:
            with _gathered(engine):
                yield module
        else:
            yield module
    finally:
        if was_training:
            module.train()
        if checkpointing:
            # Non-reentrant, as worker.model.loading turns it on.
            module.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )


@contextlib.contextmanager
def _gathered(engine: Any) -> Iterator[None]:
    """Every ZeRO-3 partition gathered (a collective: every rank enters together), with
    the module hooks off until it is partitioned again."""
    import deepspeed

    offload = _parameter_offload(engine)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        if offload is None:
            yield
            return
        for param in engine.module.parameters():
            param.ds_active_sub_modules.clear()
        # The per-module fetch and release hooks only; the root's start-of-forward hook
        # stays, as `_remove_module_hooks` would not leave it.
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            # Registering on the root also invalidates the recorded order of modules
            # (DeepSpeed 0.19.8), which generation's forwards left stale.
            offload._register_deepspeed_module(offload.module)


def _parameter_offload(engine: Any) -> Any:
    optimizer = getattr(engine, "optimizer", None)
    return getattr(optimizer, "parameter_offload", None)


@dataclass(slots=True)
class HfGenerator:
    """Sampling with `generate`, at a fixed temperature from the whole distribution (no
    top-k or top-p: the log-probabilities the loss takes at that temperature are the
    sampling distribution's), or greedily."""

    tokenizer: Any

    def sample(
        self,
        model: Any,
        prompt_ids: Any,
        prompt_mask: Any,
        *,
        max_new_tokens: int,
        temperature: float,
        greedy: bool = False,
    ) -> Completions:
        import torch
        from transformers import GenerationConfig

        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        # A config of its own: the model's generation_config may carry a repetition penalty,
        # top-k or a length limit that would make the samples another distribution.
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else temperature,
            top_k=None if greedy else 0,
            top_p=None if greedy else 1.0,
            eos_token_id=eos,
            pad_token_id=pad,
            use_cache=True,
        )
        with torch.no_grad():
            out = model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config
            )
        ids = out[:, prompt_ids.shape[1] :]
        mask = torch.ones_like(ids)
        ended = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        if eos is not None:
            is_eos = ids == eos
            # Tokens after the first eos are padding: a cumulative count of eos before each.
            after = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
            mask = (~after).long()
            ended = is_eos.any(dim=1)
        ids = ids.masked_fill(mask == 0, pad)
        texts = self.tokenizer.batch_decode(
            [row[: int(n)] for row, n in zip(ids, mask.sum(dim=1), strict=True)],
            skip_special_tokens=True,
        )
        return Completions(ids=ids, mask=mask, texts=list(texts), ended=ended)
