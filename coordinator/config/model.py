"""The ``[model]`` section: which policy the learner trains and the verifier replays."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coordinator.config.base import StrictModel


class ModelConfig(StrictModel):
    """Which policy to train."""

    path: str = Field(
        "tiny",
        description="A local Hugging Face model folder (config.json, *.safetensors, tokenizer files), or "
        "'tiny' for the built-in ~1M-parameter Qwen2 model warm-started on the arithmetic task.",
    )
    device: Literal["auto", "cpu", "cuda", "mps"] = Field("auto", description="Where the learner runs.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype of the learner (unless "
                                                  "learner.precision = 'bf16') and of the verifier's replicas.")
