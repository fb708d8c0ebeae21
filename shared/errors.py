"""Typed protocol errors with machine-readable reason codes.

Every refusal the coordinator sends carries one of the reason codes below, an HTTP status, and a message
written for the volunteer who will read it. Clients map the same codes back to exceptions, so both sides
agree on what each failure means (see docs/protocol.md).
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Machine-readable refusal reasons. The value is what travels on the wire."""

    MALFORMED = "malformed"  # not decodable msgpack, wrong top-level type, duplicate keys, too deep
    BAD_HEADER = "bad_header"  # an HTTP header name or value that is not printable ASCII (the message names it)
    SCHEMA = "schema_invalid"  # decodes, but a field is missing, extra, of the wrong type or out of bounds
    PROTOCOL_VERSION = "protocol_version"  # the client speaks another protocol version
    BODY_TOO_LARGE = "body_too_large"
    UNKNOWN_CLIENT = "unknown_client"  # signed by a key the coordinator has never registered
    BAD_SIGNATURE = "bad_signature"
    CLIENT_ID_MISMATCH = "client_id_mismatch"  # client id is not derived from the presented public key
    BAD_RELAY = "bad_relay"  # the p2p relay header without the run's relay token (only the p2p role may send it)
    NOT_ADMIN = "not_admin"  # an admin request not signed by a key listed in the run's admin_keys file
    ADMIN_REFUSED = "admin_refused"  # an operator action that would break the run (e.g. removing the last key)
    STALE_REQUEST = "stale_request"  # timestamp outside the accepted clock-skew window
    REPLAYED_NONCE = "replayed_nonce"
    BANNED = "banned"
    UNKNOWN_JOB = "unknown_job"
    NOT_LEASE_HOLDER = "not_lease_holder"  # the job is leased to someone else, or the lease id is not current
    LEASE_EXPIRED = "lease_expired"
    JOB_COMPLETED = "job_completed"  # a result for this job was already accepted
    DUPLICATE_RESULT = "duplicate_result"  # token for token another job's accepted result: a copy
    WRONG_VERSION = "wrong_version"  # the result claims another version than the job it answers was bound to
    VERSION_RETIRED = "version_retired"  # the job's version is no longer kept, so its result cannot be verified
    BINDING_MISMATCH = "binding_mismatch"  # prompt hash, seed or group size differ from the signed job
    SHAPE_MISMATCH = "shape_mismatch"  # wrong number of completions, token/logprob lengths differ
    TOKEN_OUT_OF_RANGE = "token_out_of_range"  # token id outside the vocabulary, or too many tokens
    FINISH_REASON = "finish_reason_inconsistent"  # "stop" without a stop token, "length" while short
    LOGPROB_MISMATCH = "logprob_mismatch"  # reported behaviour logprobs disagree with the learner's recompute
    CHOICE_MISMATCH = "choice_mismatch"  # a token is not the one the job's keyed sampler picks (shared.sampler)
    SAMPLING_MISMATCH = "sampling_mismatch"  # tokens far more or less surprising than sampling the policy gives
    OBSERVATION_MISMATCH = "observation_mismatch"  # an episode's observation is not what replaying it gives
    EXTRA_TURN = "extra_turn"  # an episode turn after its end (done, or past the job's max_turns)
    MISSING_TURN = "missing_turn"  # an episode stops before its end (not done, fewer than max_turns turns)
    UNSEEN_ACTION = "unseen_action"  # the observation answers another action than the turn's tokens say
    REWARD_CLAIMED = "reward_claimed"  # a result reports a reward: rewards are computed by the coordinator
    ENVIRONMENT_MISMATCH = "environment_mismatch"  # the client's environment code differs from the job's
    REWARD_FAILED = "reward_failed"  # the run's reward function failed on this result (not the client's fault)
    PRECISION_NOT_OFFERED = "precision_not_offered"  # a lease asks for a precision this run does not publish
    QUARANTINED = "quarantined"  # too many invalid results in a row; no work until the quarantine ends
    RATE_LIMITED = "rate_limited"  # too many requests from this identity or address; slow down
    REGISTRATION_CLOSED = "registration_closed"  # private swarm: a valid invite token is needed to register
    NO_SUCH_VERSION = "no_such_version"
    NO_SUCH_BLOB = "no_such_blob"
    NOT_FOUND = "not_found"  # no such endpoint
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNAVAILABLE = "unavailable"  # a role the request needs (the verifiers) did not answer in time; resend later
    INTERNAL = "internal_error"


HTTP_STATUS: dict[Reason, int] = {
    Reason.MALFORMED: 400,
    Reason.BAD_HEADER: 400,
    Reason.SCHEMA: 422,
    Reason.PROTOCOL_VERSION: 426,
    Reason.BODY_TOO_LARGE: 413,
    Reason.UNKNOWN_CLIENT: 401,
    Reason.BAD_SIGNATURE: 401,
    Reason.CLIENT_ID_MISMATCH: 401,
    Reason.BAD_RELAY: 401,
    Reason.NOT_ADMIN: 401,
    Reason.ADMIN_REFUSED: 409,
    Reason.STALE_REQUEST: 401,
    Reason.REPLAYED_NONCE: 409,
    Reason.BANNED: 403,
    Reason.UNKNOWN_JOB: 404,
    Reason.NOT_LEASE_HOLDER: 403,
    Reason.LEASE_EXPIRED: 410,
    Reason.JOB_COMPLETED: 409,
    Reason.DUPLICATE_RESULT: 409,
    Reason.WRONG_VERSION: 409,
    Reason.VERSION_RETIRED: 410,
    Reason.BINDING_MISMATCH: 422,
    Reason.SHAPE_MISMATCH: 422,
    Reason.TOKEN_OUT_OF_RANGE: 422,
    Reason.FINISH_REASON: 422,
    Reason.LOGPROB_MISMATCH: 422,
    Reason.CHOICE_MISMATCH: 422,
    Reason.SAMPLING_MISMATCH: 422,
    Reason.OBSERVATION_MISMATCH: 422,
    Reason.EXTRA_TURN: 422,
    Reason.MISSING_TURN: 422,
    Reason.UNSEEN_ACTION: 422,
    Reason.REWARD_CLAIMED: 422,
    Reason.ENVIRONMENT_MISMATCH: 409,
    Reason.REWARD_FAILED: 422,
    Reason.PRECISION_NOT_OFFERED: 409,
    Reason.QUARANTINED: 403,
    Reason.RATE_LIMITED: 429,
    Reason.REGISTRATION_CLOSED: 403,
    Reason.NO_SUCH_VERSION: 404,
    Reason.NO_SUCH_BLOB: 404,
    Reason.NOT_FOUND: 404,
    Reason.METHOD_NOT_ALLOWED: 405,
    Reason.UNAVAILABLE: 503,
    Reason.INTERNAL: 500,
}


class EchoSwarmError(Exception):
    """Base class of every error this project raises on purpose."""


class ProtocolError(EchoSwarmError):
    """A message or request was refused. Carries the wire reason code and a human-readable message."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.reason]


class SignatureError(ProtocolError):
    """A signature did not verify (or the key/signature bytes were malformed)."""

    def __init__(self, message: str) -> None:
        super().__init__(Reason.BAD_SIGNATURE, message)


class IntegrityError(EchoSwarmError):
    """Downloaded content does not match the hash its signed manifest names."""
