"""torch backend: Hugging Face transformers model on CPU, CUDA or Apple MPS; a job's GRPO group is
generated as one batch. A new version of the same architecture is loaded by swapping weights in place."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.messages import Job
from shared.policy import Sampled, generate, load_model, load_tokenizer, pick_device

logger = logging.getLogger(__name__)


class TorchBackend:
    name = "torch"
    forms = frozenset({"hf"})  # the safetensors model folder; GGUF files are not fetched

    def __init__(self, device: str = "auto", threads: int | None = None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.device = pick_device(device)
        self.model: Any = None
        self.tokenizer: Any = None
        self._config_text: str | None = None
        self.folder: Path | None = None

    def load(self, folder: Path) -> None:
        if folder == self.folder:
            return
        config_text = (folder / "config.json").read_text()
        if self.model is not None and config_text == self._config_text:
            from safetensors.torch import load_file

            state: dict[str, Any] = {}
            for shard in sorted(folder.glob("*.safetensors")):
                state.update(load_file(str(shard), device=str(self.device)))
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            # tied embeddings are saved once; anything else missing means a different model
            if unexpected or any("lm_head" not in m for m in missing):
                raise ValueError(f"snapshot {folder} does not match the loaded architecture")
        else:
            self.tokenizer = load_tokenizer(folder)
            self.model = load_model(folder, self.device)
            self._config_text = config_text
        self.model.eval()
        self.folder = folder
        logger.debug("loaded %s (%s)", folder, json.loads(config_text).get("model_type"))

    def generate(self, job: Job, should_stop: Callable[[], bool]) -> list[Sampled]:
        if self.model is None:
            raise RuntimeError("no model loaded")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else job.sampling.stop_token_ids[0]
        return generate(self.model, [p.token_ids for p in job.prompts], group_size=job.group_size,
                        temperature=job.sampling.temperature, max_tokens=job.sampling.max_tokens,
                        stop_ids=job.sampling.stop_token_ids, seed=job.seed, pad_id=pad, should_stop=should_stop)
