"""A malicious or broken volunteer, as a real client process: its own Ed25519 identity (swarm_client.identity),
the production HTTP client (swarm_client.api), the real snapshot cache and torch backend — and one corruption.

    python -m tests.adversarial.adversary KIND --url URL --home DIR --out report.json

It does what an honest client does (register, lease, fetch the signed snapshot, generate with the job's
seed), then corrupts one thing and sends it. The report (JSON) lists every attempt's HTTP status and reason
code and every identity it used, so the test can check the refusals and that nothing reached training.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import json
import random
import time
from pathlib import Path
from typing import Any

import aiohttp

from shared import crypto, wire
from shared.errors import ProtocolError
from shared.messages import (
    ClientProfile,
    ErrorBody,
    Info,
    Job,
    LeaseRequest,
    LeaseResponse,
    RegisterRequest,
    RegisterResponse,
    ReleaseRequest,
    ReleaseResponse,
    ResultSubmission,
)
from shared.records import open_job
from swarm_client.api import CoordinatorClient, RetryPolicy
from swarm_client.backends.torch_backend import TorchBackend
from swarm_client.hardware import profile
from swarm_client.identity import Identity, load_identity
from swarm_client.snapshots import SnapshotCache

NO_RETRY = RetryPolicy(attempts=1)
HUNT_PACE_S = 0.15  # seconds between an accomplice's released offer and its next lease request
HUNT_S = 15.0  # how long an accomplice looks for a job linked to its partner's result among the jobs it is offered
BEST_OF = 16  # best-of-N cherry-picking: N honest draws per prompt, the group_size best by reward kept
STEER_TARGET = " 42"  # top-k steering pushes every completion toward this string
STEER_K = 5


def claim(name: str, backend: str, device: str) -> ClientProfile:
    """A registration profile claiming any backend and device (the real one, with two fields replaced)."""
    return profile("torch", "cpu", name).model_copy(update={"backend": backend, "device": device})


class Adversary:
    def __init__(self, url: str, home: Path) -> None:
        self.url = url.rstrip("/")
        self.home = home
        self.attempts: list[dict[str, Any]] = []
        self.identities: list[str] = []
        self.apis: list[CoordinatorClient] = []
        self.info: Info | None = None
        self.backend: TorchBackend | None = None
        self.notes: dict[str, Any] = {}  # observations beyond the attempts (e.g. whether a linked job was recognised)
        self.seconds = 30.0  # how long a timed kind (idle_sybil) runs at most
        self.leases = 100  # how many distinct jobs a counting kind (above_median) computes
        # the backend its identities register as and its results claim: "llama" for the llama_* kinds, which make
        # the same cheats through a llama.cpp identity (verified by llama.cpp on the job's own GGUF file)
        self.claim: str = "torch"
        self.precision: str | None = None  # what its leases ask for (LeaseRequest.precision; None: the default)
        self._llama: Any = None
        self.until: Path | None = None  # ... or until this file appears

    # -- plumbing -----------------------------------------------------------------------------------------
    async def identity(self, name: str, *, register: bool = True, backend: str | None = None, device: str = "cpu"
                       ) -> CoordinatorClient:
        """A fresh identity (registered claiming ``backend`` (default: :attr:`claim`) on ``device``; it computes with
        torch on the CPU, whatever it claims, except for its honest results under a llama.cpp claim)."""
        backend = backend or self.claim
        ident = load_identity(self.home / name)
        api = CoordinatorClient(self.url, ident, retry=NO_RETRY)
        self.apis.append(api)
        self.identities.append(ident.client_id)
        if self.info is None:
            self.info = await api.info()
        if register:
            await api.post("/v1/register", RegisterRequest(public_key=ident.public_key,
                                                           profile=claim(f"adversary-{name}", backend, device)),
                           RegisterResponse)
            await self.warm(api)
        return api

    async def warm(self, api: CoordinatorClient) -> None:
        """Load torch and the current snapshot before leasing, so the lease does not run out while loading."""
        assert self.info is not None
        if self.backend is None:
            self.backend = TorchBackend(device="cpu", threads=1)
        info = await api.info()
        cache = SnapshotCache(self.home / "cache", api, info.coordinator_public_key)
        self.backend.load(await cache.ensure(info.run_id, info.current_version, None))

    async def close(self) -> None:
        for api in self.apis:
            await api.close()

    def envelope(self, ident: Identity, path: str, body: bytes, timestamp: float | None = None) -> bytes:
        return wire.encode(crypto.sign_request(ident.key, path, body, timestamp=timestamp or time.time()))

    async def send(self, api: CoordinatorClient, path: str, data: bytes, what: str, method: str = "POST",
                   headers: dict[str, str] | None = None) -> dict[str, Any]:
        try:
            async with api.session.request(method, self.url + path, data=data,
                                           headers=headers or {"Content-Type": "application/msgpack"}) as resp:
                raw, status = await resp.read(), resp.status
        except aiohttp.ClientError as exc:  # the server may close the connection on a body it will not read
            failed: dict[str, Any] = {"what": what, "status": 0, "reason": None,
                                      "message": f"{type(exc).__name__}: {exc}"}
            self.attempts.append(failed)
            return failed
        reason, message = None, ""
        if status != 200:
            try:
                err = wire.decode(raw, ErrorBody, max_bytes=64 * 1024)
                reason, message = err.error, err.message
            except ProtocolError:
                message = raw[:200].decode(errors="replace")
        entry: dict[str, Any] = {"what": what, "status": status, "reason": reason, "message": message,
                                 "at": round(time.time(), 2)}
        if path == "/v1/lease" and status == 200:
            entry["raw"] = raw
        self.attempts.append(entry)
        return entry

    async def submit(self, api: CoordinatorClient, body: bytes | ResultSubmission, what: str) -> dict[str, Any]:
        raw = body if isinstance(body, bytes) else wire.encode(body)
        return await self.send(api, "/v1/results", self.envelope(api.identity, "/v1/results", raw), what)

    async def cheat(self, api: CoordinatorClient, job: Job, sub: ResultSubmission, what: str) -> dict[str, Any]:
        """Submit a cheating result, noting whether its tokens happen to be exactly the job's honest keyed sample:
        then it is honest work (the keyed sampler's choice at every position) and is accepted — the test expects
        exactly that, and counts how often it happens (issue 21). Then the job is released, as every other kind
        releases its job once refused (and the reference client does, docs/protocol.md §1): a refused result does
        not end the lease, and a lease of an identity of unknown pace kept to its deadline holds the one turn new
        identities get (§4), so the other attackers waited a lease timeout for each cheat."""
        honest = await self.honest(api, job)
        same = [list(c.token_ids) for c in honest.completions] == [list(c.token_ids) for c in sub.completions]
        entry = await self.submit(api, sub, what)
        entry["same_as_honest"] = same
        await self.release(api, job)  # released=false once accepted: the job is done
        return entry

    async def lease(self, api: CoordinatorClient, timeout: float = 120.0) -> Job:
        assert self.info is not None
        give_up = time.monotonic() + timeout
        empty: list[LeaseResponse] = []  # the replies without a job (a refusal raises, with its reason)
        while time.monotonic() < give_up:
            resp = await api.post("/v1/lease", LeaseRequest(backend=self.claim, held_version=-1,  # type: ignore[arg-type]
                                                            precision=self.precision), LeaseResponse)  # type: ignore[arg-type]
            if resp.job is not None:
                job = open_job(resp.job, self.info.coordinator_public_key)
                self.notes.setdefault("leased_precisions", []).append(job.precision)  # the file it is judged on
                return job
            empty.append(resp)
            await asyncio.sleep(min(resp.retry_after_s, 1.0))
        raise TimeoutError(f"no job was offered in {timeout:.0f} s: {len(empty)} replies with job=null"
                           + (f" at versions {empty[0].current_version}..{empty[-1].current_version} (finished "
                              f"{sum(r.finished for r in empty)}, paused {sum(r.paused for r in empty)})" if empty else ""))

    async def release(self, api: CoordinatorClient, job: Job) -> None:
        await api.post("/v1/release", ReleaseRequest(job_id=job.job_id, lease_id=job.lease_id), ReleaseResponse)

    async def job_folder(self, api: CoordinatorClient, job: Job) -> Path:
        """The job's verified snapshot in this client's cache, in the precision its lease names (a llama.cpp client
        runs that GGUF file)."""
        assert self.info is not None
        cache = SnapshotCache(self.home / "cache", api, self.info.coordinator_public_key)
        cache.precision = job.precision
        return await cache.ensure(job.run_id, job.version, job.manifest_sha256)

    async def honest(self, api: CoordinatorClient, job: Job, backend: TorchBackend | None = None) -> ResultSubmission:
        """What an honest client would send for this job (the real cache, backend and seeded sampler)."""
        folder = await self.job_folder(api, job)
        if self.claim == "llama" and backend is None:  # what an honest llama.cpp client sends: its own GGUF's sample
            from swarm_client.backends.llama_backend import LlamaBackend

            self._llama = self._llama or LlamaBackend(device="cpu", threads=1, n_ctx=256)
            self._llama.load(folder)
            samples = self._llama.generate(job, lambda: False)
        else:
            backend = backend or self.backend or TorchBackend(device="cpu", threads=1)
            backend.load(folder)
            samples = backend.generate(job, lambda: False)
        return ResultSubmission(job_id=job.job_id, lease_id=job.lease_id, version=job.version,
                                prompt_hash=job.prompt_hash, seed=job.seed, group_size=job.group_size,
                                backend=self.claim, generation_s=0.1,  # type: ignore[arg-type]
                                completions=[s.to_completion() for s in samples])

    async def lease_as(self, api: CoordinatorClient, backend: str, what: str) -> dict[str, Any]:
        """One signed lease request claiming ``backend``, recorded as an attempt."""
        body = wire.encode(LeaseRequest(backend=backend, held_version=-1))  # type: ignore[arg-type]
        return await self.send(api, "/v1/lease", self.envelope(api.identity, "/v1/lease", body), what)

    async def cherry_picked(self, api: CoordinatorClient) -> tuple[Job, ResultSubmission]:
        """Lease a job and answer it with real policy samples and their true logprobs — drawn with another seed
        (as if picked among several draws): the logprob check passes, only the keyed sampler's choice can tell."""
        job = await self.lease(api)
        own = job.model_copy(update={"seed": (job.seed + 1) % 2**63})
        sub = await self.honest(api, own)
        return job, sub.model_copy(update={"seed": job.seed})

    async def hunt(self, api: CoordinatorClient, target: Job, seconds: float = HUNT_S, *, sit: bool = False,
                   answer: Any = None) -> None:
        """An accomplice takes every job it is offered for ``seconds``, looking for a job linked to ``target``
        (the same seed, or the same prompts, under any id). Found: ``answer(job)`` is submitted for it, or with
        ``sit`` the lease is kept and never returned; every other job is released at once."""
        assert self.info is not None
        give_up = time.monotonic() + seconds
        offered = found = 0
        kept: list[Job] = []
        hard_stop = time.monotonic() + 8 * seconds  # a busy queue may offer nothing for a while: look until one
        while time.monotonic() < give_up or (offered == 0 and time.monotonic() < hard_stop):
            resp = await api.post("/v1/lease", LeaseRequest(backend="torch", held_version=-1), LeaseResponse)
            if resp.job is None:
                await asyncio.sleep(min(resp.retry_after_s, 0.5))
                continue
            job = open_job(resp.job, self.info.coordinator_public_key)
            offered += 1
            if job.job_id != target.job_id and (job.seed == target.seed or job.prompt_hash == target.prompt_hash):
                found += 1
                if sit:
                    kept.append(job)
                    continue
                if answer is not None:
                    await self.submit(api, answer(job), f"answer to the recognised job {job.job_id}")
                    continue
            await self.release(api, job)
            # two signed requests per offer: pace them under the per-identity limit (limits.per_identity_rps,
            # 20/s with a burst of 60), as a patient attacker would, instead of being refused with 429
            await asyncio.sleep(HUNT_PACE_S)
        self.notes["offered"] = offered
        self.notes["recognised"] = found

    # -- results made of chosen tokens, sent with their true logprobs (so only the token choice is wrong) ---------
    async def policy(self, api: CoordinatorClient, job: Job) -> tuple[Any, Any]:
        """The job's snapshot as a torch model, and its tokenizer (coordinator.tasks.text.TextCodec)."""
        from coordinator.tasks.text import TextCodec
        from shared.policy import load_model

        assert self.info is not None
        cache = SnapshotCache(self.home / "cache", api, self.info.coordinator_public_key)
        folder = await cache.ensure(job.run_id, job.version, job.manifest_sha256)
        return load_model(folder).eval(), TextCodec.from_folder(folder)

    @staticmethod
    def rollout_prompts(job: Job) -> list[list[int]]:
        return [list(p.token_ids) for p in job.prompts for _ in range(job.group_size)]

    def true_result(self, job: Job, model: Any, completions: list[list[int]]) -> ResultSubmission:
        """A result of exactly these tokens with each token's true behaviour logprob under the job's snapshot and
        temperature, and the finish reasons the shape rules demand: nothing but the choice of tokens is forged."""
        import torch

        from shared.messages import Completion
        from shared.policy import completion_logprobs

        stops = set(job.sampling.stop_token_ids)
        pad = job.sampling.stop_token_ids[0]
        with torch.no_grad():
            lp, _ = completion_logprobs(model, Adversary.rollout_prompts(job), completions,
                                        temperature=job.sampling.temperature, pad_id=pad)
        comps = [Completion(token_ids=c, logprobs=[min(0.0, x) for x in row[: len(c)]],
                            finish_reason="stop" if c[-1] in stops else "length")
                 for c, row in zip(completions, lp.tolist(), strict=True)]
        return ResultSubmission(job_id=job.job_id, lease_id=job.lease_id, version=job.version,
                                prompt_hash=job.prompt_hash, seed=job.seed, group_size=job.group_size,
                                backend=self.claim, generation_s=0.1, completions=comps)  # type: ignore[arg-type]

    @staticmethod
    def decode_steered(job: Job, model: Any, pick: Any) -> list[list[int]]:
        """Decode every rollout one token at a time, the token chosen by ``pick(logits, position, row)`` from the
        tempered logits instead of sampled: the shape a truncating or steering client produces."""
        import torch

        stops = set(job.sampling.stop_token_ids)
        out: list[list[int]] = []
        with torch.no_grad():
            for row, prompt in enumerate(Adversary.rollout_prompts(job)):
                ids = list(prompt)
                comp: list[int] = []
                while len(comp) < job.sampling.max_tokens:
                    logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float() / job.sampling.temperature
                    tok = int(pick(logits, len(comp), row))
                    comp.append(tok)
                    ids.append(tok)
                    if tok in stops:
                        break
                out.append(comp)
        return out

    @staticmethod
    def task_items(job: Job) -> tuple[Any, list[Any]]:
        """The run's task (the default arithmetic one, rebuilt here as the coordinator builds it) and the item of
        each of the job's prompts: what a reward-farming client computes for itself."""
        from coordinator.config import CoordinatorConfig
        from coordinator.tasks.factory import make_task

        task = make_task(CoordinatorConfig().task)
        return task, [task.train[p.prompt_id] for p in job.prompts]

    @staticmethod
    def tamper(sub: ResultSubmission, **changes: Any) -> bytes:
        data = copy.deepcopy(sub.model_dump())
        data.update(changes)
        return wire.pack(data)

    # -- the kinds ----------------------------------------------------------------------------------------
    async def forged_signature(self) -> None:
        api = await self.identity("a")
        victim = await self.identity("victim")
        job = await self.lease(api)
        sub = await self.honest(api, job)
        env = bytearray(self.envelope(api.identity, "/v1/results", wire.encode(sub)))
        env[-5] ^= 0xFF  # inside the trailing signature
        await self.send(api, "/v1/results", bytes(env), "flipped signature byte")
        req = wire.unpack(self.envelope(api.identity, "/v1/results", wire.encode(sub)))
        req["client_id"] = victim.identity.client_id  # claim to be someone else, signed with our key
        await self.send(api, "/v1/results", wire.pack(req), "signed as another client")
        await self.release(api, job)

    async def replayed_result(self) -> None:
        api = await self.identity("a")
        job = await self.lease(api)
        sub = await self.honest(api, job)
        data = self.envelope(api.identity, "/v1/results", wire.encode(sub))
        first = await self.send(api, "/v1/results", data, "honest submission (the one to replay)")
        assert first["status"] == 200, first
        await self.send(api, "/v1/results", data, "byte-identical replay")

    async def other_clients_lease(self) -> None:
        holder = await self.identity("holder")
        thief = await self.identity("thief")
        job = await self.lease(holder)
        sub = await self.honest(holder, job)
        await self.submit(thief, sub, "result for another client's lease")
        await self.release(holder, job)

    async def late_result(self) -> None:
        api = await self.identity("a")
        job = await self.lease(api)
        sub = await self.honest(api, job)
        assert self.info is not None
        wait = job.deadline - time.time() + 1.0
        await asyncio.sleep(max(0.0, wait))  # hold the job past its lease deadline
        await self.submit(api, sub, f"result {wait:.1f}s after it was due")

    async def wrong_version(self) -> None:
        api = await self.identity("a")
        job = await self.lease(api)
        sub = await self.honest(api, job)
        await self.submit(api, self.tamper(sub, version=job.version + 1), "claims a newer policy version")
        await self.release(api, job)

    async def inflated_reward(self) -> None:
        api = await self.identity("a")
        job = await self.lease(api)
        sub = await self.honest(api, job)
        data = sub.model_dump()
        data["rewards"] = [1.0] * len(sub.completions)  # rewards are recomputed by the coordinator, never read
        await self.submit(api, wire.pack(data), "self-reported perfect rewards")
        await self.release(api, job)

    async def fabricated_logprobs(self) -> None:
        api = await self.identity("a")
        job = await self.lease(api)
        sub = await self.honest(api, job)
        comps = [c.model_dump() | {"logprobs": [-0.01] * len(c.token_ids)} for c in sub.completions]
        await self.submit(api, self.tamper(sub, completions=comps), "logprobs made up")
        await self.release(api, job)

    async def other_model(self) -> None:
        import torch

        api = await self.identity("a")
        job = await self.lease(api)
        backend = self.backend or TorchBackend(device="cpu", threads=1)
        await self.honest(api, job, backend)  # loads the snapshot; then swap in a different model
        torch.manual_seed(1234)
        with torch.no_grad():
            for p in backend.model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        samples = backend.generate(job, lambda: False)  # its own, self-consistent tokens and logprobs
        sub = ResultSubmission(job_id=job.job_id, lease_id=job.lease_id, version=job.version,
                               prompt_hash=job.prompt_hash, seed=job.seed, group_size=job.group_size,
                               backend="torch", generation_s=0.1, completions=[s.to_completion() for s in samples])
        await self.submit(api, sub, "tokens and logprobs from a different model")
        await self.release(api, job)

    async def truncated_output(self) -> None:
        api = await self.identity("a")
        job = await self.lease(api)
        sub = await self.honest(api, job)
        comps = [c.model_dump() for c in sub.completions]
        k = next(i for i, c in enumerate(comps) if len(c["token_ids"]) >= 2)
        comps[k]["token_ids"] = comps[k]["token_ids"][:-1]
        comps[k]["logprobs"] = comps[k]["logprobs"][:-1]
        await self.submit(api, self.tamper(sub, completions=comps), "a completion cut short")
        await self.release(api, job)

    async def padded_output(self) -> None:
        api = await self.identity("a")
        job = await self.lease(api)
        sub = await self.honest(api, job)
        comps = [c.model_dump() for c in sub.completions]
        extra = job.sampling.max_tokens + 4 - len(comps[0]["token_ids"])
        comps[0] = {"token_ids": comps[0]["token_ids"] + [17] * extra,
                    "logprobs": comps[0]["logprobs"] + [-1.0] * extra, "finish_reason": "length"}
        await self.submit(api, self.tamper(sub, completions=comps), "a completion padded past max_tokens")
        await self.release(api, job)

    async def oversized_body(self) -> None:
        api = await self.identity("a")
        job = await self.lease(api)
        sub = await self.honest(api, job)
        big = [{"token_ids": [17] * 4096, "logprobs": [-1.0] * 4096, "finish_reason": "length"}] * 64
        await self.submit(api, self.tamper(sub, completions=big), "result far larger than the signed job allows")
        await self.send(api, "/v1/results", b"\x00" * (17 * 1024 * 1024), "17 MiB request")
        await self.release(api, job)

    async def malformed_msgpack(self) -> None:
        api = await self.identity("a")
        job = await self.lease(api)
        await self.send(api, "/v1/results", b"\xc1\x00not msgpack", "garbage envelope")
        await self.submit(api, b"\xdd\xff\xff\xff\xff", "signed body declaring 2^32 items")
        await self.submit(api, b"\x82\xa6job_id\xa1x\xa6job_id\xa1y", "signed body with duplicate keys")
        await self.submit(api, b"\x91" * 5000 + b"\xc0", "signed body nested 5000 deep")
        await self.release(api, job)

    async def registration_flood(self) -> None:
        t0 = time.monotonic()
        for i in range(60):
            ident = load_identity(self.home / f"sybil{i}")
            api = CoordinatorClient(self.url, ident, retry=NO_RETRY)
            self.apis.append(api)
            self.identities.append(ident.client_id)
            if self.info is None:
                self.info = await api.info()
            body = wire.encode(RegisterRequest(public_key=ident.public_key, profile=profile("torch", "cpu", "sybil")))
            await self.send(api, "/v1/register", self.envelope(ident, "/v1/register", body), f"registration {i}")
        self.notes["flood_s"] = time.monotonic() - t0  # the address's budget refills meanwhile: the bound counts it

    async def unauthenticated_admin(self) -> None:
        """Call the operator's admin API (coordinator/api/admin.py) without an operator key: once unsigned with a
        made-up bearer token, once signed with this volunteer's own (registered, but not listed) key."""
        api = await self.identity("a")
        victim = self.identities[0]
        for path, body in (("/v1/admin/clients", {}), ("/v1/admin/ban", {"client_id": victim}),
                           ("/v1/admin/audit", {}), ("/v1/admin/checkpoint", {}), ("/v1/admin/issuing",
                                                                                   {"paused": True})):
            packed = wire.pack(body)
            await self.send(api, path, packed, f"POST {path} unsigned, with a made-up token",
                            headers={"Content-Type": "application/msgpack", "Authorization": "Bearer not-a-token"})
            await self.send(api, path, self.envelope(api.identity, path, packed),
                            f"POST {path} signed with a volunteer's key")

    async def sybil_rotation(self) -> None:
        """Earn a quarantine with bad results, then rotate to a fresh key: the new identity starts untrusted."""
        api = await self.identity("old")
        for _ in range(3):
            job = await self.lease(api)
            sub = await self.honest(api, job)
            comps = [c.model_dump() | {"logprobs": [-0.01] * len(c.token_ids)} for c in sub.completions]
            await self.submit(api, self.tamper(sub, completions=comps), "fabricated logprobs")
            await self.release(api, job)
        body = wire.encode(LeaseRequest(backend="torch", held_version=-1))
        await self.send(api, "/v1/lease", self.envelope(api.identity, "/v1/lease", body), "lease while quarantined")
        await self.identity("new")  # a fresh key: registers fine, but with no trust and no credit

    async def own_seed(self) -> None:
        """A lazy or cherry-picking sampler: the real policy and its true logprobs, but not the job's seed (as if
        it had drawn several groups and kept the one it liked). The logprob check passes; the keyed sampler's
        choice at its first differing token refuses it."""
        api = await self.identity("a")
        job = await self.lease(api)
        own = job.model_copy(update={"seed": (job.seed + 1) % 2**63})
        sub = await self.honest(api, own)
        await self.cheat(api, job, sub.model_copy(update={"seed": job.seed}),
                         "sampled with its own seed, claims the job's")

    async def forced_correct(self) -> None:
        """Reward farming: every completion is the prompt's correct answer and end of text, with true logprobs."""
        api = await self.identity("a")
        job = await self.lease(api)
        model, codec = await self.policy(api, job)
        eos = job.sampling.stop_token_ids[0]
        _, items = self.task_items(job)
        forced = [list(codec.tokenizer.encode(" " + it.answer, add_special_tokens=False).ids)[
            : job.sampling.max_tokens - 1] + [eos] for it in items for _ in range(job.group_size)]
        await self.cheat(api, job, self.true_result(job, model, forced), "forced-correct answers, true logprobs")

    async def best_of_16(self) -> None:
        """Best-of-N cherry-picking (N = 16): for each prompt, 16 honest draws of its group with other seeds (the
        real backend), the group_size completions with the highest reward kept (ties: draw order)."""
        api = await self.identity("a")
        job = await self.lease(api)
        task, items = self.task_items(job)
        pools: list[list[Any]] = [[] for _ in job.prompts]
        for k in range(1, BEST_OF + 1):
            draw = await self.honest(api, job.model_copy(update={"seed": (job.seed + k) % 2**63}))
            for j, c in enumerate(draw.completions):
                pools[j // job.group_size].append(c)
        _, codec = await self.policy(api, job)

        def reward(i: int, c: Any) -> float:
            return float(task.reward(items[i], codec.decode(list(c.token_ids))))

        picked = [c for i, pool in enumerate(pools)
                  for c in sorted(pool, key=lambda c, i=i: -reward(i, c))[: job.group_size]]
        sub = ResultSubmission(job_id=job.job_id, lease_id=job.lease_id, version=job.version,
                               prompt_hash=job.prompt_hash, seed=job.seed, group_size=job.group_size,
                               backend=self.claim, generation_s=0.1, completions=picked)  # type: ignore[arg-type]
        await self.cheat(api, job, sub, f"best of {BEST_OF} draws by reward, true logprobs")

    async def topk_steer(self) -> None:
        """Top-k steering toward a fixed string: at each position the target's next token if it is among the top
        k, else the likeliest — each token one the policy finds plausible, with its true logprob."""
        api = await self.identity("a")
        job = await self.lease(api)
        model, codec = await self.policy(api, job)
        target = list(codec.tokenizer.encode(STEER_TARGET, add_special_tokens=False).ids) + \
            [job.sampling.stop_token_ids[0]]

        def pick(logits: Any, pos: int, row: int) -> int:
            top = logits.topk(STEER_K).indices.tolist()
            want = target[pos] if pos < len(target) else None
            return want if want in top else top[0]

        comps = self.decode_steered(job, model, pick)
        await self.cheat(api, job, self.true_result(job, model, comps), f"top-{STEER_K} steered toward {STEER_TARGET!r}")

    async def greedy(self) -> None:
        """Greedy decoding (argmax at every position), with true logprobs at the job's temperature."""
        api = await self.identity("a")
        job = await self.lease(api)
        model, _ = await self.policy(api, job)
        comps = self.decode_steered(job, model, lambda logits, pos, row: int(logits.argmax()))
        await self.cheat(api, job, self.true_result(job, model, comps), "greedy decoding, true logprobs")

    async def junk(self) -> None:
        """Credit farming: random non-stop tokens up to max_tokens, with their true logprobs."""
        api = await self.identity("a")
        job = await self.lease(api)
        model, codec = await self.policy(api, job)
        rng = random.Random(job.seed)
        stops = set(job.sampling.stop_token_ids)
        vocab = [t for t in range(codec.vocab_size) if t not in stops]
        comps = [[rng.choice(vocab) for _ in range(job.sampling.max_tokens)]
                 for _ in range(len(job.prompts) * job.group_size)]
        await self.submit(api, self.true_result(job, model, comps), "junk tokens, true logprobs")
        await self.release(api, job)

    # The same cheats through a llama.cpp identity (issue 36): before, a llama.cpp result was checked against a torch
    # recompute at a tolerance wide enough for the quantisation, and a torch client that registered as llama got 25x
    # torch's freedom. Now it is recomputed by llama.cpp on the job's own GGUF file, at a tolerance of 0.1 logit.
    async def llama_greedy(self) -> None:
        self.claim = "llama"
        await self.greedy()

    async def llama_forced_correct(self) -> None:
        self.claim = "llama"
        await self.forced_correct()

    async def llama_best_of_16(self) -> None:
        self.claim = "llama"
        await self.best_of_16()

    async def llama_topk_steer(self) -> None:
        self.claim = "llama"
        await self.topk_steer()

    async def llama_junk(self) -> None:
        self.claim = "llama"
        await self.junk()

    async def llama_torch_sample(self) -> None:
        """Class shopping: a torch client's honest keyed sample (torch float32 logits) sent by an identity that
        registered as llama.cpp. Under the llama.cpp recompute its tokens must be the keyed choices of the GGUF's
        logits; where the two models' logits differ at a near-tie by more than the tolerance, it is refused."""
        self.claim = "llama"
        api = await self.identity("a")
        job = await self.lease(api)
        assert self.backend is not None
        sub = await self.honest(api, job, self.backend)  # computed by torch, claims llama
        entry = await self.cheat(api, job, sub, "a torch sample sent as llama.cpp's")
        entry["within_tolerance"] = await self.within_llama_tolerance(api, job, sub)

    async def within_llama_tolerance(self, api: CoordinatorClient, job: Job, sub: ResultSubmission) -> bool:
        """Would the keyed check pass ``sub`` under llama.cpp's recompute of the job's GGUF file at the llama.cpp
        classes' tolerance (docs/security.md §4: a torch sample passes where the two implementations agree to 0.1
        logit)? Computed here with the verifier's own code on this client's verified copy of the file."""
        from coordinator.config import CHOICE_TOL_LLAMA
        from coordinator.core.verify import check_choices, choice_stats
        from coordinator.engine.llama_verifier import LlamaRecompute
        from shared.sampler import plain_segments

        folder = await self.job_folder(api, job)
        comps = [list(c.token_ids) for c in sub.completions]
        prompts = [p.token_ids for p in job.prompts for _ in range(job.group_size)]
        recompute = LlamaRecompute(lambda _v: folder, temperature=job.sampling.temperature, threads=1)
        stats = recompute.recompute_stats(job.version, prompts, comps, plain_segments(job.seed, [len(c) for c in comps]),
                                          job.group_size, job.precision)
        assert stats.margins is not None
        try:
            check_choices(choice_stats(stats.margins), CHOICE_TOL_LLAMA)
        except ProtocolError:
            return False
        return True

    async def lease_hoarder(self) -> None:
        """Lease as many jobs as it can without returning any, to starve everyone else: once it holds a first job,
        ten requests at once. A new identity's first job waits until no other identity of unknown pace holds a
        lease (docs/protocol.md §4): the test runs this kind alone, so that is at most a lease timeout away."""
        api = await self.identity("a")
        body = wire.encode(LeaseRequest(backend="torch", held_version=-1))

        async def lease(what: str) -> bool:
            entry = await self.send(api, "/v1/lease", self.envelope(api.identity, "/v1/lease", body), what)
            if entry["status"] != 200:
                return False
            reply = wire.decode(entry.pop("raw"), LeaseResponse)
            entry.update(got_job=reply.job is not None, current_version=reply.current_version,
                         finished=reply.finished, paused=reply.paused)
            return reply.job is not None

        started = time.monotonic()
        tries = 0
        while not await lease(f"first lease, try {tries}"):
            tries += 1
            assert time.monotonic() < started + 120, self.no_job_offered(time.monotonic() - started)
            await asyncio.sleep(1.0)
        for i in range(10):
            await lease(f"lease {i}")

    def no_job_offered(self, waited_s: float) -> str:
        """Why the hoarder's first lease never came, from its attempts: refused (statuses, reasons, the first
        refusal's message), or answered with no job (at which versions, whether finished or paused)."""
        tries = [a for a in self.attempts if a["what"].startswith("first lease")]
        codes = collections.Counter(f"{a['status']} {a['reason'] or ''}".strip() for a in tries)
        why = f"no job was offered in {waited_s:.0f} s: {len(tries)} lease requests, answered {dict(codes)}"
        if answered := [a for a in tries if a["status"] == 200]:
            why += (f"; the 200s had job=null at versions {answered[0]['current_version']}.."
                    f"{answered[-1]['current_version']} (finished {sum(a['finished'] for a in answered)}, paused "
                    f"{sum(a['paused'] for a in answered)}): no slot for a new identity, docs/protocol.md §4")
        if refused := [a for a in tries if a["status"] != 200]:
            why += f"; first refusal: {refused[0]['message'][:300]}"
        return why

    async def request_flood(self) -> None:
        """One identity sending far more requests than anyone needs (cheap ones: releases of no job)."""
        api = await self.identity("a")
        body = wire.encode(ReleaseRequest(job_id="j-none", lease_id="none"))
        envelopes = [self.envelope(api.identity, "/v1/release", body) for _ in range(300)]
        t0 = time.monotonic()
        await asyncio.gather(*(self.send(api, "/v1/release", env, f"request {i}") for i, env in enumerate(envelopes)))
        self.notes["flood_s"] = time.monotonic() - t0  # the bucket refills meanwhile: the test's bound counts it

    # -- the trust boundary's classes (issue 13): claims the coordinator must not believe ----------------------
    async def unknown_device(self) -> None:
        """Register claiming devices outside the coordinator's fixed classes: refused, nothing written."""
        for name, backend, device in (("tpu", "torch", "tpu:v5e"), ("xpu", "torch", "xpu:0"),
                                      ("llamacuda", "llama", "cuda:0")):
            ident = load_identity(self.home / name)
            api = CoordinatorClient(self.url, ident, retry=NO_RETRY)
            self.apis.append(api)
            self.identities.append(ident.client_id)
            body = wire.encode(RegisterRequest(public_key=ident.public_key, profile=claim(name, backend, device)))
            await self.send(api, "/v1/register", self.envelope(ident, "/v1/register", body), f"claims {device}")

    async def sybil_confirms(self) -> None:
        """A cherry-picked original, and a second identity of the same attacker that looks for a job linked to it
        among the jobs it is offered (same seed or prompts, another id) to confirm the original's tokens."""
        a = await self.identity("a")
        b = await self.identity("b")
        job, sub = await self.cherry_picked(a)
        await self.submit(a, sub, "original: cherry-picked samples")

        def confirm(rep: Job) -> ResultSubmission:
            return sub.model_copy(update={"job_id": rep.job_id, "lease_id": rep.lease_id, "version": rep.version})

        await self.hunt(b, job, answer=confirm)

    async def accomplice_junk(self) -> None:
        """A cherry-picked original, and an accomplice of another class (llama) that answers any job linked to it
        with junk (the spot-check era's 'inconclusive' that released the original)."""
        a = await self.identity("a")
        b = await self.identity("b", backend="llama", device="cpu")
        job, sub = await self.cherry_picked(a)
        await self.submit(a, sub, "original: cherry-picked samples")

        def junk(rep: Job) -> ResultSubmission:
            comps = [c.model_copy(update={"token_ids": [17] * len(c.token_ids)}) for c in sub.completions]
            return sub.model_copy(update={"job_id": rep.job_id, "lease_id": rep.lease_id, "version": rep.version,
                                          "backend": "llama", "completions": comps})

        await self.hunt(b, job, answer=junk)

    async def accomplice_sits(self) -> None:
        """A cherry-picked original, and an accomplice that leases any job linked to it and never returns it (the
        spot-check era's attack on the hold)."""
        a = await self.identity("a")
        b = await self.identity("b")
        job, sub = await self.cherry_picked(a)
        await self.submit(a, sub, "original: cherry-picked samples")
        await self.hunt(b, job, sit=True)

    async def _earn_quarantine(self, api: CoordinatorClient) -> Job:
        """Three results with made-up logprobs (trust.quarantine_after = 3); the last job's lease is kept."""
        for i in range(3):
            job = await self.lease(api)
            sub = await self.honest(api, job)
            comps = [c.model_dump() | {"logprobs": [-0.01] * len(c.token_ids)} for c in sub.completions]
            await self.submit(api, self.tamper(sub, completions=comps), "fabricated logprobs")
            if i < 2:
                await self.release(api, job)
        return job

    async def quarantine_backend_claim(self) -> None:
        """Quarantined, it keeps asking for work and sending results while claiming another backend."""
        api = await self.identity("a")
        job = await self._earn_quarantine(api)
        await self.lease_as(api, "torch", "lease while quarantined")
        await self.lease_as(api, "llama", "lease while quarantined, claiming llama")
        sub = await self.honest(api, job)
        await self.submit(api, sub.model_copy(update={"backend": "llama"}), "result while quarantined, as llama")

    async def quarantine_reregister(self) -> None:
        """Quarantined, it re-registers its key with another device and another backend, then asks for work."""
        api = await self.identity("a")
        await self._earn_quarantine(api)
        ident = api.identity
        for what, backend, device in (("re-register as torch on cuda", "torch", "cuda:RTX 4090"),
                                      ("re-register as llama on cpu", "llama", "cpu"),
                                      ("re-register unchanged", "torch", "cpu")):
            body = wire.encode(RegisterRequest(public_key=ident.public_key, profile=claim("adversary-a", backend, device)))
            await self.send(api, "/v1/register", self.envelope(ident, "/v1/register", body), what)
        await self.lease_as(api, "llama", "lease after re-registering")

    async def above_median(self) -> None:
        """Selective reporting by abandoning (issue 37): one identity leases ``leases`` distinct jobs, computes
        each one's honest keyed result with the real backend, scores it with the task's public reward, and returns
        it only when that reward is above the median of everything it computed before; the rest it releases. A job
        offered again after it released it (reissued with its key at its version: the same tokens, the same
        reward) is released at once, uncomputed, after a pause that lets another client take it. notes["computed"]
        holds every job it computed: id, version, reward, returned or not."""
        import statistics

        from coordinator.tasks.text import TextCodec
        from shared.hashing import tokens_sha256

        api = await self.identity("a")
        assert self.info is not None
        cache = SnapshotCache(self.home / "cache", api, self.info.coordinator_public_key)
        computed: list[dict[str, Any]] = []
        released: set[str] = set()
        self.backend = self.backend or TorchBackend(device="cpu", threads=1)
        while len(computed) < self.leases:
            job = await self.lease(api)
            if job.job_id in released:
                await self.release(api, job)
                self.notes["offered_again"] = self.notes.get("offered_again", 0) + 1
                await asyncio.sleep(0.5)
                continue
            sub = await self.honest(api, job)
            task, items = self.task_items(job)
            codec = TextCodec.from_folder(await cache.ensure(job.run_id, job.version, job.manifest_sha256))
            rewards = [float(task.reward(items[i // job.group_size], codec.decode(list(c.token_ids))))
                       for i, c in enumerate(sub.completions)]
            reward = sum(rewards) / len(rewards)
            keep = not computed or reward > statistics.median(r["reward"] for r in computed)
            computed.append({"job_id": job.job_id, "version": job.version, "reward": reward, "returned": keep,
                             "tokens_sha256": tokens_sha256([c.token_ids for c in sub.completions])})
            if keep:
                await self.submit(api, sub, f"honest result scoring {reward:.3f}, above the running median")
            else:
                released.add(job.job_id)
                await self.release(api, job)
        self.notes["computed"] = computed

    async def tolerance_escape(self) -> None:
        """A torch identity whose logprobs are off by 1.5 nats on one token — beyond torch's 1.0, within the
        4.0 llama.cpp gets under snapshots.gguf = q8_0 — sent once claiming llama, once as torch."""
        api = await self.identity("a")
        job = await self.lease(api)
        sub = await self.honest(api, job)
        comps = [c.model_dump() for c in sub.completions]
        k = next(i for i, c in enumerate(comps) if c["token_ids"])
        comps[k]["logprobs"][0] -= 1.5
        await self.submit(api, self.tamper(sub, completions=comps, backend="llama"), "off by 1.5 nats, as llama")
        await self.submit(api, self.tamper(sub, completions=comps), "off by 1.5 nats, as torch")
        await self.release(api, job)

    async def idle_sybil(self) -> None:
        """An identity that never works and only sends signed requests (releases of nothing, 4 a second). It loads
        no model (it never generates), so its own CPU use does not slow the honest clients on a shared machine."""
        api = await self.identity("a", register=False)
        await api.post("/v1/register", RegisterRequest(public_key=api.identity.public_key,
                                                       profile=claim("adversary-a", "torch", "cpu")), RegisterResponse)
        body = wire.encode(ReleaseRequest(job_id="j-none", lease_id="none"))
        give_up = time.monotonic() + self.seconds
        n, first = 0, time.time()
        while time.monotonic() < give_up and not (self.until is not None and self.until.exists()):
            await self.send(api, "/v1/release", self.envelope(api.identity, "/v1/release", body), "idle request")
            n += 1
            await asyncio.sleep(0.25)
        # wall-clock times, so that the test can check the sybil was at work throughout what it measured
        self.notes.update(requests=n, first_at=first, last_at=time.time())

    KINDS = ("forged_signature", "replayed_result", "other_clients_lease", "late_result", "wrong_version",
             "inflated_reward", "fabricated_logprobs", "other_model", "truncated_output", "padded_output",
             "oversized_body", "malformed_msgpack", "registration_flood", "unauthenticated_admin", "sybil_rotation", "request_flood", "own_seed", "lease_hoarder",
             "forced_correct", "best_of_16", "topk_steer", "greedy", "junk",
             "unknown_device", "sybil_confirms", "accomplice_junk", "accomplice_sits", "quarantine_backend_claim",
             "quarantine_reregister", "tolerance_escape", "idle_sybil", "llama_greedy", "llama_forced_correct",
             "llama_best_of_16", "llama_topk_steer", "llama_junk", "llama_torch_sample", "above_median")


async def main_async(kind: str, url: str, home: Path, seconds: float = 30.0, until: Path | None = None,
                     precision: str | None = None, leases: int = 100) -> dict[str, Any]:
    adv = Adversary(url, home)
    adv.seconds, adv.until, adv.precision, adv.leases = seconds, until, precision, leases
    return await run_kind(adv, kind)


async def run_kind(adv: Adversary, kind: str) -> dict[str, Any]:
    """Run one attack of ``adv`` and report what each attempt got back (also for tests/adversarial's subclasses)."""
    error = None
    try:
        await getattr(adv, kind)()
    except (ProtocolError, TimeoutError, aiohttp.ClientError, AssertionError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        await adv.close()
    attempts = [{k: v for k, v in a.items() if k != "raw"} for a in adv.attempts]
    return {"kind": kind, "identities": adv.identities, "attempts": attempts, "error": error, "notes": adv.notes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", nargs="+", choices=Adversary.KINDS, help="one kind, or several run one after the "
                        "other in this process (each with identities of its own)")
    parser.add_argument("--url", required=True)
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=30.0, help="how long a timed kind runs at most (idle_sybil)")
    parser.add_argument("--until", type=Path, help="a timed kind stops once this file exists")
    parser.add_argument("--leases", type=int, default=100, help="distinct jobs a counting kind (above_median) "
                        "computes")
    parser.add_argument("--precision", help="the GGUF precision its leases ask for (a run's snapshots.gguf_also); "
                        "default: the run's default file")
    args = parser.parse_args()
    homes = [args.home] if len(args.kind) == 1 else [args.home / kind for kind in args.kind]
    reports = [asyncio.run(main_async(kind, args.url, home, args.seconds, args.until, args.precision, args.leases))
               for kind, home in zip(args.kind, homes, strict=True)]
    args.out.write_text(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
    for report in reports:
        print(f"adversary {report['kind']}: {len(report['attempts'])} attempts, error={report['error']}")


if __name__ == "__main__":
    main()
