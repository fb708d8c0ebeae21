"""Writing policy snapshots as GGUF, the file format llama.cpp loads.

Two routes, chosen per model by :func:`route`:
- Qwen2 and Llama models whose file this module writes exactly (no rope scaling, a pre-tokenizer regex it names)
  are written here with the ``gguf`` package's writer, streamed from the learner's state a block of rows at a time,
  whole (:func:`write_model_gguf`) or as a LoRA adapter on top of a base GGUF (:func:`write_lora_gguf`). These files
  are what every earlier version of the project published, byte for byte.
- Every other supported family (:data:`FAMILIES`: Llama 3.1's rope scaling, SmolLM2, Qwen3, Gemma 2 and 3, Mistral,
  Phi-3/4, OLMo 2) is written by llama.cpp's own converter, vendored from the llama.cpp clients run
  (coordinator.publish.hf_convert), from the version's folder; its LoRA adapters by llama.cpp's own adapter
  converter from the version's peft files (:func:`write_adapter_gguf`). A model of neither is refused at start-up
  (coordinator.launch.preflight) in one line naming what is supported.

Two details llama.cpp silently depends on (this module's route):
- Llama's HF q/k projections are stored permuted for the "rotate half" rope; llama.cpp's Llama rope pairs
  adjacent dimensions, so q and k (and a LoRA's B matrices on them) are permuted back. Qwen2 uses the NEOX
  rope in llama.cpp and needs no permutation.
- ``tokenizer.ggml.bos_token_id`` must be written: without it llama.cpp assumes token 11 is BOS.

Precisions: f32 and f16 are written by either route (f16: matrices in f16, norms and biases in f32, as llama.cpp's
converter does). The quantised ones — q8_0, q6_K, q5_K_M, q4_K_M, q4_0 — are made from that f16 file by llama.cpp's
own quantiser (coordinator.publish.quantise), exactly as a volunteer's llama.cpp would make them: no quantisation
code of ours, and the file a client runs is the file the verifier recomputes with (coordinator.engine.llama_verifier).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from coordinator.publish.hf_convert import convert, convert_lora, pre_tokenizer_name
from coordinator.publish.quantise import QUANTISED, quantise
from shared.llama_files import gguf_name

# numpy and gguf are imported where a file is written: every role process imports this module, and only the learner
# ever writes GGUF (the API process stays light)
if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)
# the writer logs every file it writes at INFO: one line per tensor file per published version
logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)

Precision = Literal["f32", "f16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_0"]
PRECISIONS: tuple[str, ...] = ("f32", "f16", *QUANTISED)
#: The architectures this module writes itself (and their LoRA adapters), with their GGUF architecture.
ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
#: Every architecture a version can be published as GGUF for, with the families it serves; each was measured end to
#: end (bench/families.py, docs/benchmarks.md "Model families"). All but Qwen2 go to llama.cpp's converter
#: (coordinator.publish.hf_convert) whenever this module's writer does not apply (:func:`route`).
FAMILIES = {
    "Qwen2ForCausalLM": "Qwen2, Qwen2.5",
    "LlamaForCausalLM": "Llama 2, Llama 3.x, SmolLM2",
    "Qwen3ForCausalLM": "Qwen3",
    "Gemma2ForCausalLM": "Gemma 2",
    "Gemma3ForCausalLM": "Gemma 3",
    "MistralForCausalLM": "Mistral",
    "Phi3ForCausalLM": "Phi-3, Phi-4",
    "Olmo2ForCausalLM": "OLMo 2",
}
CONVERTED = frozenset(FAMILIES) - {"Qwen2ForCausalLM"}
#: The pre-tokenizers this module's own writer names (anything else goes to the converter).
_WRITER_PRE = ("default", "llama-bpe", "qwen2", "gpt-2")

# HF module name (inside model.layers.N.) → GGUF tensor name (inside blk.N.)
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


class GGUFExportError(ValueError):
    """The model cannot be written as GGUF; the message says what is unsupported."""


def supported() -> str:
    """The supported families in words, for a refusal: "Qwen2ForCausalLM (Qwen2, Qwen2.5), LlamaForCausalLM (...), ..."."""
    return ", ".join(f"{arch} ({families})" for arch, families in FAMILIES.items())


def gguf_arch(config: Mapping[str, Any]) -> str:
    """The GGUF architecture of a model this module writes itself (its own route, and every LoRA adapter)."""
    archs = config.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    model_type = config.get("model_type")
    if model_type in ARCHITECTURES.values():
        return str(model_type)
    raise GGUFExportError(f"GGUF export supports {', '.join(ARCHITECTURES)}; this model is {archs or model_type}. "
                          f"Set snapshots.gguf = 'off' to publish safetensors only (torch clients).")


def _rope_scaled(config: Mapping[str, Any]) -> bool:
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None)


#: Gemma's layer patterns as llama.cpp runs them: the converter writes no per-layer attention types and llama.cpp
#: assumes layer i global (full_attention) when i % period == period - 1, local (sliding_attention) otherwise —
#: Gemma 2 alternates (period 2), Gemma 3 has five local then one global (6). A Gemma 3 with
#: ``sliding_window_pattern`` = 1 is written without a window: every layer global.
GEMMA_PERIODS = {"Gemma2ForCausalLM": ("Gemma 2", 2), "Gemma3ForCausalLM": ("Gemma 3", 6)}


def _gemma_layers(config: Mapping[str, Any], period: int) -> list[str]:
    """The layer types a Gemma config states (``layer_types``), or as transformers derives them from
    ``sliding_window_pattern`` (default: the family's period; layer i global when (i + 1) is a multiple of it)."""
    n = int(config.get("num_hidden_layers") or 0)
    if config.get("layer_types"):
        return [str(t) for t in config["layer_types"]]
    period = int(config.get("sliding_window_pattern") or period)
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]


def _check_gemma_layers(arch: str, config: Mapping[str, Any]) -> None:
    """Refuse a Gemma whose layer types llama.cpp would not run as stated (its GGUF would load, and compute
    another model: a 2-layer local/global Gemma 3 was off by 2.3 logits), naming the pattern it runs."""
    family, period = GEMMA_PERIODS[arch]
    layers = _gemma_layers(config, period)
    everywhere_full = arch == "Gemma3ForCausalLM" and config.get("sliding_window_pattern") == 1
    locals_ = {2: "one sliding_attention layer", 6: "five sliding_attention layers"}[period]
    for i, kind in enumerate(layers):
        want = "full_attention" if everywhere_full or i % period == period - 1 else "sliding_attention"
        if kind != want:
            also = " (or every layer full_attention with sliding_window_pattern = 1)" if period == 6 else ""
            raise GGUFExportError(
                f"{family}'s GGUF runs in llama.cpp with {locals_} then one full_attention layer, repeated{also}; "
                f"this model's layer {i} of {len(layers)} is {kind}. Set snapshots.gguf = 'off' to publish "
                f"safetensors only (torch clients)")


def route(folder: Path) -> str:
    """"writer" when this module writes the folder's model exactly (Qwen2 or Llama, no rope scaling, a tokenizer
    whose pre-tokenizer it names), "converter" when llama.cpp's converter does (:data:`CONVERTED`, and for Gemma 2
    and 3 a layer pattern llama.cpp runs); otherwise GGUFExportError, one line naming what is supported."""
    config = json.loads((folder / "config.json").read_text())
    archs = list(config.get("architectures") or [config.get("model_type")])
    tok_path = folder / "tokenizer.json"
    tok = json.loads(tok_path.read_text()) if tok_path.exists() else {}
    if (any(a in ARCHITECTURES for a in archs) and not _rope_scaled(config)
            and (tok.get("model") or {}).get("type") == "BPE" and pre_tokenizer_name(tok) in _WRITER_PRE):
        return "writer"
    if any(a in CONVERTED for a in archs):
        for arch in set(archs) & set(GEMMA_PERIODS):
            _check_gemma_layers(arch, config)
        return "converter"
    raise GGUFExportError(f"GGUF export supports {supported()}; this model is {', '.join(map(str, archs))}. "
                          f"Set snapshots.gguf = 'off' to publish safetensors only (torch clients)")


def gguf_tensor_name(hf_name: str) -> str | None:
    """GGUF name of an HF parameter (``model.layers.3.self_attn.q_proj.weight`` → ``blk.3.attn_q.weight``);
    None for parameters llama.cpp does not use (rotary caches)."""
    module, _, kind = hf_name.rpartition(".")
    if module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{kind}"
    parts = module.split(".")
    if len(parts) >= 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        rest = ".".join(parts[3:])
        if rest in _LAYER_NAMES:
            return f"blk.{parts[2]}.{_LAYER_NAMES[rest]}.{kind}"
    if "rotary_emb" in module:
        return None
    raise GGUFExportError(f"do not know the GGUF name of parameter {hf_name!r}")


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the output rows of a Llama q/k projection from HF's rotate-half layout to llama.cpp's."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute_heads(arch: str, gguf_name: str, config: Mapping[str, Any]) -> int | None:
    """The head count to permute rows by, or None when this tensor needs no permutation."""
    if arch != "llama":
        return None
    if ".attn_q." in gguf_name:
        return int(config["num_attention_heads"])
    if ".attn_k." in gguf_name:
        return int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return None


def _add_hparams(writer: Any, arch: str, config: Mapping[str, Any]) -> None:
    n_head = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // n_head)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or n_head))
    writer.add_rope_freq_base(float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get(
        "rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_rope_dimension_count(head_dim)
    if head_dim * n_head != hidden:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(int(config["vocab_size"]))


def _pre_tokenizer_name(tok: Mapping[str, Any]) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenization regex (coordinator.publish.hf_convert)."""
    name = pre_tokenizer_name(tok)
    if name not in _WRITER_PRE:
        raise GGUFExportError("the tokenizer's pre-tokenizer regex is not one llama.cpp knows (qwen2, llama-bpe, gpt-2)")
    return str(name)


def _add_tokenizer(writer: Any, folder: Path, config: Mapping[str, Any]) -> None:
    import gguf

    path = folder / "tokenizer.json"
    if not path.exists():
        raise GGUFExportError(f"{folder} has no tokenizer.json; GGUF export needs a fast (BPE) tokenizer")
    tok = json.loads(path.read_text())
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise GGUFExportError(f"GGUF export supports byte-level BPE tokenizers; {path} is {model.get('type')}")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    special: set[int] = set()
    for added in tok.get("added_tokens") or []:
        vocab[added["content"]] = int(added["id"])
        if added.get("special", False):
            special.add(int(added["id"]))
    n_vocab = max(int(config["vocab_size"]), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [int(gguf.TokenType.UNUSED)] * n_vocab
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(tok))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if not merges:
        # llama.cpp refuses a "gpt2" vocabulary without the merges key, and GGUF cannot store an empty array.
        # One merge of a control token with itself never fires (BPE works on byte symbols; a control token's
        # text is never a single symbol), so tokenisation stays one byte per token.
        control = next((tokens[i] for i in sorted(special)), None)
        if control is None:
            raise GGUFExportError(f"{path}: a tokenizer without merges needs a special token (e.g. eos)")
        merges = [f"{control} {control}"]
    writer.add_token_merges(merges)
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.exists() else {}

    def token_id(key: str) -> int | None:
        value = tcfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value in vocab:
            return vocab[value]
        cid = config.get(f"{key}_id")
        return int(cid) if isinstance(cid, int) else None

    eos = token_id("eos_token")
    if eos is None:
        raise GGUFExportError(f"{folder}: no eos_token in tokenizer_config.json or config.json")
    writer.add_eos_token_id(eos)
    bos = token_id("bos_token")
    writer.add_bos_token_id(eos if bos is None else bos)  # always written: llama.cpp's fallback is token 11
    pad = token_id("pad_token")
    if pad is not None:
        writer.add_pad_token_id(pad)
    writer.add_add_bos_token(bool(config.get("model_type") == "llama" and bos is not None))


def _ggml_type(shape: tuple[int, ...], precision: str) -> Any:
    """The raw ggml type a tensor of this shape is stored as: vectors stay f32; matrices follow the precision."""
    import gguf

    q = gguf.GGMLQuantizationType
    if len(shape) < 2 or precision == "f32":
        return q.F32
    return q.F16


def _encode(arr: np.ndarray, raw: Any) -> np.ndarray:
    """A block of rows as stored: f32 or f16."""
    import gguf
    import numpy as np

    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if raw == gguf.GGMLQuantizationType.F32:
        return arr
    return arr.astype(np.float16)


# rows are converted this many elements at a time: the writer never holds a whole tensor in another precision
CHUNK_ELEMENTS = 2**22


class _Rows:
    """One tensor as the GGUF writer's ``write_tensor_data`` consumes it (``nbytes`` and ``tofile``), converted block
    of rows by block of rows as it is written, so that exporting a model needs one block's temporaries, not a copy
    of the model in the file's precisions."""

    def __init__(self, value: Any, raw: Any, heads: int | None) -> None:
        import gguf

        self.value, self.raw, self.heads = value, raw, heads
        self.shape = tuple(int(d) for d in value.shape)
        width = 4 if raw == gguf.GGMLQuantizationType.F32 else 2
        self.nbytes = width * math.prod(self.shape)
        self.dtype = {4: "float32", 2: "float16"}[width]

    def tofile(self, fh: Any) -> None:
        value = self.value
        if self.heads is not None:  # the row permutation needs the whole (small: attention) matrix
            value = llama_permute(_as_numpy(value[0:int(value.shape[0])]), self.heads)
        if len(value.shape) < 2:
            value = value.reshape(-1)
            step = CHUNK_ELEMENTS
        else:  # whole rows
            step = max(1, CHUNK_ELEMENTS // max(1, math.prod(int(d) for d in value.shape[1:])))
        for at in range(0, int(value.shape[0]), step):
            _encode(_as_numpy(value[at:at + step]), self.raw).tofile(fh)


_FILE_TYPES = {"f32": 0, "f16": 1}  # llama.cpp's LLAMA_FTYPE_ALL_F32 / MOSTLY_F16


def write_model_gguf(out: Path, folder: Path, state: Mapping[str, Any], precision: str = "f16",
                     name: str = "echo-swarm policy", *, threads: int | None = None) -> None:
    """Write a whole model as GGUF. ``folder`` holds the HF config and tokenizer files; ``state`` maps HF
    parameter names to arrays (torch tensors or numpy), e.g. the model's ``state_dict()``. Streamed: the tensor
    table is written first, then each tensor converted and written a block of rows at a time (:class:`_Rows`). A
    value is only sliced by rows (``value[a:b]``) and read for its ``shape``, so it may be read from a file on
    demand (coordinator.publish.weights_file.StoredTensor). A quantised precision is written as f16 beside ``out``
    first, then quantised into ``out`` by llama.cpp's quantiser (``threads`` of it; the f16 file is deleted)."""
    if precision not in PRECISIONS:
        raise GGUFExportError(f"unknown GGUF precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    write_plain = _plain_writer(folder, state, name)
    if precision in QUANTISED:
        f16 = out.with_name(out.name + ".f16.tmp")
        try:
            write_plain(f16, "f16")
            quantise(f16, out, precision, threads=threads)
        finally:
            f16.unlink(missing_ok=True)
        return
    write_plain(out, precision)


def _plain_writer(folder: Path, state: Mapping[str, Any], name: str) -> Callable[[Path, str], None]:
    """Writes the model as f32 or f16 GGUF by its :func:`route`: from ``state`` by this module, or from the
    folder's own safetensors by llama.cpp's converter (the publisher has written them before the GGUF)."""
    if route(folder) == "converter":
        if not any(folder.glob("*.safetensors")):
            raise GGUFExportError(f"{folder} has no *.safetensors: llama.cpp's converter reads the version's weights "
                                  f"from its folder")
        return lambda out, precision: convert(folder, out, precision)
    return lambda out, precision: _write_plain_gguf(out, folder, state, precision, name)


def write_model_ggufs(folder: Path, state: Mapping[str, Any], offered: Sequence[str], *,
                      threads: int | None = None) -> None:
    """Write a version's GGUF in every precision the run offers (snapshots.offered(): the default first, as
    ``model.gguf``; the others as ``model.<p>.gguf``, shared.llama_files.gguf_name). The weights are converted once
    to f16 and every quantised file is made from that one file by llama.cpp's quantiser; f32 is written from
    ``state`` itself."""
    names = {p: folder / gguf_name(p, offered[0]) for p in offered}
    if len(offered) == 1:
        write_model_gguf(names[offered[0]], folder, state, offered[0], threads=threads)
        return
    write_plain = _plain_writer(folder, state, "echo-swarm policy")
    if "f32" in names:
        write_plain(names["f32"], "f32")
    quantised = [p for p in offered if p in QUANTISED]
    if "f16" not in names and not quantised:
        return
    f16 = names.get("f16", folder / "model.f16.gguf.tmp")
    try:
        write_plain(f16, "f16")
        for p in quantised:
            quantise(f16, names[p], p, threads=threads)
    finally:
        if "f16" not in names:
            f16.unlink(missing_ok=True)


def _write_plain_gguf(out: Path, folder: Path, state: Mapping[str, Any], precision: str, name: str) -> None:
    import gguf
    import numpy as np

    config = json.loads((folder / "config.json").read_text())
    arch = gguf_arch(config)
    tied = bool(config.get("tie_word_embeddings", False))
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name)
    writer.add_file_type(_FILE_TYPES[precision])
    _add_hparams(writer, arch, config)
    _add_tokenizer(writer, folder, config)
    tensors: list[_Rows] = []
    for hf_name, value in state.items():
        gname = gguf_tensor_name(hf_name)
        if gname is None or (tied and gname == "output.weight"):
            continue
        rows = _Rows(value, _ggml_type(tuple(int(d) for d in value.shape), precision),
                     _permute_heads(arch, gname, config))
        writer.add_tensor_info(gname, rows.shape, np.dtype(rows.dtype), rows.nbytes, raw_dtype=rows.raw)
        tensors.append(rows)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for rows in tensors:  # in the order of the tensor table (the writer pops its entries in that order)
        writer.write_tensor_data(rows)  # type: ignore[arg-type]  # duck-typed: nbytes and tofile
    writer.close()


def write_lora_gguf(out: Path, config: Path | Mapping[str, Any], lora: Mapping[str, tuple[Any, Any]], alpha: float,
                    precision: str = "f32") -> None:
    """Write a LoRA adapter as GGUF. ``config`` is the base model's HF config (a dict, or a folder holding its
    config.json: only the architecture and head counts are read); ``lora`` maps an HF weight name
    (``model.layers.0.self_attn.q_proj.weight``) to its (A [r, in], B [out, r]) pair, as peft stores them;
    llama.cpp applies ``W + alpha/r · B·A``."""
    import gguf
    import numpy as np

    hf: Mapping[str, Any] = json.loads((config / "config.json").read_text()) if isinstance(config, Path) else config
    arch = gguf_arch(hf)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(alpha))
    dtype = np.float32 if precision == "f32" else np.float16
    raw = gguf.GGMLQuantizationType.F32 if precision == "f32" else gguf.GGMLQuantizationType.F16
    for hf_name, (a, b) in lora.items():
        gname = gguf_tensor_name(hf_name)
        if gname is None:
            continue
        b_arr = _as_numpy(b)
        heads = _permute_heads(arch, gname, hf)
        if heads is not None:
            b_arr = llama_permute(b_arr, heads)
        writer.add_tensor(f"{gname}.lora_a", np.ascontiguousarray(_as_numpy(a), dtype=dtype), raw_dtype=raw)
        writer.add_tensor(f"{gname}.lora_b", np.ascontiguousarray(b_arr, dtype=dtype), raw_dtype=raw)
    _finish(writer)


def write_adapter_gguf(out: Path, base: Path, adapter: Path, lora: Mapping[str, tuple[Any, Any]], alpha: float,
                       precision: str = "f32") -> None:
    """Write a version's LoRA adapter as GGUF by the route of its base (:func:`route` of ``base``, the folder with
    the base's config.json and tokenizer files), so the adapter's tensors are named and laid out as in the base GGUF
    llama.cpp applies it to: this module's :func:`write_lora_gguf` from ``lora`` and ``alpha`` for a base this module
    writes, llama.cpp's own adapter converter (coordinator.publish.hf_convert.convert_lora) from the peft files in
    ``adapter`` for a base llama.cpp's converter writes."""
    if route(base) == "converter":
        convert_lora(base, adapter, out, precision)
        return
    write_lora_gguf(out, base, lora, alpha, precision)


def _as_numpy(value: Any) -> np.ndarray:
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.astype(np.float32, copy=False)
    return value.detach().to("cpu").float().numpy()


def _finish(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def export_folder(folder: Path, out: Path, precision: str = "f16") -> None:
    """Export a Hugging Face model folder (config.json, *.safetensors, tokenizer.json) to one GGUF file."""
    from safetensors.numpy import load_file

    if route(Path(folder)) == "converter":  # refuses unsupported models first
        write_model_gguf(out, Path(folder), {}, precision)
        return
    state: dict[str, np.ndarray] = {}
    shards = sorted(Path(folder).glob("*.safetensors"))
    if not shards:
        raise GGUFExportError(f"{folder} has no *.safetensors weights")
    for shard in shards:
        state.update(load_file(str(shard)))
    write_model_gguf(out, Path(folder), state, precision)
