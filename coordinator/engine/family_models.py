"""Small random-initialised models of the families operators bring, each with its family's real config shape and a
tokenizer of the family's kind built here (no hub): the test bed for GGUF export beyond Qwen2 (bench/families.py,
tests/integration/test_families.py).

Shapes are scaled down but keep what makes a family different for llama.cpp: Qwen3's q/k norms and explicit head
width, Gemma 3's embedding scaling, GeGLU, sliding-window layers and (1 + w) norms, Phi-3's fused qkv and gate/up
projections, OLMo 2's post-norms and full-width q/k norms, Llama 3.1's rope scaling (a rope_freqs tensor in GGUF),
tied and untied heads. Width 256 and an intermediate size of 512 so every matrix row is a multiple of 256 and the
k-quants (q4_K_M, q6_K) apply to all of them.

Tokenizers: byte-level BPE trained on a small fixed corpus, split by the family's pre-tokenizer regex (the regex
llama.cpp implements under the name in :attr:`Family.pre`), for Mistral a Llama-2-style ``tokenizer.json`` (a
"▁"-normalised BPE with byte fallback), and for Gemma 2 a real SentencePiece ``tokenizer.model`` trained on the same
corpus by the ``sentencepiece`` trainer (what llama.cpp's Gemma 2 converter reads). Because the regex is ours, the GGUF's pre-tokenizer
name is known without fingerprinting the tokenizer (coordinator.publish.hf_convert).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp) in the form the family's tokenizer.json states them.
REGEXES = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
REGEXES["dbrx"] = REGEXES["llama-bpe"]  # cl100k's regex (OLMo 2's and Phi-4's vocabularies); llama.cpp: "same as llama3"

WIDTH = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096, "initializer_range": 0.05}


@dataclass(frozen=True)
class Family:
    """One model family: its Hugging Face architecture, its tokenizer's kind and the config keys of its shape."""

    name: str
    label: str
    architecture: str
    # llama.cpp's pre-tokenizer name ("llama-bpe", "qwen2", "smollm", "dbrx"); "spm": a Llama-2-style
    # tokenizer.json; "sentencepiece": a real SentencePiece tokenizer.model (Gemma's)
    pre: str
    config: dict[str, Any] = field(default_factory=dict)
    tokenizer_class: str = "PreTrainedTokenizerFast"
    bos: bool = False  # the family's tokenizer adds <bos> at the start
    #: every linear module of a layer, by the family's names (LoRA targets that touch every kind of projection)
    linear: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


FAMILIES: tuple[Family, ...] = (
    Family("qwen2", "Qwen2 (reference)", "Qwen2ForCausalLM", "qwen2",
           {"tie_word_embeddings": True, "rope_theta": 1000000.0, "use_sliding_window": False}),
    Family("llama3", "Llama 3.x", "LlamaForCausalLM", "llama-bpe",
           {"tie_word_embeddings": False, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 1024}}, bos=True),
    Family("qwen3", "Qwen3", "Qwen3ForCausalLM", "qwen2",
           {"tie_word_embeddings": True, "head_dim": 128, "rope_theta": 1000000.0}),
    Family("gemma3", "Gemma 3", "Gemma3ForCausalLM", "llama-bpe",
           # six layers: Gemma 3's pattern of five sliding-window layers, then one global (llama.cpp assumes it)
           {"tie_word_embeddings": True, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 16,
            "num_hidden_layers": 6, "hidden_activation": "gelu_pytorch_tanh"}, bos=True),
    Family("gemma2", "Gemma 2", "Gemma2ForCausalLM", "sentencepiece",
           # local and global layers alternating (Gemma 2's pattern, llama.cpp's too); soft-capping scaled to these
           # small logits so that both tanh caps bend them (Gemma 2's own 50 and 30 would leave them linear)
           {"tie_word_embeddings": True, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 16,
            "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
           tokenizer_class="GemmaTokenizer", bos=True),
    Family("mistral", "Mistral", "MistralForCausalLM", "spm",
           {"tie_word_embeddings": False, "rope_theta": 1000000.0, "sliding_window": None},
           tokenizer_class="LlamaTokenizerFast", bos=True),
    Family("phi3", "Phi-3 / Phi-4", "Phi3ForCausalLM", "dbrx",
           {"tie_word_embeddings": False, "rope_theta": 250000.0, "num_key_value_heads": 4},
           tokenizer_class="GPT2Tokenizer", linear=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    Family("smollm2", "SmolLM2", "LlamaForCausalLM", "smollm",
           {"tie_word_embeddings": True, "rope_theta": 100000.0}),
    Family("olmo2", "OLMo 2", "Olmo2ForCausalLM", "dbrx",
           {"tie_word_embeddings": False, "rope_theta": 500000.0}),
)
BY_NAME = {f.name: f for f in FAMILIES}


def unknown_family(name: str) -> str:
    """The one line refusing a family no model is built for here, naming the ones there are."""
    return f"{name!r} is not a model family built here; choose one of {', '.join(BY_NAME)}"

#: A small fixed corpus the tokenizers are trained on: words, digits, code, punctuation, non-Latin scripts.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2026 and we're training 12,345 models.",
    "def add(a, b):\n    return a + b  # two-number addition\n\nprint(add(17, 25))",
    "Question: what is 38 + 47? Answer: 85. They'll say I've checked it, you'd agree.",
    "Ünïcödé tëxt, naïve café — «quotes», 日本語のテキスト, 中文文本, русский текст, emoji 🦙🚀.",
    "   indented    spaces\tand\ttabs\n\nnew lines\r\nand Windows line ends.",
    "learning rate 1e-6, 0.5 B parameters, q4_K_M quantisation; GRPO with group size 8.",
]


def _bpe_tokenizer(family: Family, vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    # tiny_model loads torch and transformers: only a family model being built needs them
    from coordinator.engine.tiny_model import byte_level_alphabet

    tok = Tokenizer(models.BPE())
    if family.pre == "smollm":  # digits one by one, then GPT-2's own regex (SmolLM's tokenizer.json)
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(REGEXES[family.pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=byte_level_alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok, specials


def _spm_tokenizer(vocab_size: int) -> Any:
    """A Llama-2-style tokenizer.json: spaces as "▁", BPE over characters, unknown bytes as <0xNN> tokens."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    probe = Tokenizer(models.BPE())
    probe.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 259, show_progress=False)
    probe.train_from_iterator(CORPUS * 4, trainer=trainer)
    learned = probe.get_vocab()
    merges: list[tuple[str, str]] = [(m[0], m[1]) for m in (
        x.split(" ", 1) if isinstance(x, str) else x for x in json.loads(probe.to_str())["model"]["merges"])]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for text, _ in sorted(learned.items(), key=lambda kv: kv[1]):
        vocab.setdefault(text, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


SENTENCEPIECE_MODEL = "tokenizer.model"


def sentencepiece_model(vocab_size: int = 640) -> bytes:
    """A Gemma-style SentencePiece model trained here on :data:`CORPUS` by the ``sentencepiece`` trainer: BPE with
    byte fallback, digits split, no dummy prefix, whitespace kept as is, Gemma's special tokens and ids (<pad> 0,
    <eos> 1, <bos> 2, <unk> 3). One thread, so the same bytes every time."""
    import io

    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_writer=out, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, split_digits=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, normalization_rule_name="identity", character_coverage=1.0,
        hard_vocab_limit=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
        bos_piece="<bos>", unk_piece="<unk>", num_threads=1, minloglevel=2)
    return out.getvalue()


def _sentencepiece_tokenizer(family: Family, vocab_size: int) -> Any:
    """transformers' tokenizer of the SentencePiece model, as transformers builds it from a folder holding only
    tokenizer.model (its SentencePiece converter), the way a Gemma checkpoint's tokenizer is loaded."""
    import json
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="echo-swarm-spm-") as tmp:
        (Path(tmp) / SENTENCEPIECE_MODEL).write_bytes(sentencepiece_model(vocab_size))
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": family.tokenizer_class,
                                                                     "add_bos_token": family.bos}))
        return AutoTokenizer.from_pretrained(tmp)


def build_family_tokenizer(family: Family, vocab_size: int = 640) -> Any:
    """The family's tokenizer as a transformers fast tokenizer (saved with the model by :func:`build_family_model`)."""
    from transformers import PreTrainedTokenizerFast

    if family.pre == "sentencepiece":
        return _sentencepiece_tokenizer(family, vocab_size)

    if family.pre == "spm":
        tok = _spm_tokenizer(vocab_size)
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                       pad_token="</s>", add_bos_token=family.bos, add_eos_token=False)
    tok, (bos, eos) = _bpe_tokenizer(family, vocab_size)
    # as Llama 3's and cl100k's own tokenizer configs say (llama.cpp cleans up spaces before punctuation for their
    # pre-tokenizer names; transformers 5 ignores the flag for BPE: docs/benchmarks.md "Model families")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos,
                                   clean_up_tokenization_spaces=family.pre in ("llama-bpe", "dbrx"))


def build_family_model(family: Family, folder: Path, *, seed: int = 0) -> Path:
    """Write a random-initialised model of ``family`` (config, safetensors, tokenizer files) into ``folder``."""
    import json

    import torch
    import transformers

    tok = build_family_tokenizer(family)
    n_vocab = len(tok)
    keys = {**WIDTH, "vocab_size": n_vocab, **family.config, "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    prefix = family.architecture.removesuffix("ForCausalLM")
    config_class = getattr(transformers, f"{prefix}TextConfig", None) or getattr(transformers, f"{prefix}Config")
    config = config_class(**keys)
    config.architectures = [family.architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, family.architecture)(config).eval()
    with torch.no_grad():  # norms away from 1 (and biases away from 0) so the export must carry each of them
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
    if family.pre == "sentencepiece":  # the model file itself, as a Gemma checkpoint ships it
        (folder / SENTENCEPIECE_MODEL).write_bytes(sentencepiece_model())
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    tcfg["tokenizer_class"] = family.tokenizer_class
    tcfg["add_bos_token"] = family.bos
    tcfg_path.write_text(json.dumps(tcfg, indent=2))
    return folder
