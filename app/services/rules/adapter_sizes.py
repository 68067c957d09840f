"""What a LoRA run trains: the adapters peft adds to the targeted linear layers, counted
from the checkpoint's tensor names and shapes before anything is loaded.

peft (tuners/lora/layer.py) gives a targeted layer of `in` inputs and `out` outputs two
matrices, A (r x in) and B (out x r): r * (in + out) trainable parameters, whatever the
layer's own size. Which layers it targets (tuners/tuners_utils.py): a name in
`target_modules` matches a module whose name is it or ends with "." + it;
"all-linear" is every Linear and Conv1D layer but the output head (`lm_head`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from contract.run_request import LoraSpec

# A 2-d weight is a linear layer's, except embedding tables (nn.Embedding, never targeted
# by "all-linear") and the output head, which peft leaves out of "all-linear".
_EMBEDDING_NAMES = ("embed", "wte", "wpe", "shared")
_OUTPUT_HEADS = frozenset({"lm_head", "embed_out", "output"})

Linear = tuple[str, int, int]  # module name, then the weight's two dimensions


def linear_weights(headers: Iterable[dict[str, Any]]) -> tuple[Linear, ...]:
    """Every 2-d `.weight` tensor in safetensors headers, as (module name, rows, cols)."""
    found: list[Linear] = []
    for header in headers:
        for name, entry in header.items():
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if name.endswith(".weight") and isinstance(shape, list) and len(shape) == 2:
                found.append((name.removesuffix(".weight"), int(shape[0]), int(shape[1])))
    return tuple(found)


def adapter_parameters(linears: Iterable[Linear], lora: LoraSpec) -> int:
    """The parameters of the adapters peft would add for `lora` to these layers."""
    total = 0
    for module, rows, cols in linears:
        if targeted(module, lora.target_modules):
            total += lora.r * (rows + cols)
    return total


def targeted(module: str, target_modules: str | list[str]) -> bool:
    last = module.rsplit(".", 1)[-1]
    if isinstance(target_modules, str):  # "all-linear"
        return last not in _OUTPUT_HEADS and not any(e in last for e in _EMBEDDING_NAMES)
    return any(module == t or module.endswith("." + t) for t in target_modules)
