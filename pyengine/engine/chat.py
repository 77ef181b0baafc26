"""Conversations as prompts: a list of {"role", "content"} messages rendered to token ids with the
tokenizer's chat template (transformers' apply_chat_template, generation prompt appended)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Message = Mapping[str, Any]


@dataclass
class ChatOptions:
    """How a conversation is rendered.

    tools: tool (function) schemas, for templates that describe them to the model.
    chat_template: a Jinja template used instead of the tokenizer's own.
    chat_template_kwargs: extra variables for the template (e.g. Qwen3's enable_thinking=False).
    add_generation_prompt: end with the template's opening of the assistant's turn.
    """

    tools: Sequence[Mapping[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True


def is_conversation(prompt: Any) -> bool:
    """A list or tuple of mappings (messages) rather than text or token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], Mapping)


def _check_messages(messages: Sequence[Any]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] has no 'role' (a non-empty str), got {role!r}")
        if "content" not in m and not m.get("tool_calls"):
            raise ValueError(f"messages[{i}] (role {role!r}) has no 'content'")


def _check_options(options: ChatOptions) -> None:
    if options.tools is not None and (not isinstance(options.tools, (list, tuple))
                                      or any(not isinstance(t, Mapping) for t in options.tools)):
        raise TypeError(f"tools must be a list of dicts (tool schemas), got {options.tools!r}")
    if options.chat_template is not None and (not isinstance(options.chat_template, str) or not options.chat_template):
        raise TypeError(f"chat_template must be a non-empty Jinja template string, got {options.chat_template!r}")
    if not isinstance(options.chat_template_kwargs, Mapping):
        raise TypeError(f"chat_template_kwargs must be a dict, got {options.chat_template_kwargs!r}")
    reserved = {"messages", "tools", "add_generation_prompt", "chat_template", "tokenize"} & set(
        options.chat_template_kwargs)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)[0]!r} (an argument of its own)")


def render_conversation(messages: Sequence[Any], tokenizer: Any, options: ChatOptions, where: Path) -> list[int]:
    """The token ids of `messages` under the chat template (`options.chat_template`, else the
    tokenizer's). ValueError: no tokenizer or no template (naming `where`, the tokenizer's
    directory), malformed messages, or a template that rejects the conversation."""
    _check_messages(messages)
    _check_options(options)
    if tokenizer is None:
        raise ValueError(f"a conversation needs a tokenizer with a chat template, and {str(where)!r} has no "
                         "tokenizer; pass Engine(..., tokenizer=DIR)")
    template = options.chat_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer in {str(where)!r} has no chat template: pass chat_template= (a Jinja "
                         "template) to Engine(...) or to the call, or send a text prompt")
    try:
        out = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tools=None if options.tools is None else [dict(t) for t in options.tools],
            chat_template=template, add_generation_prompt=options.add_generation_prompt, tokenize=True,
            return_dict=True, **dict(options.chat_template_kwargs))
    except Exception as e:  # a Jinja error, or the template's own raise_exception(...)
        raise ValueError(f"the chat template of {str(where)!r} cannot render this conversation: "
                         f"{type(e).__name__}: {e}") from e
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return [int(t) for t in ids]
