"""The ``[verification]`` section: the verifier role's tolerances per recompute class, its sampling and choice
checks, and how its processes hold the model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from coordinator.config.base import StrictModel, cuda_device


class BackendTolerance(StrictModel):
    mean_tol: float = Field(gt=0, description="Max mean |Δ logprob| per token over a result (nats).")
    max_tol: float = Field(gt=0, description="Max |Δ logprob| of any single token (nats).")
    choice_tol: float | None = Field(None, gt=0, description="Largest keyed-sampler margin of any token, in logit "
                                     "units (÷ the job's temperature); None: verification.choice_tol.")


# Keyed-sampler margins (shared.sampler), in logit units: the check divides them by the job's temperature, as an
# honest margin is the two implementations' logit difference at a near-tie, divided by T. Torch clients are
# recomputed by torch from the same safetensors: margins exactly 0 (bit-identical logits), 0.02 leaves room for
# other devices' arithmetic. llama.cpp clients are recomputed by llama.cpp on the very GGUF file they ran
# (coordinator.engine.llama_verifier), replaying the client's own evaluations (prompt prefill, then one token at a
# time), so the kernels and their rounding are the client's. Source: tests/integration/test_llama_verifier.py and
# bench/choice_calibration.py --verifier own (docs/benchmarks.md, "Quantised volunteers"): 3,000 honest results at
# f16, q8_0, q6_K, q5_K_M, q4_K_M and q4_0, T 1.0 and 0.7, not one token off the keyed argmax, per-token |Δ logprob|
# ≤ 2e-6. The tolerance 0.1 is headroom for hardware the calibration has not seen (a CUDA or Metal client against a
# CPU verifier is unmeasured: docs/security.md §4; operators watch echo_swarm_choice_margin_ratio). Before issue 36 llama.cpp results were
# checked against a torch float32 recompute, and the quantisation itself had to pass: f16 0.5, q8_0 2.5.
CHOICE_TOL_TORCH = 0.02
CHOICE_TOL_LLAMA = 0.1

#: The GGUF precisions a run can publish (snapshots.gguf; coordinator.publish.gguf_export writes f32 and f16,
#: llama.cpp's quantiser the rest), each a backend class of llama.cpp results, "llama-<precision>".
GGUF_PRECISIONS = ("f32", "f16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_0")

# Logprob check of llama.cpp results against the same own-precision recompute: the reported logprobs are
# log_softmax of the very logits the verifier recomputes, so torch's tolerances hold (measured ≤ 2e-6 per token).
LLAMA_TOLERANCES: dict[str, BackendTolerance] = {
    f"llama-{p}": BackendTolerance(mean_tol=0.05, max_tol=1.0, choice_tol=CHOICE_TOL_LLAMA) for p in GGUF_PRECISIONS
}

# torch clients computing in bf16 (class "torch-bf16"), recomputed by the verifier in bf16 replaying the client's
# generations (coordinator.engine.torch_replay: prefill together, then one token at a time, same rows). Source:
# bench/choice_calibration.py --classes torch-bf16 --verifier own and tests/integration/test_torch_replay.py
# (docs/benchmarks.md, "torch clients computing in bf16"): on the same kind of CPU the replay has the client's logits
# bit for bit — margins 0, |Δ logprob| 0 over 1,800 results. What the replay cannot make equal is other hardware (a
# CUDA or MPS bf16 client against a CPU verifier: unmeasured, docs/security.md §4); on one CPU, bf16 arithmetic in
# another schedule (one teacher-forced pass) moved honest tokens by up to 0.047 logit and 0.11 nats, so the class gets
# the llama.cpp classes' 0.1 (about twice that), not torch's 0.02. Judged by the float32 pass instead, honest bf16
# results had margins up to 0.53 logit and about half were refused at torch's 0.02: a bf16 result must be recomputed
# in bf16.
CHOICE_TOL_TORCH_BF16 = 0.1
TORCH_TOLERANCES: dict[str, BackendTolerance] = {
    "torch-bf16": BackendTolerance(mean_tol=0.05, max_tol=1.0, choice_tol=CHOICE_TOL_TORCH_BF16),
}


class VerificationConfig(StrictModel):
    """Checks of reported behaviour logprobs against the verifier's recompute, and the verifier itself."""

    logprob_mean_tol: float = Field(0.05, gt=0, description="Max mean |Δ logprob| per token over a result (nats).")
    logprob_max_tol: float = Field(1.0, gt=0, description="Max |Δ logprob| of any single token (nats).")
    # Source: bench/sampling_calibration.py (docs/benchmarks.md, "Sampling test calibration"): 0 of 5,136 honest torch
    # and 5,012 llama.cpp (f16, q8_0) results refused at these defaults; honest |z| ≤ 4.08, |z_top| ≤ 3.39 seen.
    sampling_check: bool = Field(True, description="Refuse results whose tokens are far more or less surprising "
                                 "under the policy than sampling at the job's temperature makes them "
                                 "(reason sampling_mismatch; coordinator.core.verify.check_sampling).")
    sampling_z_low: float = Field(-6.0, lt=0, description="Lowest accepted z of a result's summed surprisal minus "
                                  "summed entropy (in standard deviations). Below it: greedy or cherry-picked.")
    sampling_z_high: float = Field(8.0, gt=0, description="Highest accepted z. Above it: tokens the policy would "
                                   "rarely sample (forced or junk). Higher than |z_low| because the surprisal of "
                                   "a sampled token has a long upper tail.")
    sampling_top_z: float = Field(6.0, gt=0, description="Largest accepted |z| of how often a result's tokens are "
                                  "the policy's likeliest, against how often sampling picks them. Above: greedy "
                                  "or cherry-picked; below minus it: forced tokens.")
    sampling_min_tokens: int = Field(64, ge=1, description="Results with fewer completion tokens are not judged by "
                                     "the sampling test (z is only near-normal over many tokens).")
    sampling_var_floor: float = Field(0.02, ge=0, description="Per-token variance added to the denominators of "
                                      "both z-scores (nats² for surprisal), so near-deterministic positions and "
                                      "float rounding across backends cannot produce a large z from nothing.")
    choice_check: bool = Field(True, description="Refuse results with a token that is not the job's keyed sampler's "
                               "choice from the verifier's logits (reason choice_mismatch; shared.sampler, "
                               "coordinator.core.verify.check_choices). Every token of every backend is checked.")
    choice_tol: float = Field(CHOICE_TOL_TORCH, gt=0, description="Largest accepted keyed-sampler margin of any "
                              "token for torch clients, in logit units: its noised score may lie this much ÷ the "
                              "job's temperature below the best one at its position. llama.cpp classes: "
                              "backend_tolerances.")
    request_window_s: float = Field(300.0, gt=0, description="Accepted clock skew of signed requests (seconds).")
    device: str = Field("auto", description="Device of the verifier's model replica ('cpu', 'cuda:1', ...); "
                        "'auto' uses model.device. Put it on another GPU than the learner's to keep the learner's "
                        "device for training only.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads of each verifier process (default: "
                                "learner.threads, else torch's choice). On a CPU-only host the learner and the "
                                "verifiers share the cores: keep their sum near the core count.")
    workers: int = Field(1, ge=1, le=16, description="Verifier processes `echo-swarm coordinator` starts (the "
                         "process layout). Each holds its own model replicas on `device`; results are shared "
                         "among them through the store.")
    claim_s: float = Field(60.0, gt=0, le=3600, description="Seconds a verifier's claim on a request lasts without "
                           "renewal; a request claimed by a verifier that died is taken by another after this.")
    wait_s: float = Field(600.0, gt=0, le=7200, description="Longest wait of the API for a verifier's answer; "
                          "past it the client is told to resend (HTTP 503) and nothing is recorded.")
    cached_versions: int = Field(1, ge=1, le=8, description="Policy versions the verifier keeps loaded at once "
                                 "(each a full model replica). 1 reloads a version's weights whenever results of "
                                 "another version arrive; 2 suits async push-pull with results of two versions.")
    placement: Literal["replicas", "fsdp"] = Field("replicas", description="How each verifier worker holds the "
                                                   "model: 'replicas' (one process, a whole replica on `device`) or "
                                                   "'fsdp' (a group of `world_size` ranks sharding each version "
                                                   "with FSDP2 and splitting each recompute batch among them; rank 0 "
                                                   "talks to the store, coordinator.engine.fsdp).")
    world_size: int = Field(1, ge=1, le=64, description="Ranks of each verifier worker with placement 'fsdp' (one "
                            "GPU each on CUDA, rank r on cuda:K+r for device 'cuda:K'; gloo processes on CPU).")
    mixed_precision: Literal["off", "bf16"] = Field("off", description="With placement 'fsdp': gather parameters "
                                                    "and compute in bf16 (as learner.mixed_precision does); the "
                                                    "tolerances above are unchanged.")
    backend_tolerances: dict[str, BackendTolerance] = Field(
        default_factory=lambda: LLAMA_TOLERANCES | TORCH_TOLERANCES,
        description="Per recompute class ('llama-f16', 'llama-q4_K_M', ...: 'llama-' and a published GGUF "
        "precision; 'torch-bf16'): tolerances that replace the ones above for results recomputed that way — "
        "llama.cpp clients' results, recomputed with llama.cpp on the very GGUF file their lease named, and torch "
        "clients' computed in bf16, whose generations the verifier replays in bf16. The class follows from the "
        "identity's pinned backend and the lease's precision, which must be one the run offers.")

    @model_validator(mode="after")
    def _ranks_need_fsdp_placement(self) -> VerificationConfig:
        if self.world_size > 1 and self.placement != "fsdp":
            raise ValueError(f"verification.world_size = {self.world_size} shards each verifier over ranks: set "
                             f"verification.placement = 'fsdp', or world_size = 1 (more single-device verifiers: "
                             f"verification.workers)")
        if self.mixed_precision != "off" and self.placement != "fsdp":
            raise ValueError("verification.mixed_precision needs verification.placement = 'fsdp'; for bf16 "
                             "replicas set model.dtype = 'bfloat16' instead")
        if self.placement == "fsdp" and self.device not in ("auto", "cpu") and not cuda_device(self.device):
            raise ValueError(f"verification.placement = 'fsdp' puts rank r on cuda:(K + r) for device 'cuda:K' "
                             f"(or runs gloo ranks on the CPU), so verification.device must be 'auto', 'cpu', "
                             f"'cuda' or 'cuda:K', not {self.device!r}")
        return self

    def tolerances(self, rclass: str) -> tuple[float, float]:
        """(mean, max) |Δ logprob| allowed for a result recomputed as ``rclass`` (core.trust.recompute_class:
        "torch", "llama-q4_K_M", ... — from the identity's pinned class and the precision its lease named, never
        from the result's own claim)."""
        tol = self.backend_tolerances.get(rclass)
        return (tol.mean_tol, tol.max_tol) if tol is not None else (self.logprob_mean_tol, self.logprob_max_tol)

    def choice_tolerance(self, rclass: str) -> float:
        """The largest keyed-sampler margin accepted from a result recomputed as ``rclass`` (as :meth:`tolerances`)."""
        tol = self.backend_tolerances.get(rclass)
        return tol.choice_tol if tol is not None and tol.choice_tol is not None else self.choice_tol
