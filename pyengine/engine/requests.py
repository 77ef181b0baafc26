"""Requests on their way in: prompt -> token ids, validation, end-of-sequence and stop ids, cache
salts, request ids; and the table of live requests the engine keeps.

Everything here checks before anything changes: a bad request raises ValueError/TypeError
naming the value and leaves the engine as it was.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from pyengine.engine.chat import ChatOptions, is_conversation, render_conversation
from pyengine.engine.detokenizer import IncrementalDetokenizer
from pyengine.engine.generation_config import GenerationDefaults
from pyengine.engine.outputs import RequestMetrics, RequestRecord
from pyengine.models import ModelConfig
from pyengine.sampling import SamplingParams
from pyengine.sampling.guided import GrammarBackend

# text, token ids, or a conversation (a list of {"role", "content"} messages)
Prompt = str | Sequence[int] | torch.Tensor | Sequence[dict[str, Any]]
RequestId = int | str

_MAX_CORE_ID = 2**63 - 1
# Finished ids a caller chose that are remembered (abort_request on one returns False rather than
# "unknown"): the latest this many. Ids the engine assigned need no memory: every one below the
# next to be assigned was in use once.
FINISHED_IDS_KEPT = 4096


def cache_salt_key(salt: str | bytes | None) -> int:
    """A stable non-zero 64-bit key for a cache salt (0 means no salt)."""
    if salt is None:
        return 0
    data = salt.encode() if isinstance(salt, str) else bytes(salt)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") or 1


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(directory: Path, required: bool = False) -> Any:
    """The directory's tokenizer (transformers' AutoTokenizer), or None if it has none. With
    `required` (a tokenizer directory the caller named) the directory must exist and hold one.
    A tokenizer that fails to load is a ValueError naming the directory."""
    if required and not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "does not exist"
        raise FileNotFoundError(f"tokenizer directory {str(directory)!r} {what}")
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        if required:
            raise FileNotFoundError(f"no {' or '.join(TOKENIZER_FILES)} in tokenizer directory {str(directory)!r}")
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:
        raise ValueError(f"cannot load the tokenizer in {str(directory)!r}: {type(e).__name__}: {e}") from e


def prompt_token_ids(prompt: Prompt, tokenizer: Any, model_dir: Path, chat: ChatOptions | None = None) -> list[int]:
    """A prompt (text, token ids, a 1-D integer tensor, or a conversation rendered with the chat
    template under `chat`'s options) as a list of token ids."""
    if is_conversation(prompt):
        return render_conversation(prompt, tokenizer, chat or ChatOptions(), model_dir)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"a text prompt needs a tokenizer, and {str(model_dir)!r} has none; pass token ids, "
                             f"or a tokenizer directory: Engine(..., tokenizer=DIR)")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
        return prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        bad = next((t for t in prompt if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise TypeError(f"prompt token ids must be ints, got {bad!r}")
        return list(prompt)
    raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")


@dataclass
class NewRequest:
    """A checked request, ready for the batch manager (see RequestTable.prepare)."""

    request_id: RequestId
    core_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    end_id: int                 # the model's first EOS id (-1: none or ignore_eos)
    core_stop_ids: list[int]    # the stop ids the C++ core checks: the user's, then the other EOS ids
    stop_ids: list[int]         # what min_tokens masks: every EOS id, then the user's
    priority: float
    cache_salt_key: int
    auto_id: bool = False       # the engine assigned request_id
    matcher: Any = None         # guided decoding: a fresh grammar matcher


class RequestTable:
    """The live requests, by the id the C++ core knows them under (`core_id`).

    Callers name requests by int or str ids. An int id is its own core id; a str id gets a
    negative core id, so the two kinds never collide. Ids the engine assigns are ints."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any, tokenizer_dir: Path,
                 generation: GenerationDefaults | None = None, max_seq_len: int | None = None,
                 chat_template: str | None = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.model_dir = tokenizer_dir  # named in errors about the tokenizer
        # end-of-sequence ids and sampling defaults (generation_config.json); without one given,
        # config.json's end-of-sequence ids and no defaults
        self.generation = generation or GenerationDefaults(eos_token_ids=list(model_config.eos_token_ids))
        self.max_seq_len = max_seq_len or model_config.max_position_embeddings
        self.chat_template = chat_template  # Engine(chat_template=...): instead of the tokenizer's
        self._grammars: GrammarBackend | None = None  # made for the first constrained request
        self.records: dict[int, RequestRecord] = {}
        self._core_ids: dict[RequestId, int] = {}
        self._finished: OrderedDict[RequestId, None] = OrderedDict()
        self._next_auto_id = 0  # ids below it were all in use once (assigned, or skipped as in use)
        self._str_ids = itertools.count(1)
        self.num_owed_prompt_logprobs = 0  # live requests still owed prompt logprobs

    # ---- ids ----------------------------------------------------------------------------------

    def core_id(self, request_id: RequestId) -> int | None:
        """The core id of a live request, or None."""
        return self._core_ids.get(request_id)

    def was_finished(self, request_id: RequestId) -> bool:
        """True for a request that finished: any id the engine assigned, or one of the latest
        FINISHED_IDS_KEPT the caller chose (its id may be given again)."""
        if request_id in self._core_ids:
            return False
        return self._was_assigned(request_id) or request_id in self._finished

    def _was_assigned(self, request_id: RequestId) -> bool:
        """An int id below the next the engine assigns: in use once (assigned, or the caller's)."""
        return isinstance(request_id, int) and not isinstance(request_id, bool) and 0 <= request_id < self._next_auto_id

    def _assign(self, request_id: RequestId | None, in_core: Any) -> tuple[RequestId, int]:
        if request_id is None:
            rid = self._next_auto_id
            while rid in self._core_ids or in_core(rid):
                rid += 1
            return rid, rid
        if isinstance(request_id, bool) or not isinstance(request_id, (int, str)):
            raise TypeError(f"request_id must be an int or a str, got {request_id!r}")
        if request_id in self._core_ids:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(request_id, int):
            if not 0 <= request_id <= _MAX_CORE_ID:
                raise ValueError(f"request_id must be in [0, 2**63), got {request_id}")
            return request_id, request_id
        core = -next(self._str_ids)
        while in_core(core):
            core = -next(self._str_ids)
        return request_id, core

    # ---- admission ----------------------------------------------------------------------------

    def prepare(self, prompt: Prompt, params: SamplingParams | None, request_id: RequestId | None,
                priority: float, cache_salt: str | bytes | None, in_core: Any,
                chat: ChatOptions | None = None) -> NewRequest:
        """Checks a request and resolves its ids; changes nothing. `in_core(core_id)` says
        whether the batch manager already holds a request under that id. The request's params
        are `params` with the generation defaults filled into the fields it leaves unset."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if chat is not None and chat.chat_template is None and self.chat_template is not None:
            chat = ChatOptions(chat.tools, self.chat_template, chat.chat_template_kwargs, chat.add_generation_prompt)
        elif chat is None and self.chat_template is not None:
            chat = ChatOptions(chat_template=self.chat_template)
        ids = prompt_token_ids(prompt, self.tokenizer, self.model_dir, chat)
        params = self._with_defaults(params, len(ids))
        auto_id = request_id is None
        request_id, core_id = self._assign(request_id, in_core)
        vocab = self.model_config.vocab_size
        bad_stop = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad_stop is not None:
            raise ValueError(f"stop_token_ids entry {bad_stop} is outside the vocabulary [0, {vocab})")
        if not isinstance(priority, (int, float)) or isinstance(priority, bool) or not math.isfinite(priority):
            raise ValueError(f"priority must be a finite number, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, (str, bytes)):
            raise TypeError(f"cache_salt must be a str or bytes, got {type(cache_salt).__name__}")
        eos = [] if params.ignore_eos else list(self.generation.eos_token_ids)
        matcher = None
        if params.guided_decoding is not None:
            backend = self.grammar_backend()
            # its end-of-sequence ids end the grammar (ignore_eos: the grammar's completion ends the request)
            matcher = backend.matcher(backend.compile(params.guided_decoding), self.generation.eos_token_ids,
                                      params.guided_decoding.kind)
        return NewRequest(request_id=request_id, core_id=core_id, prompt_token_ids=ids, params=params,
                          end_id=eos[0] if eos else -1, core_stop_ids=list(params.stop_token_ids) + eos[1:],
                          stop_ids=eos + list(params.stop_token_ids), priority=float(priority),
                          cache_salt_key=cache_salt_key(cache_salt), auto_id=auto_id, matcher=matcher)

    def grammar_backend(self) -> GrammarBackend:
        """The engine's grammar compiler (built on first use: it reads the whole vocabulary)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError(f"guided decoding needs the model's tokenizer, and {str(self.model_dir)!r} has "
                                 "none; pass Engine(..., tokenizer=DIR)")
            self._grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size)
        return self._grammars

    def _with_defaults(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """params with the generation defaults in its unset fields (itself when none apply). A
        default max_tokens is capped at what max_seq_len leaves after the prompt, as vLLM does
        (a default must not make a request invalid)."""
        defaults = {k: v for k, v in self.generation.sampling.items() if not params.is_set(k)}
        if not defaults:
            return params
        if "max_tokens" in defaults:
            defaults["max_tokens"] = max(1, min(defaults["max_tokens"], self.max_seq_len - prompt_len))
            if params.min_tokens > defaults["max_tokens"]:
                defaults["max_tokens"] = params.min_tokens  # (the core then names the length problem)
        return params.with_defaults(defaults)

    def add(self, new: NewRequest, new_seed: Callable[[], int], arrival_time: float) -> RequestRecord:
        """Records a request the batch manager has accepted; `new_seed()` gives the seed of a
        request that set none."""
        rec = RequestRecord(
            request_id=new.request_id, core_id=new.core_id, prompt_token_ids=new.prompt_token_ids,
            params=new.params, seed=new.params.seed if new.params.seed is not None else new_seed(),
            stop_ids=new.stop_ids, detokenizer=IncrementalDetokenizer(self.tokenizer, new.params.skip_special_tokens),
            metrics=RequestMetrics(arrival_time=arrival_time), matcher=new.matcher)
        self.records[new.core_id] = rec
        self._core_ids[new.request_id] = new.core_id
        if new.auto_id:
            self._next_auto_id = new.request_id + 1
        self._finished.pop(new.request_id, None)
        self.num_owed_prompt_logprobs += rec.wants_prompt_logprobs
        return rec

    def remove(self, core_id: int, finished: bool = True) -> RequestRecord:
        """Forgets a request: it finished (remembered as such), or it is withdrawn unseen."""
        rec = self.records.pop(core_id)
        del self._core_ids[rec.request_id]
        self.num_owed_prompt_logprobs -= rec.wants_prompt_logprobs
        if finished and not self._was_assigned(rec.request_id):  # (those need no memory)
            self._finished[rec.request_id] = None
            while len(self._finished) > FINISHED_IDS_KEPT:
                self._finished.popitem(last=False)
        return rec

    def __contains__(self, core_id: int) -> bool:
        return core_id in self.records

    def __len__(self) -> int:
        return len(self.records)
