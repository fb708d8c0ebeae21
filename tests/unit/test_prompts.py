"""The chat-template path, rendered without transformers: the prompt tokens a job carries (TextCodec.encode of the
task's prompt text) equal transformers' apply_chat_template(tokenize=True), for a ChatML tokenizer and for one
whose post-processor adds a BOS that the template also writes. Tokenizers are built locally from the tiny model's
tokenizer folder; nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import DatasetTaskConfig, load_config
from coordinator.errors import TaskError
from coordinator.tasks.builtin import DatasetTask
from coordinator.tasks.factory import make_task
from coordinator.tasks.prompts import ChatTemplate, ChatTemplateError
from coordinator.tasks.text import TextCodec

CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n\n{{ m['content'] | trim }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n\n{% endif %}"
)
ROWS = [{"question": q, "answer": a} for q, a in [("What is 2 + 2?", "4"), ("Name a <b>bold</b> colour", "red"),
                                                  ("Café, naïve, 東京?", "x"), ("  spaced  ", "y")]]


def tokenizer_folder(tiny: Path, dest: Path, template: str, *, bos_prefix: bool) -> Path:
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.processors import TemplateProcessing

    dest.mkdir()
    shutil.copy(tiny / "config.json", dest / "config.json")
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|im_start|>", "<|im_end|>", "<|start|>", "<|end|>", "<|bos|>")])
    cfg = json.loads((tiny / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    if bos_prefix:  # Llama-style: every encoded text starts with <|bos|>, and the template writes it too
        bos = tok.token_to_id("<|bos|>")
        tok.post_processor = TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A $B",
                                                special_tokens=[("<|bos|>", bos)])
        cfg["bos_token"] = "<|bos|>"
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


def hf_ids(folder: Path, messages: list[dict[str, str]]) -> list[int]:
    from transformers import AutoTokenizer

    out: Any = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages, add_generation_prompt=True,
                                                                               tokenize=True)
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return list(ids)


def hf_text(folder: Path, messages: list[dict[str, str]]) -> str:
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages, add_generation_prompt=True,
                                                                              tokenize=False))


@pytest.mark.parametrize(("template", "bos_prefix"), [(CHATML, False), (LLAMA_LIKE, True)],
                         ids=["chatml", "bos-prefix"])
@pytest.mark.parametrize("system", [None, "Answer with a number."])
def test_job_prompt_tokens_equal_apply_chat_template(tiny_model_dir: Path, tmp_path: Path, template: str,
                                                      bos_prefix: bool, system: str | None) -> None:
    folder = tokenizer_folder(tiny_model_dir, tmp_path / "tok", template, bos_prefix=bos_prefix)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    task = DatasetTask(DatasetTaskConfig(train_path=data, heldout_path=data, prompt_column="question",
                                         prompt_template="Question: {prompt}", chat_template=True,
                                         system_prompt=system, tokenizer_path=folder))
    codec = TextCodec.from_folder(folder)
    for item in task.train:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": f"Question: {item.source}"}]
        want = hf_ids(folder, messages)
        assert codec.encode(item.prompt) == want  # what service.prompt_tokens signs into the job
        assert ChatTemplate.from_folder(folder).render(messages) == hf_text(folder, messages)
        if bos_prefix:
            assert want.count(codec.tokenizer.token_to_id("<|bos|>")) == 1  # once, not twice
        assert item.source is not None and item.source.strip() in codec.decode(want)


def test_model_path_is_the_default_tokenizer_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tokenizer_folder(tiny_model_dir, tmp_path / "model", CHATML, bos_prefix=False)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = load_config(None, {"model.path": str(folder), "task": {
        "type": "dataset", "train_path": str(data), "prompt_column": "question", "heldout_size": 1,
        "chat_template": True}})
    task = make_task(config.task, config.model.path)
    assert all(it.prompt.endswith("<|im_start|>assistant\n") for it in task.train)


def test_a_conversation_column_is_rendered_as_is(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tokenizer_folder(tiny_model_dir, tmp_path / "tok", CHATML, bos_prefix=False)
    convo = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": convo, "answer": "1"}) + "\n")
    task = DatasetTask(DatasetTaskConfig(train_path=data, heldout_path=data, chat_template=True,
                                         system_prompt="ignored: the conversation has its own",
                                         tokenizer_path=folder))
    assert TextCodec.from_folder(folder).encode(task.train[0].prompt) == hf_ids(folder, convo)
    assert task.train[0].source == "U"


def test_template_errors_are_typed(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tokenizer_folder(tiny_model_dir, tmp_path / "tok", CHATML, bos_prefix=False)
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        ChatTemplate.from_folder(folder).render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTemplate.from_folder(tiny_model_dir)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}", {})
    assert issubclass(ChatTemplateError, TaskError)


def test_a_template_without_the_bos_its_tokenizer_adds_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tokenizer_folder(tiny_model_dir, tmp_path / "tok", CHATML, bos_prefix=True)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(ChatTemplateError, match="does not start with it"):
        DatasetTask(DatasetTaskConfig(train_path=data, heldout_path=data, prompt_column="question",
                                      chat_template=True, tokenizer_path=folder))


def test_the_sandbox_holds(tiny_model_dir: Path) -> None:
    evil = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        evil.render([{"role": "user", "content": "x"}])


def test_the_chat_path_and_rewards_load_no_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The API process builds the task and scores results: neither may import torch (nor transformers)."""
    import importlib.util
    import subprocess
    import sys

    rewards = "[{'name': 'math'}, {'name': 'format'}]" if importlib.util.find_spec("math_verify") else \
        "[{'name': 'format'}]"
    folder = tokenizer_folder(tiny_model_dir, tmp_path / "tok", CHATML, bos_prefix=False)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    probe = ("import sys; from coordinator.config import DatasetTaskConfig; from coordinator.tasks.factory import make_task; "
             f"t = make_task(DatasetTaskConfig(train_path={str(data)!r}, heldout_size=1, prompt_column='question', "
             f"chat_template=True, rewards={rewards}), {str(folder)!r}); "
             "t.score(t.train[:1], ['\\\\boxed{4}']); "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
