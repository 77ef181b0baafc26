"""The model authors' generation defaults: generation_config.json's end-of-sequence ids and sampling
defaults, merged with config.json's and the tokenizer's end-of-sequence ids.

What is read follows vLLM's ``generation_config="auto"``: of the sampling fields, those the file
sets among temperature, top_k, top_p, min_p, repetition_penalty and max_new_tokens (as
max_tokens) become defaults for requests that leave them unset; ``do_sample`` is not read.
A request stops at any of the end-of-sequence ids.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyengine.sampling import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_MODES = ("auto", "ignore")

# generation_config.json field -> SamplingParams field
SAMPLING_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass
class GenerationDefaults:
    """What requests inherit from the model: the ids that end a request, and sampling defaults."""

    eos_token_ids: list[int] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> default
    source: str | None = None  # the generation_config.json read (None: none read)

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "eos_token_ids": list(self.eos_token_ids), "sampling": dict(self.sampling)}


def _token_ids(value: Any, what: str) -> list[int]:
    """An eos_token_id entry (an int or a list of ints; None: none) as a list."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in values):
        raise ValueError(f"{what}: eos_token_id must be a non-negative int or a list of them, got {value!r}")
    return list(values)


def read_generation_config(path: Path) -> tuple[list[int], dict[str, Any]]:
    """(eos ids, sampling defaults) of a generation_config.json; a malformed file or an invalid
    value is a ValueError naming the file and the field."""
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed {path}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"malformed {path}: expected a JSON object, got {type(d).__name__}")
    eos = _token_ids(d.get("eos_token_id"), str(path))
    sampling: dict[str, Any] = {}
    for name, param in SAMPLING_FIELDS.items():
        if d.get(name) is None:
            continue
        value = d[name]
        if name == "top_k" and value == 0:  # transformers' "no top-k"; SamplingParams writes it -1
            value = -1
        try:
            SamplingParams(**{param: value})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {name}={value!r} is not a valid default ({e})") from None
        sampling[param] = value
    return eos, sampling


def generation_defaults(mode: str | Path, model_dir: Path, config_eos: list[int], tokenizer: Any,
                        vocab_size: int) -> GenerationDefaults:
    """The defaults in force. mode: "auto" reads the model directory's generation_config.json when
    present, "ignore" reads none, a path names a generation_config.json (or a directory holding
    one) to read instead. The eos ids: config.json's, then generation_config.json's, then the
    tokenizer's (each once; ids outside the vocabulary are dropped with a warning)."""
    path: Path | None = None
    if isinstance(mode, Path):
        path = mode / GENERATION_CONFIG_FILE if mode.is_dir() else mode
        if not path.is_file():
            raise FileNotFoundError(f"generation_config {str(mode)!r}: no such file (nor a directory holding "
                                    f"{GENERATION_CONFIG_FILE})")
    elif mode == "auto" and model_dir.is_dir() and (model_dir / GENERATION_CONFIG_FILE).is_file():
        path = model_dir / GENERATION_CONFIG_FILE
    gen_eos, sampling = read_generation_config(path) if path is not None else ([], {})
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    eos: list[int] = []
    for t in [*config_eos, *gen_eos, *([tok_eos] if isinstance(tok_eos, int) else [])]:
        if t in eos:
            continue
        if t >= vocab_size:
            logger.warning("end-of-sequence id %d is outside the vocabulary [0, %d): not used", t, vocab_size)
            continue
        eos.append(t)
    return GenerationDefaults(eos_token_ids=eos, sampling=sampling, source=None if path is None else str(path))
