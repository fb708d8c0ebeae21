"""The ``[snapshots]`` section: what the publisher writes per policy version (dtype, GGUF precisions, deltas)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from coordinator.config.base import StrictModel


class SnapshotConfig(StrictModel):
    keep_last: int = Field(4, ge=1, description="Published versions kept on disk (older ones are pruned).")
    dtype: Literal["training", "float32", "bfloat16", "float16"] = Field(
        "training", description="Precision of the published safetensors weights: 'training' is model.dtype. "
        "bfloat16 halves the bytes every client downloads and the coordinator writes per version; clients and "
        "the verifier then compute with the rounded weights, which differ from the learner's float32 ones "
        "(docs/benchmarks.md, 'Real model size', measures the logprob gap). Recommended at real model size.")
    keep_exports: int = Field(3, ge=1, description="Operator exports (`echo-swarm admin checkpoint`, exports/) "
                              "kept; older ones are deleted when a version is published.")
    gguf: Literal["off", "f32", "f16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_0"] = Field(
        "f16", description="Also publish every version as GGUF for llama.cpp clients, at this precision "
        "(off: safetensors only, torch clients). f32 and f16 are written by the coordinator; q8_0, q6_K, q5_K_M, "
        "q4_K_M and q4_0 by llama.cpp's own quantiser from the f16 file (coordinator.publish.quantise; needs "
        "llama-cpp-python on the coordinator). Every precision is checked equally tightly: a llama.cpp result "
        "is recomputed by llama.cpp on the very file the client ran (coordinator.engine.llama_verifier). q4_K_M "
        "is ~0.31x the bytes of f16: a 7 B policy in ~4.4 GB, for 8 GB GPUs and 16 GB Macs (README).")
    gguf_also: list[Literal["f32", "f16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_0"]] = Field(
        default_factory=list, max_length=6, description="More precisions offered beside snapshots.gguf, each "
        "published per version as model.<precision>.gguf (with its own patches), e.g. ['q4_K_M'] so that 8 GB "
        "volunteers can join a 7 B run that others run at f16. A llama.cpp client takes the best offered "
        "precision that fits its memory (`join --precision auto`) and names it in its lease; its result is "
        "recomputed on that very file. Full-weight runs only (a LoRA run publishes one base GGUF).")
    deltas: bool = Field(True, description="Also publish each full-weight version's model.safetensors and model.gguf "
                         "as a patch against the previous version (changed elements only, zstd; docs/protocol.md §6), "
                         "so a client holding that version downloads a few per cent of the file instead of all of it. "
                         "A client that cannot use a patch fetches the full file, which is always published.")
    anchor_every: int = Field(50, ge=1, description="Every this many versions is a full anchor, published without "
                              "patches: no client rebuilds a version through a chain of more than anchor_every - 1 "
                              "patches (1: never publish patches).")
    lag_tolerance: float = Field(0.5, description="Lazy publication between anchors (with deltas, 16-bit "
                                 "snapshots; coordinator/publish/lazy.py): an element of a bfloat16/float16 snapshot is "
                                 "republished only when its rounding of the learner's float32 weight moved more than "
                                 "lag_tolerance x eps x the tensor's RMS away from the published value (eps: 2^-7 for "
                                 "bfloat16). 0 publishes every rounding (every element that crossed a rounding "
                                 "boundary: 5-6x the patch bytes at lr 1e-5); anchors always publish the exact rounding. "
                                 "The learner keeps every update; its importance ratio corrects for the lag "
                                 "(docs/benchmarks.md, 'Delta snapshots', measures bytes, policy gap and learning).")
    lag_steps: float = Field(8.0, gt=0, le=1000, description="Caps lazy publication's threshold at lag_steps x "
                             "learner.lr, so that a published weight is never held back by more than about that many "
                             "steps of its movement (a held weight lags along its update: the policy gap grows with "
                             "it; docs/benchmarks.md, 'Lazy publication').")
    piece_kib: int = Field(16384, ge=64, le=262144, description="Piece size of the per-piece hashes in manifests "
                           "(KiB, a power of two): a client fetching from peers checks each piece as it arrives, so a "
                           "bad peer costs at most one piece.")

    @model_validator(mode="after")
    def _offered_once(self) -> SnapshotConfig:
        if self.gguf_also and self.gguf == "off":
            raise ValueError(f"snapshots.gguf_also = {self.gguf_also} offers precisions beside snapshots.gguf, which "
                             f"is 'off': set snapshots.gguf to the default precision (e.g. 'f16'), or gguf_also = []")
        repeated = sorted({p for p in self.gguf_also if p == self.gguf or self.gguf_also.count(p) > 1})
        if repeated:
            raise ValueError(f"snapshots.gguf_also names {', '.join(repeated)} twice (snapshots.gguf is "
                             f"{self.gguf!r}, published anyway): list each further precision once")
        return self

    def offered(self) -> tuple[str, ...]:
        """Every GGUF precision a version is published in, the default (snapshots.gguf, ``model.gguf``) first;
        () when the run publishes no GGUF."""
        return () if self.gguf == "off" else (self.gguf, *self.gguf_also)

    @field_validator("lag_tolerance")
    @classmethod
    def _tolerance(cls, v: float) -> float:
        if not 0 <= v <= 16:
            raise ValueError(f"lag_tolerance must be between 0 (publish every rounding) and 16 (a published weight "
                             f"may lag its master by 16 x eps x the tensor's RMS), not {v}; the default 0.5 holds "
                             f"elements back by about the rounding error of the tensor's typical element")
        return v

    @field_validator("piece_kib")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"piece_kib must be a power of two (e.g. 16384 for 16 MiB), not {v}")
        return v
