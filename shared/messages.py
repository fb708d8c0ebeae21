"""Every message of the echo-swarm protocol, as a strict bounded schema.

All models are strict (no type coercion), forbid extra fields, bound every string, list and number, and
refuse NaN/inf. Field bounds here are the *protocol* limits; the coordinator applies tighter, job-specific
limits on top (a result may not carry more completions or tokens than its signed job allows).
docs/protocol.md documents each message; keep the two in step.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from shared import PROTOCOL_VERSION
from shared.safe_text import check_printable

# ---- bounds ---------------------------------------------------------------------------------------------
MAX_PROMPTS_PER_JOB = 256
MAX_GROUP_SIZE = 64
MAX_COMPLETIONS = 4096
MAX_NEW_TOKENS = 4096
MAX_PROMPT_TOKENS = 8192
MAX_TEXT_CHARS = 32_768
MAX_FILES_PER_SNAPSHOT = 256
MAX_SIGNED_JOB_BYTES = 4 * 1024 * 1024
MIN_PIECE_SIZE = 64 * 1024
MAX_PIECE_SIZE = 256 * 1024 * 1024
MAX_PIECES_PER_FILE = 65_536  # 1 TiB in 16 MiB pieces; the manifest's own 1 MiB cap binds first
MAX_TURNS = 64  # turns of one multi-turn episode
MAX_OBSERVATION_TOKENS = 1024  # tokens of one observation an environment returns

ClientId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
JobId = Annotated[str, StringConstraints(pattern=r"^[0-9A-Za-z_-]{1,64}$")]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
# Text a peer supplies that is shown to people (names, devices, run ids): no control, bidi-override or
# line-separator characters (shared.safe_text), so that it cannot forge log lines or act on a terminal.
ShortText = Annotated[str, StringConstraints(max_length=128), AfterValidator(check_printable)]
DisplayName = Annotated[str, StringConstraints(max_length=64), AfterValidator(check_printable)]
Nonce = Annotated[bytes, Field(min_length=16, max_length=32)]
Signature = Annotated[bytes, Field(min_length=64, max_length=64)]
Digest = Annotated[bytes, Field(min_length=32, max_length=32)]  # a raw sha256
PublicKey = Annotated[bytes, Field(min_length=32, max_length=32)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Version = Annotated[int, Field(ge=0, lt=2**31)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Timestamp = Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=1e11)]
LogProb = Annotated[float, Field(allow_inf_nan=False, ge=-1e4, le=1e-3)]
ProtocolNumber = Annotated[int, Field(ge=PROTOCOL_VERSION, le=PROTOCOL_VERSION)]
# Manifests are stored in the run directory and re-served after an upgrade. Protocols 2 and 3 changed lease replies
# and error codes only; protocol 4 added piece hashes to ManifestFile with defaults meaning "none", so a snapshot
# published under protocol 1 to 3 stays valid (it is fetched over HTTP only: peers need piece hashes); protocol 5
# added delta files (form "delta", base_sha256, result_sha256; defaults "none"), so every older manifest stays valid;
# protocol 6 added ManifestFile.precision (default "not stated").
MANIFEST_PROTOCOLS = (1, PROTOCOL_VERSION)
ManifestProtocolNumber = Annotated[int, Field(ge=MANIFEST_PROTOCOLS[0], le=MANIFEST_PROTOCOLS[1])]
AnyProtocolNumber = Annotated[int, Field(ge=0, lt=2**16)]  # envelope: checked explicitly → protocol_version
#: The precision a client computes in (protocol 6): a llama.cpp client's GGUF file ("f32" … "q4_0": the run's
#: snapshots.gguf and snapshots.gguf_also), a torch client's compute dtype ("f32", "bf16"). The coordinator
#: recomputes a result in the precision its lease named (docs/protocol.md §5).
Precision = Literal["f32", "bf16", "f16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_0"]


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


# ---- envelope: every client request ---------------------------------------------------------------------
class SignedRequest(Message):
    """Outer frame of every client POST. ``signature`` covers all other fields (see shared.crypto)."""

    protocol: AnyProtocolNumber
    client_id: ClientId
    timestamp: Timestamp
    nonce: Nonce
    path: Annotated[str, StringConstraints(pattern=r"^/v1/[a-z_/]{1,64}$")]
    body: Annotated[bytes, Field(max_length=64 * 1024 * 1024)]
    signature: Signature


class ErrorBody(Message):
    error: ShortText
    message: Annotated[str, StringConstraints(max_length=2048)]


# ---- registration ---------------------------------------------------------------------------------------
class ClientProfile(Message):
    """What a volunteer's machine reports about itself (informational; never trusted for security)."""

    name: DisplayName = ""
    team: DisplayName = ""  # optional: the team the volunteer counts for on the status page (`join --team`)
    backend: Literal["torch", "llama"]
    device: ShortText  # "cpu", "cuda:NVIDIA GeForce RTX 3060", "mps"
    platform: ShortText
    cpu_count: Annotated[int, Field(ge=0, le=4096)]
    memory_gb: Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=1e6)]
    software: ShortText
    # hardware detection and self-benchmark (optional: clients before these fields stay valid)
    gpu: ShortText | None = None  # "NVIDIA GeForce RTX 3060" (nvidia-smi), "Apple silicon", or None
    gpu_memory_gb: Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=1e5)] | None = None
    disk_free_gb: Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=1e9)] | None = None
    benchmark_tokens_per_s: Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=1e7)] | None = None


class RegisterRequest(Message):
    public_key: PublicKey
    profile: ClientProfile
    invite: ShortText = ""  # token for private swarms (registration.mode)


class RegisterResponse(Message):
    client_id: ClientId
    new: bool
    run_id: ShortText


# ---- jobs -----------------------------------------------------------------------------------------------
class SamplingParams(Message):
    """Sampling is the full softmax at ``temperature``: no top-k/top-p/min-p truncation, so the reported
    logprobs are exactly the behaviour policy's (a truncated sampler would make them wrong)."""

    temperature: Annotated[float, Field(allow_inf_nan=False, gt=0.0, le=4.0)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)]
    stop_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=16)]


class JobPrompt(Message):
    prompt_id: Annotated[int, Field(ge=0, lt=2**40)]
    token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    text: Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]


class EnvironmentSpec(Message):
    """A multi-turn job's environment (shared.envs): each of the group's episodes is reset from its prompt's seed
    and stepped with the model's actions, up to ``max_turns`` turns. ``code_sha256`` is the hash of the
    environment's code (shared.envs.code_hash): a client whose copy differs must not play the job."""

    env_id: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
    code_sha256: Sha256Hex
    params_json: Annotated[str, StringConstraints(max_length=4096)]  # the environment's parameters, canonical JSON
    seeds: Annotated[list[Seed], Field(min_length=1, max_length=MAX_PROMPTS_PER_JOB)]  # one per prompt, in order
    max_turns: Annotated[int, Field(ge=1, le=MAX_TURNS)]
    max_observation_tokens: Annotated[int, Field(ge=1, le=MAX_OBSERVATION_TOKENS)]


class Job(Message):
    """A rollout job, signed by the coordinator and leased to exactly one client."""

    protocol: ProtocolNumber
    run_id: ShortText
    job_id: JobId
    lease_id: JobId
    client_id: ClientId
    version: Version
    manifest_sha256: Sha256Hex  # the snapshot to generate with: sha256 of its signed manifest bytes
    prompts: Annotated[list[JobPrompt], Field(min_length=1, max_length=MAX_PROMPTS_PER_JOB)]
    prompt_hash: Sha256Hex
    group_size: Annotated[int, Field(ge=1, le=MAX_GROUP_SIZE)]
    sampling: SamplingParams
    seed: Seed
    issued_at: Timestamp
    deadline: Timestamp
    max_result_bytes: Annotated[int, Field(ge=1, le=64 * 1024 * 1024)]
    environment: EnvironmentSpec | None = None  # a multi-turn job: completions are episodes (Completion.turns)
    # protocol 6: the precision the lease asked for and the result is recomputed in (None: the run's default —
    # a llama.cpp client's snapshots.gguf, a torch client's float32); a llama.cpp client generates from that file
    precision: Precision | None = None


class SignedJob(Message):
    job: Annotated[bytes, Field(max_length=MAX_SIGNED_JOB_BYTES)]  # msgpack of Job
    signature: Signature


class LeaseRequest(Message):
    backend: Literal["torch", "llama"]
    held_version: Annotated[int, Field(ge=-1, lt=2**31)]  # -1: holds no snapshot yet
    # protocol 6: the precision this client computes in (a GGUF file the manifest lists, or a torch dtype); None:
    # the run's default. One the run does not offer is refused (precision_not_offered).
    precision: Precision | None = None


class LeaseResponse(Message):
    job: SignedJob | None
    retry_after_s: Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=3600.0)]
    current_version: Version
    finished: bool
    paused: bool = False  # the operator has paused issuing (`echo-swarm admin pause`): no job until resumed
    # the coordinator expects this client to work on `current_version` next: fetch it now, ahead of a job
    # (False: fetch a version only when a job needs it, so an idle swarm does not download every version)
    prefetch: bool = False


class ReleaseRequest(Message):
    job_id: JobId
    lease_id: JobId


class ReleaseResponse(Message):
    released: bool


# ---- results --------------------------------------------------------------------------------------------
class Turn(Message):
    """One turn of an episode: the model's action tokens (sampled as a completion is, with their logprobs) and the
    tokens of the observation the environment answered, as appended to the context (shared.envs.
    encode_observation). ``reward`` is never set by an honest client: rewards are the coordinator's to compute by
    replay, and a result that claims one is refused (reward_claimed)."""

    token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_NEW_TOKENS)]
    logprobs: Annotated[list[LogProb], Field(min_length=1, max_length=MAX_NEW_TOKENS)]
    finish_reason: Literal["stop", "length"]
    observation_ids: Annotated[list[TokenId], Field(max_length=MAX_OBSERVATION_TOKENS)]
    reward: FiniteFloat | None = None


class Completion(Message):
    """One sampled completion; for a multi-turn job, one episode: ``token_ids`` and ``logprobs`` empty, every turn
    in ``turns``."""

    token_ids: Annotated[list[TokenId], Field(max_length=MAX_NEW_TOKENS)]
    logprobs: Annotated[list[LogProb], Field(max_length=MAX_NEW_TOKENS)]
    finish_reason: Literal["stop", "length"]
    turns: Annotated[list[Turn], Field(max_length=MAX_TURNS)] | None = None


class ResultSubmission(Message):
    """Completions in prompt-major order: prompt 0's group, then prompt 1's group, ..."""

    job_id: JobId
    lease_id: JobId
    version: Version
    prompt_hash: Sha256Hex
    seed: Seed
    group_size: Annotated[int, Field(ge=1, le=MAX_GROUP_SIZE)]
    completions: Annotated[list[Completion], Field(min_length=1, max_length=MAX_COMPLETIONS)]
    backend: Literal["torch", "llama"]
    generation_s: Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=1e6)]


class SubmitResponse(Message):
    accepted: bool
    job_id: JobId
    mean_reward: FiniteFloat
    credit: FiniteFloat  # credit granted for this result
    total_credit: FiniteFloat


# ---- snapshots ------------------------------------------------------------------------------------------
class ManifestFile(Message):
    """One file of a version. ``form`` says which client needs it: "hf" (the Hugging Face safetensors folder,
    torch clients), "gguf" (a whole-model GGUF), "gguf-base" + "gguf-lora" (a base GGUF shared by every
    version of a LoRA run, plus this version's LoRA adapter): llama.cpp clients. "delta" (protocol 5): a patch
    (shared.deltas) that rebuilds the file ``result_sha256`` of this manifest from ``base_sha256``, the previous
    version's file of the same name; optional, a client that cannot use it fetches the full file."""

    path: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
    size: Annotated[int, Field(ge=0, le=2**40)]
    sha256: Sha256Hex
    form: Literal["hf", "gguf", "gguf-base", "gguf-lora", "delta"] = "hf"
    # protocol 4: sha256 of each piece_size-byte piece (the last one shorter), so that bytes from an untrusted peer
    # are checked piece by piece as they arrive; 0 and [] in manifests published before (HTTP only)
    piece_size: Annotated[int, Field(ge=0, le=MAX_PIECE_SIZE)] = 0
    pieces: Annotated[list[Digest], Field(max_length=MAX_PIECES_PER_FILE)] = []
    # protocol 5, form "delta" only: the file the patch applies to, and the file it rebuilds (listed in this manifest)
    base_sha256: Sha256Hex | None = None
    result_sha256: Sha256Hex | None = None
    # protocol 6, GGUF forms ("gguf", "gguf-base") only: the file's precision (its general.file_type), so a client
    # can choose the precision that fits its memory before downloading; None: not stated (an older manifest)
    precision: Precision | None = None

    @model_validator(mode="after")
    def _pieces_cover_the_file(self) -> ManifestFile:
        if (self.form == "delta") != (self.base_sha256 is not None) or (self.base_sha256 is None) != (
                self.result_sha256 is None):
            raise ValueError("a delta file names base_sha256 and result_sha256, and only a delta file does")
        if self.piece_size == 0:
            if self.pieces:
                raise ValueError("pieces without a piece_size")
            return self
        if self.piece_size < MIN_PIECE_SIZE or self.piece_size & (self.piece_size - 1):
            raise ValueError(f"piece_size must be a power of two from {MIN_PIECE_SIZE} to {MAX_PIECE_SIZE}")
        if len(self.pieces) != -(-self.size // self.piece_size):
            raise ValueError(f"{len(self.pieces)} piece hashes for {self.size} bytes in pieces of {self.piece_size}")
        return self


class Manifest(Message):
    """A policy version: the files of a Hugging Face model folder, each addressed by its sha256."""

    protocol: ManifestProtocolNumber
    run_id: ShortText
    version: Version
    created_at: Timestamp
    format: Literal["hf-safetensors"]
    files: Annotated[list[ManifestFile], Field(min_length=1, max_length=MAX_FILES_PER_SNAPSHOT)]

    @model_validator(mode="after")
    def _deltas_rebuild_listed_files(self) -> Manifest:
        whole = {f.sha256 for f in self.files if f.form != "delta"}
        if any(f.form == "delta" and f.result_sha256 not in whole for f in self.files):
            raise ValueError("a delta file's result_sha256 must be a (non-delta) file of the same manifest")
        return self


class SignedManifest(Message):
    manifest: Annotated[bytes, Field(max_length=1024 * 1024)]  # msgpack of Manifest
    signature: Signature


class Info(Message):
    protocol: AnyProtocolNumber  # any number decodes, so a client can say "upgrade" instead of "invalid"
    run_id: ShortText
    coordinator_public_key: PublicKey
    current_version: Version
    sync_mode: ShortText
    task: ShortText
    finished: bool
    server_time: Timestamp


# ---- notices (GET /v1/notices; docs/protocol.md §4) --------------------------------------------------------
MAX_NOTICES = 16  # the newest notices a board carries; older ones drop off
MAX_NOTICE_CHARS = 500
NoticeText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NOTICE_CHARS), AfterValidator(check_printable)]
#: A release number as `echo-swarm --version` prints it (1 to 4 dot-separated numbers): what a notice may ask for.
ReleaseNumber = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,6}(\.[0-9]{1,6}){0,3}$")]


class Notice(Message):
    """One message of the coordinator's operator to every volunteer: ``operator`` (anything), ``run`` (the run
    finished, the next one starts …) or ``update`` (this run needs ``min_client_version`` or newer)."""

    notice_id: Annotated[int, Field(ge=1, lt=2**53)]  # grows with every notice the run publishes
    at: Timestamp
    kind: Literal["operator", "run", "update"]
    text: NoticeText
    min_client_version: ReleaseNumber | None = None

    @model_validator(mode="after")
    def _update_names_its_version(self) -> Notice:
        if (self.kind == "update") != (self.min_client_version is not None):
            raise ValueError("an 'update' notice, and only one, names min_client_version")
        return self


class NoticeBoard(Message):
    """The run's notices in force, newest last, as of ``issued_at``."""

    run_id: ShortText
    issued_at: Timestamp
    notices: Annotated[list[Notice], Field(max_length=MAX_NOTICES)]


class SignedNotices(Message):
    board: Annotated[bytes, Field(max_length=64 * 1024)]  # msgpack of NoticeBoard
    signature: Signature


# ---- peer-to-peer snapshots (protocol 4; docs/protocol.md §6a) ---------------------------------------------
PeerIdText = Annotated[str, StringConstraints(pattern=r"^[1-9A-HJ-NP-Za-km-z]{16,128}$")]  # base58 libp2p peer id
Multiaddr = Annotated[str, StringConstraints(pattern=r"^(/[A-Za-z0-9._-]+){1,16}$", max_length=256)]


class P2PInfo(Message):
    """GET /v1/p2p: where the coordinator's libp2p peer listens (the DHT's bootstrap node), if it runs one."""

    enabled: bool
    peer_id: PeerIdText | None = None
    maddrs: Annotated[list[Multiaddr], Field(max_length=16)] = []


class LatestRecord(Message):
    """The DHT value under ``es1/<run_id>/latest``: the newest version, signed by the coordinator key clients pin.
    ``signature`` covers the DHT key, every other field and ``expires_at``, which must equal the record's DHT
    expiration, so a record can be neither forged, nor re-dated, nor moved to another key."""

    run_id: ShortText
    version: Version
    manifest_sha256: Sha256Hex
    created_at: Timestamp
    expires_at: Timestamp
    signature: Signature


class HolderEntry(Message):
    """The DHT value a peer stores under ``es1/<run_id>/blob/<sha256>``, in its own owner-signed subkey: it holds
    the whole verified file and serves it. ``served_bytes``: what it served peers so far (informational)."""

    peer_id: PeerIdText
    served_bytes: Annotated[int, Field(ge=0, lt=2**62)] = 0


MAX_CALL_BYTES = 16 * 1024 * 1024  # a signed call's body or reply over libp2p: the API's own envelope limit


class CallRequest(Message):
    """First frame of a ``/echo-swarm/call/1`` stream: a signed POST to ``path``; exactly ``length`` raw bytes
    follow (the SignedRequest envelope, as an HTTP body would carry it)."""

    path: Annotated[str, StringConstraints(pattern=r"^/v1/[a-z_/]{1,64}$")]
    length: Annotated[int, Field(ge=0, le=MAX_CALL_BYTES)]


class CallReply(Message):
    """The coordinator peer's frame: the HTTP status the API answered and the ``length`` of its reply body
    (msgpack: the endpoint's reply, or an ErrorBody), whose raw bytes follow; then the stream closes."""

    status: Annotated[int, Field(ge=100, le=599)]
    length: Annotated[int, Field(ge=0, le=MAX_CALL_BYTES)]


class BlobRequest(Message):
    """First frame of a ``/echo-swarm/blob/1`` stream: send the file from ``offset`` (a multiple of its
    piece_size) to its end."""

    sha256: Sha256Hex
    offset: Annotated[int, Field(ge=0, le=2**40)]


class BlobReply(Message):
    """The server's frame: ``ok`` (then exactly ``length`` raw bytes follow and the stream closes) or a refusal."""

    status: Literal["ok", "busy", "seeded", "no_such_blob", "relayed", "bad_request", "capped"]
    length: Annotated[int, Field(ge=0, le=2**40)] = 0
