"""The tokenizer stored in a GGUF file's metadata (tokenizer.ggml.*), as a transformers fast
tokenizer: transformers builds it (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`, the
chat template included when the file has one); pyengine then drops the special tokens
transformers adds of its own beyond the file's vocabulary (its byte-level BPE class brings
"<|endoftext|>" as a default), so that every id the tokenizer produces is one of the model's,
and marks the tokens the file lists as unused (the converter's "[PAD<id>]" padding up to the
model's vocabulary size) as special, so that they decode to no text (as in llama.cpp, and as
in transformers, whose tokenizer does not have them) unless skip_special_tokens=False.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from pyengine.gguf.header import GGUFHeader

__all__ = ["load_tokenizer"]

logger = logging.getLogger(__name__)

_TOKENS = "tokenizer.ggml.tokens"
_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_tokenizer(header: GGUFHeader) -> Any:
    """The file's tokenizer, or None if the file has none (no tokenizer.ggml.model / tokens).
    ValueError naming the file if transformers cannot build it."""
    if "tokenizer.ggml.model" not in header.metadata or _TOKENS not in header.array_lengths:
        return None
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = header.path
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its "converting a GGUF tokenizer" chatter
    try:
        # from a directory holding nothing but (a link to) the file: transformers would otherwise
        # also read tokenizer files that happen to lie next to it, and mix the two
        with tempfile.TemporaryDirectory(prefix="pyengine-gguf-") as tmp:
            link = Path(tmp) / path.name
            try:
                os.symlink(path.resolve(), link)
            except OSError:  # no symlinks here (Windows without the privilege)
                link = path
            tok = AutoTokenizer.from_pretrained(str(link.parent), gguf_file=link.name)
    except Exception as e:
        model = header.get("tokenizer.ggml.model")
        raise ValueError(f"GGUF file {str(path)!r}: transformers cannot build its tokenizer "
                         f"(tokenizer.ggml.model = {model!r}): {type(e).__name__}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    tok = _without_tokens_beyond(tok, header.array_lengths[_TOKENS])
    _mark_unused_special(tok, header.get("tokenizer.ggml.token_type") or [])
    return tok


_UNUSED = 5  # llama.cpp's token type of a placeholder token


def _mark_unused_special(tok: Any, token_types: list[int]) -> None:
    from tokenizers import AddedToken

    ids = [i for i, t in enumerate(token_types) if t == _UNUSED]
    if ids:
        tokens = tok.convert_ids_to_tokens(ids)
        added = {"additional_special_tokens": [AddedToken(t, normalized=False, special=True) for t in tokens]}
        try:
            tok.add_special_tokens(added, replace_extra_special_tokens=False)
        except TypeError:  # transformers 4
            tok.add_special_tokens(added, replace_additional_special_tokens=False)


def _without_tokens_beyond(tok: Any, n: int) -> Any:
    """`tok`, rebuilt without the added tokens whose ids are >= n (the file's vocabulary)."""
    extra = {i: t.content for i, t in tok.added_tokens_decoder.items() if i >= n}
    if not extra:
        return tok
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["id"] < n]
    specials = {a: getattr(tok, a) for a in _SPECIAL_ATTRS if getattr(tok, a) not in (None, *extra.values())}
    logger.info("GGUF tokenizer: dropped %s (added by transformers, not in the file's %d tokens)",
                ", ".join(f"{t!r} ({i})" for i, t in extra.items()), n)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), **specials,
                                   chat_template=tok.chat_template, clean_up_tokenization_spaces=False,
                                   model_max_length=tok.model_max_length)
