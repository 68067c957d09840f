"""What a local model folder says about a run, read without importing torch.

Validating a request must stay cheap in the service process: importing transformers'
model registry (or any transformers config class) imports torch, hundreds of MB and
seconds of start-up. So the two facts validation needs are read from files instead:
which model types transformers can train for a task (its own registry, parsed as data
from the installed source), and how many parameters the checkpoint holds (safetensors
headers, which record every tensor's shape in plain JSON).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import logging
import math
import struct
from pathlib import Path
from typing import Any

log = logging.getLogger("tuneyard")

# transformers' registry tables, by task (transformers/models/auto/modeling_auto.py).
_TASK_TABLES = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
}
# A safetensors file starts with the length of its JSON header as a little-endian u64.
_HEADER_LENGTH = struct.Struct("<Q")
# Far above any real header; a corrupt length must not make us read gigabytes.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@functools.cache
def trainable_model_types(task: str) -> frozenset[str] | None:
    """The `model_type`s transformers has an auto class for `task` (causal LM or
    sequence classification), as the installed version lists them; None when the registry
    cannot be read that way (the worker's own load then says what it cannot train)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(spec.submodule_search_locations[0]) / "models" / "auto" / "modeling_auto.py"
    wanted = _TASK_TABLES[task]
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == wanted for t in node.targets)
            and isinstance(node.value, ast.Call)
            and node.value.args
        ):
            try:
                pairs = ast.literal_eval(node.value.args[0])
            except ValueError:
                break
            return frozenset(model_type for model_type, _ in pairs)
    log.warning("%s not readable in %s: model types are checked on the cluster", wanted, source)
    return None


def checkpoint_parameters(folder: Path) -> int | None:
    """Parameters stored in a save_pretrained folder's safetensors files, or None when it
    has none (a pickled pytorch_model.bin cannot be read without torch)."""
    headers = safetensors_headers(folder)
    if not headers:
        return None
    return sum(
        math.prod(entry["shape"])
        for header in headers
        for name, entry in header.items()
        if name != "__metadata__"
    )


def safetensors_headers(folder: Path) -> list[dict[str, Any]]:
    """The JSON headers (tensor names, dtypes, shapes) of a save_pretrained folder's
    safetensors files; [] when it has none or one cannot be read."""
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [folder / name for name in shards]
        else:
            files = sorted(folder.glob("*.safetensors"))
        headers = []
        for path in files:
            with path.open("rb") as f:
                (length,) = _HEADER_LENGTH.unpack(f.read(_HEADER_LENGTH.size))
                if length > _MAX_HEADER_BYTES:
                    return []
                headers.append(json.loads(f.read(length)))
        return headers
    except (OSError, ValueError, KeyError, struct.error):
        return []


# Where transformers 5's tokenizers keep chat templates (transformers/utils/hub.py):
# save_pretrained writes the template beside the tokenizer, further named ones in a folder.
_CHAT_TEMPLATE_FILE = "chat_template.jinja"
_CHAT_TEMPLATE_DIR = "additional_chat_templates"


def chat_template_of(folder: Path) -> str | None:
    """The chat template that `AutoTokenizer.from_pretrained(folder).apply_chat_template`
    renders with (no tools given), read from files; None when it has none it can use.

    As transformers 5 loads a tokenizer (tokenization_utils_base._from_pretrained): the
    template files, when there are any, win over tokenizer_config.json's `chat_template`
    (a string, or a list of {name, template}, older transformers' way to save several).
    Of several templates `apply_chat_template` takes the one named "default". A
    `chat_template.json` counts for nothing: only processors (processing_utils) read it,
    never the tokenizer that the worker loads."""
    try:
        files = _template_files(folder)
        templates = files if files is not None else _tokenizer_config_templates(folder)
    except (OSError, UnicodeDecodeError):
        return None  # the worker could not load this tokenizer either
    template = templates.get("default")
    return template if template and template.strip() else None


def _template_files(folder: Path) -> dict[str, str | None] | None:
    """The templates saved as files, by name (only "default" is read), or None when there
    are none."""
    paths = {}
    if (folder / _CHAT_TEMPLATE_FILE).is_file():
        paths["default"] = folder / _CHAT_TEMPLATE_FILE
    named = folder / _CHAT_TEMPLATE_DIR
    if named.is_dir():
        # transformers reads these after chat_template.jinja: a default.jinja here wins.
        paths.update({p.name.removesuffix(".jinja"): p for p in named.glob("*.jinja")})
    if not paths:
        return None
    default = paths.get("default")
    return {"default": default.read_text(encoding="utf-8") if default else None}


def _tokenizer_config_templates(folder: Path) -> dict[str, str | None]:
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    value = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {
            entry["name"]: entry["template"]
            for entry in value
            if isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("template"), str)
        }
    return {}
