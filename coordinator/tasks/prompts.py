"""Prompt formatting without torch: plain templates, or the model's own chat template rendered with jinja2.

transformers' ``apply_chat_template`` imports torch (through its tokenizer classes), which the coordinator's API
process must not load. This module renders the same template the same way — the ``chat_template`` of the model
folder (``chat_template.jinja``, else ``chat_template.json``, else ``tokenizer_config.json``), in a sandboxed jinja2
environment with ``trim_blocks``/``lstrip_blocks``, the ``raise_exception`` and ``strftime_now`` helpers, a
``tojson`` that does not escape HTML, ``messages``, ``add_generation_prompt=True`` and the special tokens
(``bos_token``, ``eos_token``, …) — and checks that the job's prompt tokens are the template's tokens.

The rendered text already holds the template's special tokens, and ``apply_chat_template(tokenize=True)`` encodes
it with ``add_special_tokens=False``. Every role encodes a prompt with :meth:`TextCodec.encode`, which lets the
tokenizer's post-processor add its tokens (a Llama-style BOS); so when the post-processor adds a prefix that the
rendered text already starts with, the prompt text is stored without it, and ``encode`` puts it back once.
:func:`aligned_prompts` verifies ``codec.encode(text) == encode(rendered, add_special_tokens=False)`` for every
prompt and refuses a tokenizer for which that cannot hold.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from coordinator.errors import TaskError
from coordinator.tasks.text import TextCodec, TokenizerMissing

Message = dict[str, Any]

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(TaskError):
    """The model folder has no usable chat template, or rendering it failed."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(folder: Path, cfg: dict[str, Any]) -> str:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    json_file = folder / "chat_template.json"
    template: Any = None
    if json_file.exists():
        template = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
    if template is None:
        template = cfg.get("chat_template")
    if isinstance(template, list):  # several named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ChatTemplateError(f"{folder} has no chat template (no chat_template.jinja, and tokenizer_config.json "
                                f"has no 'chat_template'); use a plain prompt_template (chat_template = false), or "
                                f"a model folder of an instruct model")
    return template


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not parse: {exc}") from None
        self.source = source
        self.special_tokens = dict(special_tokens)

    @classmethod
    def from_folder(cls, folder: Path) -> ChatTemplate:
        folder = Path(folder)
        cfg_path = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
        special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(cfg.get(k))) is not None}
        return cls(_template_source(folder, cfg), special)

    def render(self, messages: Sequence[Message]) -> str:
        import jinja2

        try:
            return str(self.template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                             add_generation_prompt=True, **self.special_tokens))
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from None


def chat_messages(user: str | Sequence[Message], system_prompt: str | None) -> list[Message]:
    """The conversation of one prompt: the optional system message, then the user's text (or the dataset's own
    messages, given as a list of {role, content})."""
    if isinstance(user, str):
        messages: list[Message] = [{"role": "user", "content": user}]
    else:
        messages = [dict(m) for m in user]
    if system_prompt is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def aligned_prompts(rendered: list[str], codec: TextCodec) -> list[str]:
    """The texts whose ``codec.encode`` is each rendered prompt's ``encode(add_special_tokens=False)`` (what
    ``apply_chat_template(tokenize=True)`` gives): the post-processor's prefix is taken off a text that already
    starts with it. Raises :class:`ChatTemplateError` when no such text exists for some prompt."""
    tok = codec.tokenizer
    probe_plain = tok.encode("x", add_special_tokens=False).ids
    probe_full = tok.encode("x", add_special_tokens=True).ids
    start = next((i for i in range(len(probe_full)) if probe_full[i:i + len(probe_plain)] == probe_plain), None)
    if start is None:
        raise ChatTemplateError("cannot tell which tokens this tokenizer's post-processor adds")
    prefix_ids, suffix_ids = probe_full[:start], probe_full[start + len(probe_plain):]
    if suffix_ids:
        raise ChatTemplateError(f"this tokenizer appends {tok.decode(suffix_ids, skip_special_tokens=False)!r} to "
                                f"every encoded text, so a prompt would not end where the chat template ends it; "
                                f"remove the suffix from tokenizer.json's post_processor")
    prefix = str(tok.decode(prefix_ids, skip_special_tokens=False)) if prefix_ids else ""
    texts = [t[len(prefix):] if prefix and t.startswith(prefix) else t for t in rendered]
    want = [e.ids for e in tok.encode_batch(rendered, add_special_tokens=False)]
    got = [e.ids for e in tok.encode_batch(texts, add_special_tokens=True)]
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        if w != g:
            raise ChatTemplateError(f"prompt {i}: the tokenizer adds {prefix!r} to every text but the chat template "
                                    f"does not start with it, so the job's tokens could not equal the template's; "
                                    f"use a template that starts with the BOS token, or chat_template = false")
    return texts


class ChatFormatter:
    """A model folder's chat template and tokenizer together: what a task needs to turn user messages into the
    prompt texts its jobs carry (rendered, then aligned with :class:`TextCodec` by :func:`aligned_prompts`)."""

    def __init__(self, folder: Path) -> None:
        self.chat = ChatTemplate.from_folder(folder)
        try:
            self.codec = TextCodec.from_folder(folder)
        except TokenizerMissing as exc:
            raise TaskError(str(exc)) from None

    def format(self, users: Sequence[str | Sequence[Message]], system_prompt: str | None) -> list[str]:
        return aligned_prompts([self.chat.render(chat_messages(u, system_prompt)) for u in users], self.codec)
