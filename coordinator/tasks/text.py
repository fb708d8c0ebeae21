"""Prompt text ↔ token ids for every coordinator role, without torch.

The API process tokenises the prompts it signs into jobs and decodes completions to score them; it must not load
torch (transformers' tokenizer classes import it), so every role uses this one codec built on the Hugging Face
``tokenizers`` library from the model folder's ``tokenizer.json``. Jobs, rewards, training and evaluation then
agree on the ids by construction, whichever process computes them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

#: End-of-turn tokens of common chat formats (Qwen/ChatML, GPT-2 style, Llama 3): a completion stops at any.
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


class TokenizerMissing(FileNotFoundError):
    """The model folder has no tokenizer.json (a slow-only tokenizer)."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class TextCodec:
    tokenizer: Any  # tokenizers.Tokenizer
    stop_ids: list[int]
    pad_id: int
    vocab_size: int
    clean_up_spaces: bool

    @classmethod
    def from_folder(cls, folder: Path) -> TextCodec:
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise TokenizerMissing(f"{folder} has no tokenizer.json; echo-swarm needs a fast (tokenizers) tokenizer: "
                                   f"save one with transformers' AutoTokenizer(...).save_pretrained(folder)")
        tok = Tokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}

        def tid(text: str | None) -> int | None:
            return None if text is None else tok.token_to_id(text)

        eos = tid(_token_text(cfg.get("eos_token")))
        stops = {eos} if eos is not None else set()
        stops.update(i for i in (tid(t) for t in STOP_TOKENS) if i is not None)
        pad = tid(_token_text(cfg.get("pad_token")))
        model_cfg_path = folder / "config.json"
        vocab = tok.get_vocab_size(with_added_tokens=True)
        if model_cfg_path.exists():
            vocab = int(json.loads(model_cfg_path.read_text()).get("vocab_size", vocab))
        return cls(tokenizer=tok, stop_ids=sorted(stops), pad_id=pad if pad is not None else (eos or 0),
                   vocab_size=vocab, clean_up_spaces=bool(cfg.get("clean_up_tokenization_spaces", False)))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        text = str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
        if self.clean_up_spaces:  # transformers' clean_up_tokenization, for tokenizers that ask for it
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text


class _Prompted(Protocol):
    @property
    def prompt(self) -> str: ...


@dataclass
class PromptTokens:
    """The token ids of the task's training prompts, encoded once each: the API signs them into jobs and the
    learner trains on them, so both roles must use this same encoding."""

    codec: TextCodec
    items: Sequence[_Prompted]
    _cache: dict[int, list[int]] = field(default_factory=dict)

    def __call__(self, prompt_id: int) -> list[int]:
        if prompt_id not in self._cache:
            self._cache[prompt_id] = self.codec.encode(self.items[prompt_id].prompt)
        return self._cache[prompt_id]
