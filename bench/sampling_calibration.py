"""Calibration of the sampling test (coordinator.core.verify.check_sampling): how often honest results are
refused (must be never) and how often cheating results are caught, per backend, precision and policy.

    PYTHONPATH=. nice -n 5 python bench/sampling_calibration.py [--honest 5000] [--llama 5000] [--attacks 400]
        [--rl-steps 60] [--json out.json]

What runs is the real code: honest torch results come from the client's TorchBackend, honest llama.cpp results
from the client's LlamaBackend on GGUFs written by coordinator.publish.gguf_export (f16 and q8_0, llama.cpp's default f16
KV cache), the recompute is shared.policy.completion_stats (the verifier's function) and the verdict
coordinator.core.verify.sampling_stats + check_sampling with the thresholds of coordinator.config's
VerificationConfig defaults. Results are shaped like the default run's jobs: jobs.prompts_per_job × learner.group_size
completions of at most sampling.max_tokens tokens, arithmetic-task prompts.

Policies: the tiny model as built (``v0``), the same after ``--rl-steps`` GRPO steps of the real Learner on the
arithmetic task (``rl-N``: lower entropy, which changes the statistic's variance), and v0 sampled at temperature
0.5 (``v0@T0.5``: sharper still; the job's temperature is part of the policy).

Attacks, all with the attacker's *true* logprobs (so each passes the logprob check):
- ``greedy``: argmax decoding, the lazy client (shared.policy.generate with no seed);
- ``forced-correct``: every completion is the correct answer (" 46" + end of text), reward farming;
- ``forced-junk``: random non-stop tokens to max_tokens, credit farming;
- ``forced-correct 1/8``: an honest result with one prompt's group replaced by forced-correct answers;
- ``best-of-k``: for each prompt the attacker samples k × group completions honestly and returns the group_size
  with the highest reward (ties in sampling order), k = 4 and 16.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH = 512  # completions per recompute forward pass


@dataclass
class Row:
    """One line of the table: a kind of result under one policy, with each result's z."""

    policy: str
    kind: str
    honest: bool
    z: list[float] = field(default_factory=list)
    z_top: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    refused: int = 0
    judged: int = 0
    dev_per_token: list[float] = field(default_factory=list)  # mean (surprisal − entropy) per token of a result


@dataclass
class Setup:
    folder: Path
    temperature: float
    prompts: list[list[int]]
    answers: list[str]
    items: list[Any]
    stops: list[int]
    pad: int
    model: Any
    tokenizer: Any
    task: Any


def _job(prompts: Sequence[list[int]], group: int, max_tokens: int, temperature: float, stops: list[int],
         seed: int) -> Any:
    """A job-shaped object with the fields the client backends read (no signature needed offline)."""
    return SimpleNamespace(prompts=[SimpleNamespace(token_ids=p) for p in prompts], group_size=group, seed=seed,
                           sampling=SimpleNamespace(temperature=temperature, max_tokens=max_tokens,
                                                    stop_token_ids=stops))



def job_shape(spec: str | None) -> tuple[int, int, int]:
    """(prompts per result, completions per prompt, max new tokens): ``"P,G,T"``, or the coordinator's job defaults."""
    from coordinator.config import JobsConfig, LearnerConfig, SamplingConfig

    if spec:
        p, g, t = (int(x) for x in spec.split(","))
        return p, g, t
    return JobsConfig().prompts_per_job, LearnerConfig().group_size, SamplingConfig().max_tokens
class Judge:
    """Recomputes results with the verifier's function and applies the verifier's check."""

    def __init__(self, setup: Setup) -> None:
        from coordinator.config import VerificationConfig

        self.s = setup
        self.cfg = VerificationConfig()

    def judge(self, row: Row, results: list[tuple[list[list[int]], list[list[int]]]]) -> None:
        """``results``: (prompt per completion, completions) each. Appends every result's z to ``row``."""
        import torch

        from coordinator.core.verify import TokenStats, check_sampling, sampling_stats
        from shared.errors import ProtocolError
        from shared.policy import completion_stats

        flat_p = [p for ps, _ in results for p in ps]
        flat_c = [c for _, cs in results for c in cs]
        lps: list[list[float]] = []
        ents: list[list[float]] = []
        vars_: list[list[float]] = []
        tops: list[list[float]] = []
        with torch.no_grad():
            for s in range(0, len(flat_c), BATCH):
                chunk = flat_c[s : s + BATCH]
                lp, ent, var, top, _, _ = completion_stats(self.s.model, flat_p[s : s + BATCH], chunk,
                                                        temperature=self.s.temperature, pad_id=self.s.pad)
                for dst, t in ((lps, lp), (ents, ent), (vars_, var), (tops, top)):
                    dst.extend(r[: len(c)] for r, c in zip(t.tolist(), chunk, strict=True))
        k = 0
        cfg = self.cfg
        for _, cs in results:
            n = len(cs)
            ts = TokenStats(lps[k : k + n], ents[k : k + n], vars_[k : k + n], tops[k : k + n])
            k += n
            st = sampling_stats(ts, cfg.sampling_var_floor)
            row.z.append(st.z)
            row.z_top.append(st.z_top)
            row.tokens.append(st.n_tokens)
            row.dev_per_token.append(st.mean_surprisal - st.mean_entropy)
            if st.n_tokens >= cfg.sampling_min_tokens:
                row.judged += 1
            try:
                check_sampling(st, z_low=cfg.sampling_z_low, z_high=cfg.sampling_z_high, top_z=cfg.sampling_top_z,
                               min_tokens=cfg.sampling_min_tokens, temperature=self.s.temperature)
            except ProtocolError:
                row.refused += 1


class Prompts:
    """Arithmetic training prompts, handed out in order (cycling), eight per result."""

    def __init__(self, setup: Setup, per_result: int, first_result: int = 0) -> None:
        self.s, self.n, self.at = setup, per_result, first_result * per_result

    def take(self, results: int) -> list[int]:
        idx = [(self.at + i) % len(self.s.prompts) for i in range(results * self.n)]
        self.at += results * self.n
        return idx


def _split(idx: list[int], samples: list[list[int]], setup: Setup, per_result: int, group: int
           ) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Prompt-major samples of many prompts → results of ``per_result`` prompts × ``group`` completions."""
    out = []
    per = per_result * group
    for r in range(len(idx) // per_result):
        ps = [setup.prompts[i] for i in idx[r * per_result : (r + 1) * per_result] for _ in range(group)]
        out.append((ps, samples[r * per : (r + 1) * per]))
    return out


def honest_torch(setup: Setup, judge: Judge, row: Row, n: int, shape: tuple[int, int, int], seed: int,
                 first: int = 0, device: str = "cpu") -> None:
    from swarm_client.backends.torch_backend import TorchBackend

    per_result, group, max_tokens = shape
    backend = TorchBackend(device=device)
    backend.load(setup.folder)
    stream = Prompts(setup, per_result, first)
    chunk = max(1, BATCH // (per_result * group)) * 4
    done = 0
    while done < n:
        m = min(chunk, n - done)
        idx = stream.take(m)
        job = _job([setup.prompts[i] for i in idx], group, max_tokens, setup.temperature, setup.stops,
                   seed + first + done)
        samples = [s.token_ids for s in backend.generate(job, lambda: False)]
        judge.judge(row, _split(idx, samples, setup, per_result, group))
        done += m


def honest_llama(setup: Setup, judge: Judge, row: Row, n: int, shape: tuple[int, int, int], seed: int,
                 gguf_dir: Path, first: int = 0) -> None:
    from swarm_client.backends.llama_backend import LlamaBackend

    per_result, group, max_tokens = shape
    backend = LlamaBackend(device="cpu", threads=1, n_ctx=64)
    backend.load(gguf_dir)
    stream = Prompts(setup, per_result, first)
    pending: list[tuple[list[list[int]], list[list[int]]]] = []
    for r in range(n):
        idx = stream.take(1)
        job = _job([setup.prompts[i] for i in idx], group, max_tokens, setup.temperature, setup.stops,
                   seed + first + r)
        samples = [s.token_ids for s in backend.generate(job, lambda: False)]
        pending.extend(_split(idx, samples, setup, per_result, group))
        if len(pending) * per_result * group >= BATCH * 4:
            judge.judge(row, pending)
            pending = []
    if pending:
        judge.judge(row, pending)
    del backend


def attacks(setup: Setup, judge: Judge, policy: str, n: int, shape: tuple[int, int, int], ks: list[int],
            seed: int, first: int = 0) -> list[Row]:
    import torch

    from shared.policy import generate

    per_result, group, max_tokens = shape
    stream = Prompts(setup, per_result, first)
    rng = random.Random(seed + first)
    eos = setup.stops[0]
    non_stop = [t for t in range(int(setup.model.get_input_embeddings().num_embeddings)) if t not in setup.stops]

    def forced(i: int) -> list[int]:
        return list(setup.tokenizer.encode(" " + setup.answers[i]))[: max_tokens - 1] + [eos]

    def sampled(idx: list[int], g: int, s: int, greedy: bool = False) -> list[list[int]]:
        out: list[list[int]] = []
        with torch.no_grad():
            for b in range(0, len(idx), max(1, BATCH // g)):
                part = idx[b : b + max(1, BATCH // g)]
                out.extend(x.token_ids for x in generate(
                    setup.model, [setup.prompts[i] for i in part], group_size=g, temperature=setup.temperature,
                    max_tokens=max_tokens, stop_ids=setup.stops, seed=None if greedy else s + b, pad_id=setup.pad))
        return out

    rows: dict[str, Row] = {}

    def row(kind: str) -> Row:
        return rows.setdefault(kind, Row(policy, kind, honest=False))

    chunk = 32
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        idx = stream.take(m)
        judge.judge(row("greedy"), _split(idx, sampled(idx, group, 0, greedy=True), setup, per_result, group))
        judge.judge(row("forced-correct"),
                    _split(idx, [forced(i) for i in idx for _ in range(group)], setup, per_result, group))
        junk = [[rng.choice(non_stop) for _ in range(max_tokens)] for _ in range(len(idx) * group)]
        judge.judge(row("forced-junk"), _split(idx, junk, setup, per_result, group))
        honest = sampled(idx, group, seed + 7919 * (first + start))
        partial = [forced(idx[j // group]) if (j // group) % per_result == 0 else c for j, c in enumerate(honest)]
        judge.judge(row("forced-correct 1/8 prompts"), _split(idx, partial, setup, per_result, group))
        for k in ks:
            pool = sampled(idx, k * group, seed + 104729 * (first + start) + k)
            picked: list[list[int]] = []
            for j, i in enumerate(idx):
                cands = pool[j * k * group : (j + 1) * k * group]
                rewards = [setup.task.reward(setup.items[i], setup.tokenizer.decode(c, skip_special_tokens=True))
                           for c in cands]
                scored = sorted(range(len(cands)), key=lambda c: -rewards[c])  # stable: sampling order on ties
                picked.extend(cands[c] for c in scored[:group])
            judge.judge(row(f"best-of-{k} by reward"), _split(idx, picked, setup, per_result, group))
    return list(rows.values())


def rl_policy(base: Path, out: Path, steps: int, shape: tuple[int, int, int], seed: int) -> Path:
    """``steps`` GRPO steps of the real Learner on the arithmetic task, sampling from its own policy."""
    import torch

    from coordinator.config import ArithmeticTaskConfig, LearnerConfig, ModelConfig
    from coordinator.core.advantages import group_advantages
    from coordinator.engine.learner import Learner, Sample
    from coordinator.tasks.builtin import ArithmeticTask
    from shared.policy import generate

    per_result, group, max_tokens = shape
    learner = Learner(base, ModelConfig(path=str(base), device="cpu"), LearnerConfig(group_size=group), temperature=1.0)
    task = ArithmeticTask(ArithmeticTaskConfig())
    rng = random.Random(seed)
    for step in range(steps):
        items = rng.sample(task.train, 16)
        prompts = [learner.encode(it.prompt) for it in items]
        learner.model.eval()
        with torch.no_grad():
            samples = generate(learner.model, prompts, group_size=group, temperature=1.0, max_tokens=max_tokens,
                               stop_ids=learner.stop_ids, seed=seed + step, pad_id=learner.pad_id)
        comps = [s.token_ids for s in samples]
        flat = [p for p in prompts for _ in range(group)]
        rewards = [task.reward(items[j // group], learner.decode(c)) for j, c in enumerate(comps)]
        advs = group_advantages(rewards, group)
        old = learner.recompute(flat, comps)
        learner.train_step([Sample(p, c, o, o, a) for p, c, o, a in zip(flat, comps, old, advs, strict=True)])
    out.mkdir(parents=True, exist_ok=True)
    learner.save_model(out)
    return out


def load_setup(folder: Path, temperature: float) -> Setup:
    from coordinator.config import ArithmeticTaskConfig
    from coordinator.engine.evaluation import pad_id
    from coordinator.tasks.builtin import ArithmeticTask
    from shared.policy import load_model, load_tokenizer, stop_token_ids

    tok = load_tokenizer(folder)
    task = ArithmeticTask(ArithmeticTaskConfig())
    return Setup(folder=folder, temperature=temperature, prompts=[list(tok.encode(it.prompt)) for it in task.train],
                 answers=[it.answer for it in task.train], items=list(task.train), stops=stop_token_ids(tok),
                 pad=pad_id(tok), model=load_model(folder).eval(), tokenizer=tok, task=task)


def table(rows: list[Row], cfg: Any) -> str:
    lines = [f"Thresholds (VerificationConfig defaults): refuse if z < {cfg.sampling_z_low} or z > "
             f"{cfg.sampling_z_high} or |z_top| > {cfg.sampling_top_z}, for results of ≥ {cfg.sampling_min_tokens} "
             f"tokens; var_floor {cfg.sampling_var_floor}.", "",
             "| policy | kind | results | tokens/result | (s − H)/token | z min / mean / max | "
             "z_top min / mean / max | refused |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        z, zt = np.asarray(r.z), np.asarray(r.z_top)
        rate = r.refused / max(1, len(r.z))
        what = f"{r.refused} ({rate:.1%})" if r.honest else f"**{rate:.1%}** ({r.refused}/{len(r.z)})"
        lines.append(f"| {r.policy} | {r.kind} | {len(r.z)} | {np.mean(r.tokens):.0f} | "
                     f"{np.mean(r.dev_per_token):+.4f} | {z.min():+.2f} / {z.mean():+.2f} / {z.max():+.2f} | "
                     f"{zt.min():+.2f} / {zt.mean():+.2f} / {zt.max():+.2f} | {what} |")
    for label in ("torch", "llama.cpp"):
        hs = [r for r in rows if r.honest and label in r.kind]
        if hs:
            hz = [x for r in hs for x in r.z]
            ht = [x for r in hs for x in r.z_top]
            lines.append(f"\nHonest {label}: {sum(len(r.z) for r in hs)} results, {sum(r.refused for r in hs)} "
                         f"refused; z from {min(hz):+.2f} to {max(hz):+.2f}, z_top from {min(ht):+.2f} to "
                         f"{max(ht):+.2f}.")
    return "\n".join(lines)


@dataclass(frozen=True)
class Unit:
    """A share of the work for one process: ``count`` results of one kind, from result number ``first`` on."""

    policy: str
    folder: str
    temperature: float
    kind: str  # "torch", "llama" (then ``gguf`` names the folder) or "attacks"
    first: int
    count: int
    shape: tuple[int, int, int]
    ks: tuple[int, ...] = ()
    gguf: str = ""
    precision: str = ""
    device: str = "cpu"  # where the honest torch client samples (the recompute always runs on the CPU)


_SETUPS: dict[tuple[str, float], tuple[Setup, Judge]] = {}


def run_unit(unit: Unit) -> list[Row]:
    """In a worker process (one torch thread): the unit's results, judged."""
    import torch

    torch.set_num_threads(1)
    key = (unit.folder, unit.temperature)
    if key not in _SETUPS:
        setup = load_setup(Path(unit.folder), unit.temperature)
        _SETUPS[key] = (setup, Judge(setup))
    setup, judge = _SETUPS[key]
    if unit.kind == "torch":
        row = Row(unit.policy, f"honest torch ({unit.device} client)", honest=True)
        honest_torch(setup, judge, row, unit.count, unit.shape, seed=1000, first=unit.first, device=unit.device)
        return [row]
    if unit.kind == "llama":
        row = Row(unit.policy, f"honest llama.cpp {unit.precision}", honest=True)
        honest_llama(setup, judge, row, unit.count, unit.shape, seed=5000, gguf_dir=Path(unit.gguf), first=unit.first)
        return [row]
    return attacks(setup, judge, unit.policy, unit.count, unit.shape, list(unit.ks), seed=77, first=unit.first)


def _merge(rows: list[Row]) -> list[Row]:
    out: dict[tuple[str, str], Row] = {}
    for r in rows:
        m = out.setdefault((r.policy, r.kind), Row(r.policy, r.kind, r.honest))
        m.z += r.z
        m.z_top += r.z_top
        m.tokens += r.tokens
        m.dev_per_token += r.dev_per_token
        m.refused += r.refused
        m.judged += r.judged
    return list(out.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--honest", type=int, default=5000, help="honest torch results, v0 policy")
    ap.add_argument("--honest-sharp", type=int, default=1000, help="honest torch results, each sharper policy")
    ap.add_argument("--torch-device", default="cpu", help="where the honest torch client samples (cpu, cuda)")
    ap.add_argument("--llama", type=int, default=5000, help="honest llama.cpp results per precision (v0 policy)")
    ap.add_argument("--llama-sharp", type=int, default=1000, help="honest llama.cpp results per precision, rl policy")
    ap.add_argument("--attacks", type=int, default=320, help="results per attack kind and policy")
    ap.add_argument("--ks", default="4,16")
    ap.add_argument("--precisions", default="f16,q8_0")
    ap.add_argument("--rl-steps", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2, help="worker processes (one torch thread each)")
    ap.add_argument("--model-dir", type=Path, default=None, help="the tiny model's folder (default: build/cache it)")
    ap.add_argument("--offset", type=int, default=0, help="start at this result number (another run's prompts "
                    "and seeds, to add to an earlier run)")
    ap.add_argument("--add", type=Path, action="append", default=[], help="merge the rows of an earlier run's "
                    "--json into the table (with --offset, so the runs share no prompt-and-seed pair)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import multiprocessing

    import torch

    from coordinator.config import JobsConfig, LearnerConfig, SamplingConfig, VerificationConfig
    from coordinator.publish.gguf_export import export_folder

    torch.set_num_threads(max(1, args.workers))
    torch.manual_seed(0)
    shape = (JobsConfig().prompts_per_job, LearnerConfig().group_size, SamplingConfig().max_tokens)
    ks = tuple(int(k) for k in args.ks.split(",") if k)
    if args.model_dir is None:
        from coordinator.engine.tiny_model import ensure_tiny_model

        base = ensure_tiny_model()
    else:
        base = args.model_dir
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f}s] {msg}", flush=True)

    def split(n: int, size: int) -> list[tuple[int, int]]:
        return [(args.offset + a, min(size, n - a)) for a in range(0, n, size)]

    with tempfile.TemporaryDirectory() as tmp:
        policies: list[tuple[str, Path, float, int, int]] = [("v0", base, 1.0, args.honest, args.llama)]
        if args.rl_steps:
            log(f"training rl-{args.rl_steps}")
            rl = rl_policy(base, Path(tmp) / "rl", args.rl_steps, shape, seed=99)
            policies.append((f"rl-{args.rl_steps}", rl, 1.0, args.honest_sharp, args.llama_sharp))
        policies.append(("v0@T0.5", base, 0.5, args.honest_sharp, 0))
        units: list[Unit] = []
        for name, folder, temperature, n_torch, n_llama in policies:
            units += [Unit(name, str(folder), temperature, "torch", a, c, shape, device=args.torch_device)
                      for a, c in split(n_torch, 32)]
            units += [Unit(name, str(folder), temperature, "attacks", a, c, shape, ks)
                      for a, c in split(args.attacks, 8)]
            for precision in args.precisions.split(",") if n_llama else []:
                gdir = Path(tmp) / f"{name}-{precision}"
                gdir.mkdir()
                export_folder(folder, gdir / "model.gguf", precision)
                units += [Unit(name, str(folder), temperature, "llama", a, c, shape, gguf=str(gdir),
                               precision=precision) for a, c in split(n_llama, 32)]
        log(f"{len(units)} units on {args.workers} workers")
        parts: list[Row] = []
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            for k, got in enumerate(pool.imap_unordered(run_unit, units), 1):
                parts += got
                if k % max(1, len(units) // 20) == 0:
                    log(f"{k}/{len(units)} units")
                if args.json:  # what is done so far, so a run cut short still leaves its figures
                    args.json.write_text(json.dumps([r.__dict__ for r in _merge(parts)]))
    for path in args.add:
        parts += [Row(**d) for d in json.loads(path.read_text())]
    names = [p[0] for p in policies]
    rows = sorted(_merge(parts), key=lambda r: (names.index(r.policy) if r.policy in names else len(names),
                                                not r.honest, r.kind))
    text = table(rows, VerificationConfig())
    print(text)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows]))


if __name__ == "__main__":
    main()
