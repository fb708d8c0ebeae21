"""Builders of valid protocol messages for the unit tests (one valid instance of every message)."""

from __future__ import annotations

from typing import Any

from shared import PROTOCOL_VERSION
from shared.messages import (
    BlobReply,
    BlobRequest,
    CallReply,
    CallRequest,
    ClientProfile,
    Completion,
    EnvironmentSpec,
    ErrorBody,
    HolderEntry,
    Info,
    Job,
    JobPrompt,
    LatestRecord,
    LeaseRequest,
    LeaseResponse,
    Manifest,
    ManifestFile,
    Message,
    Notice,
    NoticeBoard,
    P2PInfo,
    RegisterRequest,
    RegisterResponse,
    ReleaseRequest,
    ReleaseResponse,
    ResultSubmission,
    SamplingParams,
    SignedJob,
    SignedManifest,
    SignedNotices,
    SignedRequest,
    SubmitResponse,
    Turn,
)

CLIENT_ID = "0123456789abcdef0123456789abcdef"
SHA = "ab" * 32
PEER = "12D3KooW" + "A" * 44  # a base58 libp2p peer id


def profile(**kw: Any) -> ClientProfile:
    fields: dict[str, Any] = dict(name="box", backend="torch", device="cpu", platform="linux", cpu_count=8,
                                  memory_gb=16.0, software="echo-swarm 0.1")
    return ClientProfile(**(fields | kw))


def sampling(**kw: Any) -> SamplingParams:
    return SamplingParams(**({"temperature": 1.0, "max_tokens": 8, "stop_token_ids": [2]} | kw))


def job(**kw: Any) -> Job:
    fields: dict[str, Any] = dict(
        protocol=PROTOCOL_VERSION, run_id="run-1", job_id="v0-j0", lease_id="lease_abc", client_id=CLIENT_ID,
        version=0, manifest_sha256=SHA, prompts=[JobPrompt(prompt_id=3, token_ids=[5, 6, 7], text="Q: 1+2= A:")],
        prompt_hash="cd" * 32, group_size=2, sampling=sampling(), seed=12345, issued_at=1000.0, deadline=1120.0,
        max_result_bytes=1 << 20,
    )
    return Job(**(fields | kw))


def completion(**kw: Any) -> Completion:
    return Completion(**({"token_ids": [4, 2], "logprobs": [-0.5, -0.25], "finish_reason": "stop"} | kw))


def submission(**kw: Any) -> ResultSubmission:
    fields: dict[str, Any] = dict(
        job_id="v0-j0", lease_id="lease_abc", version=0, prompt_hash="cd" * 32, seed=12345, group_size=2,
        completions=[completion(), completion()], backend="torch", generation_s=1.5,
    )
    return ResultSubmission(**(fields | kw))


def manifest(**kw: Any) -> Manifest:
    fields: dict[str, Any] = dict(
        protocol=PROTOCOL_VERSION, run_id="run-1", version=3, created_at=1234.5, format="hf-safetensors",
        files=[ManifestFile(path="model.safetensors", size=10, sha256=SHA)],
    )
    return Manifest(**(fields | kw))


def all_messages() -> list[Message]:
    """One valid instance of every message in shared/messages.py (nested ones included)."""
    sig = bytes(range(64))
    signed_job = SignedJob(job=b"\x80", signature=sig)
    return [
        SignedRequest(protocol=PROTOCOL_VERSION, client_id=CLIENT_ID, timestamp=1_700_000_000.25,
                      nonce=b"n" * 16, path="/v1/lease", body=b"\x80", signature=sig),
        ErrorBody(error="bad_signature", message="signature does not verify"),
        profile(),
        RegisterRequest(public_key=b"k" * 32, profile=profile()),
        RegisterResponse(client_id=CLIENT_ID, new=True, run_id="run-1"),
        sampling(),
        JobPrompt(prompt_id=0, token_ids=[1], text=""),
        job(),
        signed_job,
        LeaseRequest(backend="llama", held_version=-1),
        LeaseResponse(job=signed_job, retry_after_s=0.5, current_version=4, finished=False),
        LeaseResponse(job=None, retry_after_s=2.0, current_version=4, finished=True),
        LeaseResponse(job=None, retry_after_s=0.0, current_version=5, finished=False, prefetch=True),
        ReleaseRequest(job_id="v0-j0", lease_id="lease_abc"),
        ReleaseResponse(released=True),
        completion(),
        completion(token_ids=[], logprobs=[], finish_reason="length"),
        Turn(token_ids=[5], logprobs=[-0.5], finish_reason="length", observation_ids=[7, 8]),
        completion(token_ids=[], logprobs=[], turns=[Turn(token_ids=[2], logprobs=[-1.0], finish_reason="stop",
                                                          observation_ids=[])]),
        EnvironmentSpec(env_id="gridworld", code_sha256=SHA, params_json='{"height":3,"width":3}', seeds=[3, 9],
                        max_turns=4, max_observation_tokens=16),
        job(environment=EnvironmentSpec(env_id="sokoban", code_sha256=SHA, params_json="{}", seeds=[1],
                                        max_turns=8, max_observation_tokens=64)),
        submission(),
        SubmitResponse(accepted=True, job_id="v0-j0", mean_reward=0.5, credit=1.0, total_credit=-3.0),
        ManifestFile(path="config.json", size=0, sha256=SHA),
        manifest(),
        SignedManifest(manifest=b"\x80", signature=sig),
        Notice(notice_id=1, at=1_700_000_000.0, kind="operator", text="a new run starts on Monday"),
        NoticeBoard(run_id="run-1", issued_at=1_700_000_000.0,
                    notices=[Notice(notice_id=2, at=1_700_000_000.0, kind="update", text="please update",
                                    min_client_version="0.2.0")]),
        SignedNotices(board=b"\x80", signature=sig),
        Info(protocol=PROTOCOL_VERSION, run_id="run-1", coordinator_public_key=b"p" * 32, current_version=7,
             sync_mode="sequential-pull", task="arithmetic", finished=False, server_time=1_700_000_000.0),
        ManifestFile(path="model.safetensors", size=3 << 20, sha256=SHA, piece_size=1 << 20, pieces=[b"d" * 32] * 3),
        P2PInfo(enabled=True, peer_id=PEER, maddrs=["/ip4/127.0.0.1/tcp/4001"]),
        P2PInfo(enabled=False),
        LatestRecord(run_id="run-1", version=7, manifest_sha256=SHA, created_at=1_700_000_000.0,
                     expires_at=1_700_000_300.0, signature=sig),
        HolderEntry(peer_id=PEER, served_bytes=1 << 20),
        BlobRequest(sha256=SHA, offset=1 << 20),
        CallRequest(path="/v1/results", length=8 << 20),
        CallReply(status=409, length=120),
        BlobReply(status="ok", length=2 << 20),
        BlobReply(status="busy"),
    ]


def valid_dict(message: Message) -> dict[str, Any]:
    """The plain-value form of a message, as it would be decoded from the wire."""
    return message.model_dump(mode="python")
