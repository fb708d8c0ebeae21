"""What the learner hands over to be published as a version: the weights (full, or a LoRA version's adapter over a
run-level base) with the config and tokenizer files and the GGUF forms, and the folder a version is saved as.

Split from coordinator/engine/learner.py (issue 33): publication reads the model but never trains it, and it is the
part that knows the file layouts (Hugging Face folder, coordinator.engine.lora's adapter layout, GGUF). It runs on
the learner's thread right after a step; the files are written later on the publisher's (coordinator.publish).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.engine import fsdp, lora
from coordinator.engine.live_gates import LiveGates
from coordinator.publish.gguf_export import write_model_ggufs
from coordinator.publish.snapshots import SnapshotFiles
from coordinator.publish.weights_file import StoredWeights

if TYPE_CHECKING:
    from torch import Tensor

    from coordinator.engine.fsdp import Ranks


class SnapshotExport:
    """The learner's versions as files. ``model`` is the policy as trained (peft-wrapped when ``lora``, sharded on
    ``ranks``); ``model_dir`` the folder it was loaded from (its SentencePiece model is copied); ``gguf`` the
    precisions of the GGUF forms published with every version (the default first; none for ()); ``gates``: where
    lending the live weights is recorded, for the next optimizer update to wait on."""

    def __init__(self, model: Any, tokenizer: Any, model_dir: Path, *, gguf: tuple[str, ...], lora: bool,
                 ranks: Ranks | None, gates: LiveGates) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_dir = Path(model_dir)
        self.gguf = gguf
        self.lora = lora
        self.ranks = ranks
        self.gates = gates
        self._static_files: dict[str, bytes] | None = None  # config and tokenizer files of every snapshot
        self._lora_base: dict[str, Tensor] | None = None  # FSDP + LoRA: the frozen base, gathered once (rank 0)

    def save_model(self, folder: Path) -> None:
        """Write a version: the Hugging Face folder, plus its GGUF forms (one per offered precision)."""
        if self.lora:  # a self-contained LoRA version: the base files and this version's adapter in one folder
            files = self._lora_snapshot_files("training")
            for name, write_shared in files.shared.items():
                write_shared(folder / name)
            files.write(folder)
            return
        self.model.save_pretrained(str(folder), safe_serialization=True)
        self.tokenizer.save_pretrained(str(folder))
        if self.gguf:
            write_model_ggufs(folder, self.model.state_dict(), self.gguf)

    def publish_dtype(self, configured: str) -> str:
        """The dtype snapshots are written in: ``snapshots.dtype``, where "training" means the model's own."""
        if configured != "training":
            return configured
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def snapshot_files(self, dtype: str = "training") -> SnapshotFiles:
        """On the learner thread, right after a step: what the publisher needs to write this version while the
        learner goes on training. Full weights: the state dict in the publish dtype on the CPU, as
        ``SnapshotFiles.weights`` (the store writes ``model.safetensors`` from it, then ``write`` adds the config and
        tokenizer files and the GGUF form, read back from that file).

        Where the live weights already are that (a bf16 learner on the CPU publishing bf16, not FSDP, not LoRA)
        they are handed over themselves, not copied (2 B/param less at the learner's peak): the next optimizer
        update waits until the publisher has written them (coordinator.engine.live_gates), as for a checkpoint;
        that step's forward and backward passes run meanwhile. Otherwise one CPU copy (the copy is the dtype
        conversion or the transfer off the accelerator), freed once written."""
        if self.lora:
            return self._lora_snapshot_files(dtype)
        state, live = self._weights(dtype)
        if state is None:
            return SnapshotFiles(lambda folder: None)
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied to the embeddings, stored once (as save_pretrained does)
        static = self._snapshot_static_files(self.publish_dtype(dtype))
        gguf = self.gguf
        order = list(state)

        def write(folder: Path) -> None:
            for name, data in static.items():
                (folder / name).write_bytes(data)
            if gguf:  # from the published (settled) values, a block of rows at a time
                write_model_ggufs(folder, StoredWeights(folder / "model.safetensors", order), gguf)

        files = SnapshotFiles(write, weights=state)
        if live:
            self.gates.lend_for_publication(files.written)
        return files

    def _weights(self, dtype: str) -> tuple[dict[str, Tensor] | None, bool]:
        """The full state dict in the publish dtype on the CPU (None on an FSDP rank that keeps none), and whether
        it is the live weights themselves (nothing to copy: already that dtype on the CPU, one device)."""
        import torch

        target = getattr(torch, self.publish_dtype(dtype))
        if self.ranks is not None:  # gathered from the shards, one tensor at a time; only rank 0 keeps them
            state = fsdp.full_tensors(self.model.state_dict().items(), self.ranks.leader, target)
            return (state if self.ranks.leader else None), False
        current = self.model.state_dict()
        live = all(v.device.type == "cpu" and v.is_contiguous()
                   and (v.dtype == target or not v.is_floating_point()) for v in current.values())
        if live:
            return {k: v.detach() for k, v in current.items()}, True
        return {k: v.detach().to("cpu", dtype=target if v.is_floating_point() else v.dtype, copy=True)
                for k, v in current.items()}, False

    def _lora_snapshot_files(self, dtype: str) -> SnapshotFiles:
        """A LoRA version (coordinator.engine.lora has the layout): its own files are the adapter, copied here (a few
        MB at most); the frozen base (HF files and base.gguf) is a run-level shared file set, written once."""
        import torch

        if self.ranks is not None:  # the adapter gathered every version, the frozen base once per process
            keep = self.ranks.leader
            trainable = fsdp.full_tensors(((n, p) for n, p in self.model.named_parameters() if p.requires_grad),
                                          keep, torch.float32)
            if self._lora_base is None:
                self._lora_base = lora.plain_names(fsdp.full_tensors(
                    ((n, v) for n, v in self.model.state_dict().items() if ".lora_" not in n), keep))
            if not keep:
                return SnapshotFiles(lambda folder: None)
            snap = lora.adapter_snapshot(self.model, trainable)
        else:
            snap = lora.adapter_snapshot(self.model)
        publish = self.publish_dtype(dtype)
        static = self._snapshot_static_files(publish)
        gguf = self.gguf[0] if self.gguf else "off"  # a LoRA run offers one precision (config)
        shared = lora.base_writers(self.model, static, getattr(torch, publish), gguf, self._lora_base)

        def write(folder: Path) -> None:
            lora.write_adapter(folder, snap, static, gguf)

        return SnapshotFiles(write, shared)

    def _snapshot_static_files(self, dtype: str) -> dict[str, bytes]:
        """config.json (its dtype set to the publish dtype), generation config and tokenizer files, once."""
        if self._static_files is None:
            with tempfile.TemporaryDirectory(prefix="echo-swarm-static-") as tmp:
                self.model.config.save_pretrained(tmp)
                if getattr(self.model, "generation_config", None) is not None:
                    self.model.generation_config.save_pretrained(tmp)
                self.tokenizer.save_pretrained(tmp)
                files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
            spm = self.model_dir / "tokenizer.model"  # transformers 5 saves no SentencePiece model; llama.cpp's
            if spm.is_file() and spm.name not in files:  # Gemma converter reads its vocabulary from it
                files[spm.name] = spm.read_bytes()
            config = json.loads(files["config.json"])
            for key in ("torch_dtype", "dtype"):
                if key in config:
                    config[key] = dtype
            files["config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
            self._static_files = files
        return self._static_files
