"""torch backend: Hugging Face transformers model on CPU, CUDA or Apple MPS; a job's GRPO group is
generated as one batch.

A new version of the same architecture is loaded into the model in place, tensor by tensor from the
memory-mapped safetensors, so the peak is one model plus one tensor (not a second state dict). A version of a
LoRA run (``adapter_config.json`` beside the base files, see shared.adapters) loads the base once: while the
base files are the same (the snapshot cache hard-links every version's base to one blob), a new version only
rewrites the adapted weights as base + scale·B·A. So such a client downloads the base once and a small adapter
per version, and never holds a second copy of the model.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.adapters import (
    apply_adapter,
    base_weight_files,
    holds_base,
    is_adapter_folder,
    load_base_model,
    load_weights_in_place,
    mark_base,
    read_adapter,
)
from shared.messages import Job
from shared.policy import Sampled, generate, import_backends, load_model, load_tokenizer, pick_device

logger = logging.getLogger(__name__)

FileIds = tuple[tuple[str, int, int, int, int], ...]

#: The compute dtypes of a torch client, each with the precision its lease and class name ("torch-bf16").
TORCH_PRECISIONS = {"float32": "f32", "bfloat16": "bf16"}


def _file_ids(folder: Path) -> FileIds:
    """Identity of a folder's base weight files: name, device, inode, size, mtime (cached blobs are immutable
    and every version's folder links the same blob, so an unchanged base keeps its identity)."""
    out = []
    for p in base_weight_files(folder):
        st = os.stat(p)
        out.append((p.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class TorchBackend:
    name = "torch"
    forms = frozenset({"hf"})  # the safetensors model folder (or base + adapter); GGUF files are not fetched

    def __init__(self, device: str = "auto", threads: int | None = None, dtype: str = "float32") -> None:
        """``dtype``: what the model computes in, "float32" or "bfloat16" (half the memory: a 7 B policy fits a 16 GB
        card only so). The coordinator recomputes a bf16 client's results in bf16, replaying its generations
        (coordinator.engine.torch_replay); :attr:`precision` is how the lease names it."""
        if dtype not in TORCH_PRECISIONS:
            raise ValueError(f"torch dtype {dtype!r} is not one the coordinator can verify: choose "
                             f"{' or '.join(TORCH_PRECISIONS)}")
        import torch

        # seconds of torch and transformers imports: taken while the client starts (and, started with its
        # coordinator, waits for it), not when the first job is waiting
        import_backends()
        if threads:
            torch.set_num_threads(threads)
        self.device = pick_device(device)
        self.dtype = dtype
        self.precision = TORCH_PRECISIONS[dtype]
        self.model: Any = None
        self.tokenizer: Any = None
        self._config_text: str | None = None
        self._weights_id: FileIds | None = None  # the whole weights (or LoRA base) the model holds
        self.folder: Path | None = None

    def load(self, folder: Path) -> None:
        folder = Path(folder)
        if folder == self.folder:
            return
        config_text = (folder / "config.json").read_text()
        lora = is_adapter_folder(folder)
        weights_id = _file_ids(folder)
        self.folder = None  # nothing half-loaded stays usable
        if self.model is None or config_text != self._config_text:
            self.model = self._weights_id = None
            self.tokenizer = load_tokenizer(folder)
            load = load_base_model if lora else load_model
            self.model = load(folder, self.device, self.dtype)
            self._config_text = config_text
        elif weights_id != self._weights_id:
            self._weights_id = None
            load_weights_in_place(self.model, folder)
        self._weights_id = weights_id
        if not holds_base(self.model):
            mark_base(self.model, True)  # it holds exactly this folder's weight files, no adapter
        # a LoRA version: base + this adapter (only the adapted weights are rewritten); otherwise drop any adapter
        apply_adapter(self.model, folder, read_adapter(folder) if lora else None)
        self.model.eval()
        self.folder = folder
        logger.debug("loaded %s (%s%s)", folder, json.loads(config_text).get("model_type"), ", LoRA" if lora else "")

    def parameters(self) -> int | None:
        return None if self.model is None else sum(p.numel() for p in self.model.parameters())

    def unload(self) -> None:
        self.model = self._weights_id = self._config_text = self.folder = None
        gc.collect()  # the weights go now, not at the next collection

    def generate(self, job: Job, should_stop: Callable[[], bool]) -> list[Sampled]:
        if self.model is None:
            raise RuntimeError("no model loaded")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else job.sampling.stop_token_ids[0]
        return generate(self.model, [p.token_ids for p in job.prompts], group_size=job.group_size,
                        temperature=job.sampling.temperature, max_tokens=job.sampling.max_tokens,
                        stop_ids=job.sampling.stop_token_ids, seed=job.seed, pad_id=pad, should_stop=should_stop)
