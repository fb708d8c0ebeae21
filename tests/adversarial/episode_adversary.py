"""A volunteer that tampers with a multi-turn trajectory, as a real client process: it leases a multi-turn job,
plays its episodes honestly with the production backend and episode loop (swarm_client.episodes), then changes
one thing and sends the result.

    python -m tests.adversarial.episode_adversary KIND --url URL --home DIR --out report.json

The report has the same shape as tests/adversarial/adversary.py's, so tests/adversarial/test_episode_replay.py
checks it the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from shared.envs import decode_action, encode_observation, load_tokenizer, make_env
from shared.messages import Completion, Job, ResultSubmission, Turn
from swarm_client.episodes import play_job
from swarm_client.snapshots import SnapshotCache
from tests.adversarial.adversary import Adversary, run_kind


class EpisodeAdversary(Adversary):
    KINDS = ("changed_observation", "extra_turn", "missing_turn", "unseen_action", "claimed_reward")

    async def _played(self) -> tuple[Any, Job, ResultSubmission, Path]:
        api = await self.identity("a")
        job = await self.lease(api)
        assert job.environment is not None, "the coordinator issued a job that is not multi-turn"
        assert self.info is not None and self.backend is not None
        cache = SnapshotCache(self.home / "cache", api, self.info.coordinator_public_key)
        folder = await cache.ensure(job.run_id, job.version, job.manifest_sha256)
        self.backend.load(folder)
        comps = play_job(self.backend, job, folder, lambda: False)
        sub = ResultSubmission(job_id=job.job_id, lease_id=job.lease_id, version=job.version,
                               prompt_hash=job.prompt_hash, seed=job.seed, group_size=job.group_size,
                               backend="torch", generation_s=0.1, completions=comps)
        return api, job, sub, folder

    async def _send(self, api: Any, job: Job, sub: ResultSubmission, k: int, turns: list[Turn], what: str) -> None:
        comps = list(sub.completions)
        comps[k] = Completion(token_ids=[], logprobs=[], finish_reason="stop", turns=turns)
        await self.submit(api, sub.model_copy(update={"completions": comps}), what)
        await self.release(api, job)

    @staticmethod
    def _turns(sub: ResultSubmission, k: int) -> list[Turn]:
        turns = sub.completions[k].turns
        assert turns is not None
        return list(turns)

    async def changed_observation(self) -> None:
        api, job, sub, folder = await self._played()
        turns = self._turns(sub, 0)
        tok = load_tokenizer(folder)
        obs = list(turns[0].observation_ids)
        text = tok.decode(obs)
        # the goal's column (it never moves, so no action could have produced the changed observation)
        at = text.index(" A: ") - 2
        digit = "1" if text[at] != "1" else "0"
        changed = tok.encode(text[:at] + digit + text[at + 1 :], add_special_tokens=False).ids
        turns[0] = turns[0].model_copy(update={"observation_ids": changed})
        await self._send(api, job, sub, 0, turns, "an observation the environment never gave")

    async def extra_turn(self) -> None:
        api, job, sub, _ = await self._played()
        turns = self._turns(sub, 0)
        await self._send(api, job, sub, 0, [*turns, turns[-1]], "a turn after the episode ended")

    async def missing_turn(self) -> None:
        api, job, sub, _ = await self._played()
        turns = self._turns(sub, 0)
        await self._send(api, job, sub, 0, turns[:-1], "the episode's last turn dropped")

    async def unseen_action(self) -> None:
        """The first action of an episode swapped for another move (a better-looking trajectory), the observation
        the environment gave to the original kept. Where the policy's sampled first action was no move at all
        (an untrained policy mostly writes none), the attacker takes the observation of a move it did not play
        (the environment's answer to it from the job's seed) under the tokens of a different move: the same lie,
        so one job always has an episode to tamper with."""
        api, job, sub, folder = await self._played()
        assert job.environment is not None
        tok = load_tokenizer(folder)
        params = json.loads(job.environment.params_json)
        turns = self._turns(sub, 0)
        env = make_env(job.environment.env_id, params)
        env.reset(job.environment.seeds[0])
        played = decode_action(tok, turns[0].token_ids)
        kept = played if played in env.actions else env.actions[0]  # the action whose observation is sent
        answer = env.clone().step(kept).observation
        other = next(a for a in env.actions if env.clone().step(a).observation != answer)
        ids = tok.encode(other, add_special_tokens=False).ids
        # a move's tokens end no turn by a stop token: "length", as a sampled move of max_tokens tokens would be
        turns[0] = turns[0].model_copy(update={"token_ids": ids, "logprobs": (list(turns[0].logprobs) * len(ids))
                                               [: len(ids)], "observation_ids": encode_observation(tok, answer),
                                               "finish_reason": "length"})
        await self._send(api, job, sub, 0, turns, f"action {other!r} sent with the observation of {kept!r} "
                                                  f"(the policy played {played!r})")

    async def claimed_reward(self) -> None:
        api, job, sub, _ = await self._played()
        turns = self._turns(sub, 0)
        turns[-1] = turns[-1].model_copy(update={"reward": 1.0})
        await self._send(api, job, sub, 0, turns, "a reward claimed for the episode")


async def main_async(kind: str, url: str, home: Path) -> dict[str, Any]:
    return await run_kind(EpisodeAdversary(url, home), kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=EpisodeAdversary.KINDS)
    parser.add_argument("--url", required=True)
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report = asyncio.run(main_async(args.kind, args.url, args.home))
    args.out.write_text(json.dumps(report, indent=2))
    print(f"episode adversary {args.kind}: {len(report['attempts'])} attempts, error={report['error']}")


if __name__ == "__main__":
    main()
