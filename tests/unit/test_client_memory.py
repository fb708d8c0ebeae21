"""The memory pre-check accounts for each backend's real peak (issue 14; swarm_client/footprint.py).

The peaks below were measured with bench/client_memory.py at the Qwen2.5-0.5B shape (docs/benchmarks.md): the
estimate for the same model and job must never be below them (a volunteer who passes the check must not be
killed by the OOM killer), nor so far above that it refuses machines that would cope. Then the join loop: the
check before loading uses the job's own batch, and the check before a download the shape and dtype of the
version the client holds.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from shared.messages import JobPrompt, Manifest, ManifestFile
from swarm_client.fitting import Fit
from swarm_client.footprint import (
    GIB,
    Batch,
    ModelShape,
    Weights,
    gguf_shape,
    llama_need_from,
    read_shape,
    torch_need,
    torch_need_from,
    torch_weights,
)
from swarm_client.resources import ResourceRefusal

from .client_fakes import NullBackend, make_client, reply, serve
from .factories import SHA, manifest

QWEN_05B = {"num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2,
            "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
PARAMS_05B = 494_032_768
EMBEDDING_05B = 151936 * 896  # the largest tensor (tied embedding)

# (what was measured, peak resident bytes) — bench/client_memory.py --shape qwen2.5-0.5b, this machine class
MEASURED_TORCH_F32 = 5_644_496_896  # float32 files; 8×8 sequences of 64 + 32 tokens
MEASURED_TORCH_BF16 = 3_339_493_376  # bfloat16 files (loaded as float32); 2×4 sequences of 64 + 8 tokens
MEASURED_LLAMA_F16 = 1_426_243_584  # f16 GGUF of 991,608,032 bytes, n_ctx 2048
MAX_OVERESTIMATE = 1.3


def shape_05b() -> ModelShape:
    shape = ModelShape.from_config(QWEN_05B)
    assert shape is not None
    return shape


def test_shape_from_a_config() -> None:
    shape = shape_05b()
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_width, shape.intermediate, shape.vocab) == (
        24, 896, 14, 128, 4864, 151936)
    assert ModelShape.from_config({**QWEN_05B, "head_dim": 96}).kv_width == 192  # an explicit head_dim wins
    assert ModelShape.from_config({k: v for k, v in QWEN_05B.items() if k != "vocab_size"}) is None
    assert ModelShape.from_config({**QWEN_05B, "hidden_size": "896"}) is not None  # int() of a JSON string
    assert ModelShape.from_config({**QWEN_05B, "num_hidden_layers": 0}) is None


def test_torch_estimate_covers_the_measured_peak_with_float32_files() -> None:
    weights = Weights(4 * PARAMS_05B, 4 * EMBEDDING_05B, 4 * PARAMS_05B + 32_400)
    need = torch_need_from(weights, shape_05b(), Batch(sequences=64, prompt_tokens=64, new_tokens=32))
    assert MEASURED_TORCH_F32 <= need.total <= MAX_OVERESTIMATE * MEASURED_TORCH_F32
    # the prefill's logits of every prompt position are the largest part of this job's transients
    assert need.parts["prefill"] > 64 * 64 * 151936 * 4
    assert need.parts["loading"] == 4 * EMBEDDING_05B  # float32 files: a swap adds one tensor at most


def test_torch_estimate_covers_the_measured_peak_with_16_bit_files() -> None:
    weights = Weights(4 * PARAMS_05B, 4 * EMBEDDING_05B, 2 * PARAMS_05B + 32_400)
    need = torch_need_from(weights, shape_05b(), Batch(sequences=8, prompt_tokens=64, new_tokens=8))
    assert MEASURED_TORCH_BF16 <= need.total <= MAX_OVERESTIMATE * MEASURED_TORCH_BF16
    # the first load maps the whole 16-bit file while it converts it to float32
    assert need.parts["loading"] == weights.file_bytes


def test_llama_estimate_covers_the_measured_peak() -> None:
    need = llama_need_from(991_608_032, shape_05b())
    assert MEASURED_LLAMA_F16 <= need.total <= MAX_OVERESTIMATE * MEASURED_LLAMA_F16


def test_the_batch_matters() -> None:
    weights = Weights(4 * PARAMS_05B, 4 * EMBEDDING_05B, 4 * PARAMS_05B)
    small = torch_need_from(weights, shape_05b(), Batch(2, 16, 16)).total
    large = torch_need_from(weights, shape_05b(), Batch(256, 512, 512)).total
    assert small < 3 * GIB < 40 * GIB < large


def test_unknown_shape_falls_back_to_a_larger_estimate() -> None:
    weights = Weights(4 * PARAMS_05B, 4 * EMBEDDING_05B, 4 * PARAMS_05B)
    batch = Batch(64, 64, 32)
    assert torch_need_from(weights, None, batch).total >= torch_need_from(weights, shape_05b(), batch).total
    assert llama_need_from(991_608_032, None).total >= llama_need_from(991_608_032, shape_05b()).total


def test_weights_known_only_by_file_size_scale_like_the_version_held() -> None:
    as_f32 = Weights.from_file_bytes(GIB, None)
    assert as_f32.memory_bytes == GIB and as_f32.file_bytes == GIB  # no other version known: float32 files
    held_bf16 = Weights(4 * PARAMS_05B, 4 * EMBEDDING_05B, 2 * PARAMS_05B)
    scaled = Weights.from_file_bytes(GIB, held_bf16)
    assert scaled.memory_bytes == 2 * GIB
    assert scaled.largest_bytes == 2 * GIB * EMBEDDING_05B // PARAMS_05B


# ---- reading the facts from the files ----------------------------------------------------------------------
def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], itemsize: int) -> None:
    """A safetensors file with these tensors' header; the data is a sparse hole of the right size."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)


def write_model(folder: Path, *, dtype: str = "F32", itemsize: int = 4, config: dict[str, object] | None = None,
                hidden: int = 896, vocab: int = 151936, layers: int = 24) -> None:
    """A model folder shaped like Qwen2.5-0.5B's biggest tensors: the embedding (30 % of the weights) and each
    layer's MLP; the weights are holes, only the headers and the files' sizes are real."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or QWEN_05B))
    tensors = {"model.embed_tokens.weight": (dtype, [vocab, hidden])}
    for i in range(layers):
        for proj in ("up", "gate", "down"):
            tensors[f"model.layers.{i}.mlp.{proj}_proj.weight"] = (dtype, [4864, hidden])
    write_safetensors(folder / "model.safetensors", tensors, itemsize)


def test_weights_from_safetensors_headers(tmp_path: Path) -> None:
    write_model(tmp_path, dtype="BF16", itemsize=2)
    w = torch_weights(tmp_path)
    assert w.memory_bytes == 4 * (151936 + 72 * 4864) * 896 and w.largest_bytes == 4 * 151936 * 896
    assert w.file_bytes == (tmp_path / "model.safetensors").stat().st_size
    assert w.loading_bytes == w.file_bytes  # 16-bit: the first load maps the file while converting
    assert read_shape(tmp_path) == shape_05b()
    assert torch_need(tmp_path, Batch(1, 1, 1)).parts["weights"] == w.memory_bytes


def test_shape_from_a_gguf_header(tmp_path: Path) -> None:
    import gguf  # the coordinator and llama extras' GGUF library (make setup installs it): missing, this fails
    writer = gguf.GGUFWriter(str(tmp_path / "base.gguf"), "qwen2")
    writer.add_block_count(24)
    writer.add_embedding_length(896)
    writer.add_head_count(14)
    writer.add_head_count_kv(2)
    writer.add_feed_forward_length(4864)
    writer.add_token_list([f"t{i}" for i in range(151936)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_shape(tmp_path / "base.gguf") == shape_05b()
    assert read_shape(tmp_path) == shape_05b()  # a llama.cpp client's folder has no config.json
    whole = (tmp_path / "base.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) // 2])  # ends inside the vocabulary
    (tmp_path / "other.gguf").write_bytes(b"GGML" + whole[4:])
    assert gguf_shape(tmp_path / "cut.gguf") is None and gguf_shape(tmp_path / "other.gguf") is None


# ---- the join loop ---------------------------------------------------------------------------------------
def test_a_job_whose_batch_does_not_fit_is_released_before_loading(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    runner, identity = make_client(tmp_path / "home", monkeypatch, max_memory_gb=1.0)
    tiny_model = {**QWEN_05B, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}

    def fill(folder: Path, version: int) -> None:
        write_model(folder, config=tiny_model, hidden=64)  # ~40 MB of weights, but a 151,936-token vocabulary

    cid = identity.client_id
    small = reply(1, job_version=1, client_id=cid, group_size=2)  # 2 sequences: a few MB of prefill
    # 64 sequences of 64 prompt tokens: 2.3 GiB of prefill logits alone, over the 1 GiB ceiling
    big = reply(1, job_version=1, client_id=cid, group_size=8, job_id="v1-j1",
                prompts=[JobPrompt(prompt_id=i, token_ids=list(range(1, 65)), text="") for i in range(8)])
    backend = NullBackend()
    coordinator, cache = serve(runner, identity, [small, big], backend=backend, fill=fill, raises=ResourceRefusal)
    assert coordinator.submitted == [1]  # the small job ran
    assert coordinator.released == ["v1-j1"]  # the big one went back at once, for a client that can take it
    assert len(backend.loaded) == 1  # and its model was not loaded again for it
    assert cache.fetches == [(1, SHA), (1, SHA)]


def test_the_check_before_a_download_learns_the_dtype_from_the_version_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner, _ = make_client(tmp_path / "home", monkeypatch, max_memory_gb=2.5)
    backend = NullBackend()
    # the judge the join loop hands the snapshot cache as its pre-check (Runner._serve), before any version is held
    fit = Fit(runner.cfg, backend, runner.hardware, runner.device, None, runner.reporter.say)  # type: ignore[arg-type]
    files = [ManifestFile(path="model.safetensors", size=GIB, sha256=SHA), ManifestFile(path="config.json", size=900,
                                                                                         sha256="cd" * 32)]
    next_version: Manifest = manifest(files=files)
    # nothing held yet: 1 GiB of files taken for float32 (the coordinator's default): 1 + 0.3 + 0.4 GiB fits
    fit.precheck(next_version, 0)
    # the version held has 16-bit files: the next one's 1 GiB of files is 2 GiB in float32, plus the file mapped
    write_model(tmp_path / "held", dtype="BF16", itemsize=2)
    backend.folder = tmp_path / "held"
    with pytest.raises(ResourceRefusal, match=r"needs about 3\.[0-9]+ GiB"):
        fit.precheck(next_version, 0)
    write_model(tmp_path / "held32")
    backend.folder = tmp_path / "held32"
    fit.precheck(next_version, 0)
