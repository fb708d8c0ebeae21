"""Trust per identity: slow to earn, quick to lose.

Trust is kept per *identity* first: an identity's backend class is established by the coordinator at its
first registration, from a small fixed set (:data:`BACKEND_CLASSES`), and pinned to it (see
coordinator.api.guard), so claiming another backend or device later changes nothing — a quarantined identity
is quarantined whatever it claims. The trust row is keyed (client, class) only so that standings say which
class the evidence is about. A new identity starts with no standing, so rotating keys (a sybil) buys nothing:

- every accepted result — each of its tokens checked against the job's keyed sampler in the verifier's
  recompute (docs/security.md, § Keyed sampling) — raises ``consecutive_valid`` by one and clears the failure
  streak;
- any invalid result (a refusal for cheating-class reasons, :data:`INVALIDATING`) resets it to 0 and counts a
  failure; ``quarantine_after`` failures in a row quarantine the client for ``quarantine_s`` seconds (the n-th
  quarantine lasts n times longer), during which it is refused work with a clear message;
- a reporting pattern the keyed sampler cannot see (coordinator.core.reporting: leases abandoned after seeing
  the rewards) is a *flag*: it resets the valid streak, and every ``quarantine_after``-th flag quarantines, however
  many accepted results came between (:func:`on_flag`).

Only refusals that say something about the *result* count as failures: a late or duplicate submission,
a rate limit or a network-level problem is bad luck or a bug, not evidence of a cheat.
Everything here is pure: state in, decision out, with ``now`` passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.errors import ProtocolError, Reason

# refusals that are evidence about the result itself (poisoned, lazy, forged or broken hardware)
INVALIDATING: frozenset[Reason] = frozenset({
    Reason.WRONG_VERSION, Reason.BINDING_MISMATCH, Reason.SHAPE_MISMATCH, Reason.TOKEN_OUT_OF_RANGE,
    Reason.FINISH_REASON, Reason.LOGPROB_MISMATCH, Reason.SCHEMA, Reason.MALFORMED,
    Reason.BODY_TOO_LARGE, Reason.SAMPLING_MISMATCH, Reason.CHOICE_MISMATCH,
    # a multi-turn episode that replay refuses (coordinator.tasks.episodes)
    Reason.OBSERVATION_MISMATCH, Reason.EXTRA_TURN, Reason.MISSING_TURN, Reason.UNSEEN_ACTION, Reason.REWARD_CLAIMED,
})


# refusals that return the job's result all the same: it was checked, and refused for the coordinator's own failing,
# not the result's. Only these (and an accepted result) end a lease as returned (coordinator.store.job_rows): a
# refusal the client can cause at will — a copy of an earlier result (duplicate_result), a late or mismatched
# submission, a result broken on purpose — returns nothing that is trained, so it must not hide an abandoned lease
# from the selective-reporting rule (coordinator.core.reporting)
RETURNS_RESULT: frozenset[Reason] = frozenset({Reason.REWARD_FAILED})


@dataclass(frozen=True)
class TrustPolicy:
    """Parameters of the trust rules (see coordinator.config.TrustConfig for units and defaults)."""

    quarantine_after: int = 3
    quarantine_s: float = 600.0


@dataclass(frozen=True)
class TrustState:
    """One client's standing for one backend class."""

    consecutive_valid: int = 0
    consecutive_invalid: int = 0
    quarantines: int = 0
    quarantined_until: float = 0.0


def is_invalidating(reason: Reason) -> bool:
    return reason in INVALIDATING


def on_valid(state: TrustState) -> TrustState:
    """An accepted result raises trust by one and clears the failure streak."""
    return replace(state, consecutive_valid=state.consecutive_valid + 1, consecutive_invalid=0)


def on_invalid(state: TrustState, now: float, policy: TrustPolicy) -> TrustState:
    """An invalid result resets trust; enough of them in a row quarantine the client (longer each time)."""
    failures = state.consecutive_invalid + 1
    if failures >= policy.quarantine_after:
        n = state.quarantines + 1
        return TrustState(0, 0, n, now + policy.quarantine_s * n)
    return replace(state, consecutive_valid=0, consecutive_invalid=failures)


def on_flag(state: TrustState, flags: int, now: float, policy: TrustPolicy) -> TrustState:
    """The ``flags``-th lowering of trust by a pattern over many accepted results (coordinator.core.reporting):
    the valid streak resets, and every ``quarantine_after``-th flag quarantines (longer each time). Unlike refusals,
    flags are not cleared by accepted results in between — each of those results is part of the pattern."""
    if flags > 0 and flags % policy.quarantine_after == 0:
        n = state.quarantines + 1
        return TrustState(0, state.consecutive_invalid, n, now + policy.quarantine_s * n)
    return replace(state, consecutive_valid=0)


def quarantined(state: TrustState, now: float) -> bool:
    return now < state.quarantined_until


# The backend classes the coordinator verifies: what swarm_client really reports (hardware.profile: the torch
# backend's device "cpu" | "cuda[:name]" | "mps"; the llama.cpp backend's "cpu" | "gpu"). A class selects the
# verifier's tolerances (verification.backend_tolerances); a claim outside this set is refused at registration
# instead of becoming a class of its own that no tolerance was measured for.
BACKEND_CLASSES: dict[str, frozenset[str]] = {
    "torch": frozenset({"cpu", "cuda", "mps"}),
    "llama": frozenset({"cpu", "gpu"}),
}


def backend_class(backend: str, device: str) -> str:
    """The class a result is verified as: backend plus the accelerator kind."""
    kind = device.split(":", 1)[0].strip().lower() or "cpu"
    return f"{backend}/{kind}"


def known_class(backend: str, device: str) -> str | None:
    """The class of a registration's (backend, device) claim, or None when it is not one of BACKEND_CLASSES."""
    kind = device.split(":", 1)[0]  # exactly as the client reports it: no stripping, no case folding
    return f"{backend}/{kind}" if kind in BACKEND_CLASSES.get(backend, frozenset()) else None


#: The compute precisions a torch client may lease in (LeaseRequest.precision); None means "f32". A "bf16" result is
#: recomputed by a bf16 replay of its generations (coordinator.engine.torch_replay), class "torch-bf16".
TORCH_PRECISIONS: tuple[str, ...] = ("f32", "bf16")


def lease_precision(pinned: str, asked: str | None, offered: tuple[str, ...]) -> str | None:
    """The precision a lease of an identity pinned to ``pinned`` is granted in (what its result is recomputed in),
    given what it ``asked`` (LeaseRequest.precision, None: the run's default) and the GGUF precisions the run
    ``offered`` (snapshots.offered(), default first). A llama.cpp class gets a GGUF precision (None when the run
    publishes none: such a client cannot generate, and says so itself); a torch class one of TORCH_PRECISIONS,
    None for the default float32. Anything else — a torch identity asking for a GGUF precision, a llama.cpp one
    for a file the run does not publish — is refused, so a class can never be shopped for by asking."""
    if class_backend(pinned) == "llama":
        if asked is None or asked in offered:
            return asked if asked is not None else (offered[0] if offered else None)
        where = f"publishes GGUF at {', '.join(offered)}" if offered else "publishes no GGUF (torch clients only)"
        raise ProtocolError(Reason.PRECISION_NOT_OFFERED, f"this run {where}, not {asked}; lease with one of them "
                            f"(`join --precision auto` takes the best that fits this machine)")
    if asked is None or asked == "f32":
        return None
    if asked in TORCH_PRECISIONS:
        return asked
    raise ProtocolError(Reason.PRECISION_NOT_OFFERED, f"a torch client computes in {', '.join(TORCH_PRECISIONS)}, "
                        f"not {asked}; GGUF precisions are for llama.cpp clients (join --backend llama)")


def recompute_class(pinned: str, precision: str | None) -> str:
    """What recomputes a result of an identity pinned to ``pinned`` whose lease named ``precision``
    (:func:`lease_precision`): "llama-<precision>" (llama.cpp on that very GGUF file,
    coordinator.engine.llama_verifier) for a llama.cpp class, "torch-<precision>" for a torch class computing in
    another dtype than float32, "torch" otherwise. Its logprobs are the result's π_b, so the learner groups its
    metrics by it too."""
    if class_backend(pinned) == "llama":
        return f"llama-{precision}" if precision is not None else "torch"
    return f"torch-{precision}" if precision in TORCH_PRECISIONS and precision != "f32" else "torch"


def class_backend(bclass: str) -> str:
    """The backend half of a class ('llama/cpu' → 'llama'); a bare backend name is returned as it is."""
    return bclass.split("/", 1)[0]


def describe_classes() -> str:
    """The accepted classes, for refusal messages: 'torch on cpu, cuda or mps; llama on cpu or gpu'."""
    return "; ".join(f"{b} on {', '.join(sorted(k))}" for b, k in BACKEND_CLASSES.items())
