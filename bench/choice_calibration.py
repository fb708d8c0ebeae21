"""Calibration of the keyed-sampler check (coordinator.core.verify.check_choices): how far honest tokens lie
from the keyed argmax per backend class, how often honest results would be refused (must be never, estimated
beyond the sample), how much free choice the tolerance leaves an adversary, and how often attacks are caught.

    PYTHONPATH=. nice -n 5 python bench/choice_calibration.py [--results 2000] [--attacks 200]
        [--temperatures 1.0,0.7] [--classes torch-f32,torch-bf16w,torch-bf16,llama-f32,llama-f16,llama-q8_0]
        [--model-dir DIR] [--json out.json] [--write-docs]

What runs is the real code: honest torch results come from the client's TorchBackend (torch-f32: on the model
folder; torch-bf16w: on a copy whose safetensors are bf16 — the verifier then recomputes in float32 from the same
bf16 weights, as the coordinator does; torch-bf16: computing in bf16, `--torch-dtype bfloat16`), llama.cpp results from the client's LlamaBackend on GGUFs written by
coordinator.publish.gguf_export, the recompute is shared.policy.completion_stats with the jobs' keys (the
verifier's function) and the verdict check_choices with coordinator.config's default tolerance of the class.
Results are shaped like the default run's jobs: jobs.prompts_per_job × learner.group_size completions of at most
sampling.max_tokens tokens, arithmetic-task prompts; every result is its own job with its own key.

Beyond the sample: an honest margin is positive only where the two best noised scores lie within the two
implementations' logit difference. The positive margins' upper tail is fitted with an exponential (the largest
quarter of them, maximum likelihood), and the per-result false-refusal rate is estimated as
1 − (1 − P(margin > tolerance))^(tokens per result), with P from the fit times the share of positive margins.

Free choice: at each honest position, the tokens whose noised score is within the tolerance of the best are the
ones an adversary could send instead without refusal: log2 of their count, averaged over positions, is its free
choice in bits per token (0 when only the keyed choice passes).

``--verifier own`` (issue 36, the default since the verifier recomputes llama.cpp results with llama.cpp): a
llama.cpp class's results are judged by coordinator.engine.llama_verifier on the very GGUF the client ran, at the
class's own tolerance; precisions q6_K, q5_K_M, q4_K_M and q4_0 come from llama.cpp's quantiser. ``--verifier
torch`` judges every class by the torch float32 recompute, as before. Likewise torch-bf16: ``own`` judges it by
coordinator.engine.torch_replay in bf16 (the client's generations replayed), ``torch`` by the float32 pass. Each class row also gives the largest
per-result mean and per-token |Δ logprob| between the client's report and the recompute (the logprob check).

Attacks (judged against the torch verifier at each class's tolerance): greedy decoding; forced-correct answers;
best-of-16 by reward (honest keyed samples of 16 other keys, the group with the highest reward); top-k steering
(at every position, the token among the policy's 4 likeliest that continues the correct answer, else the keyed
choice); junk (random non-stop tokens); and class shopping, judged by each other class's own recompute only (a
torch client's honest keyed sample sent as that class's: its tokens differ from the class's keyed sample where
torch's logits and the class's flip a near-tie, and pass where every such flip lies within the class's tolerance).
A result identical to the honest keyed sample is honest work: counted apart ("same as honest"), never as a miss —
for a class judged by its own recompute, the sample whose every token is that recompute's keyed choice (margins 0).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sampling_calibration import Prompts, Setup, _job, job_shape, load_setup  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
SECTION = "## Keyed sampling: calibration"
SHARD_STRIDE = 10**6  # results per shard's key range (a shard's temperatures draw from it one after the other)
ATTACK_FIRST = 10**6 // 2  # the attacks' range within a shard, past any honest results a shard judges
SHOPPING = "torch sample as this class"  # class shopping: a torch client's honest keyed sample sent under a claim
BITS_EVERY = 10  # free choice is measured on every 10th honest result (a second pass over the full scores)


@dataclass
class ClassRow:
    name: str
    temperature: float
    tolerance: float
    results: int = 0
    tokens: int = 0
    positive: list[float] = field(default_factory=list)  # the positive margins (honest tokens off the argmax)
    worst: float = 0.0
    refused: int = 0
    bits: float = 0.0  # summed over the tokens of every BITS_EVERY-th result
    bits_tokens: int = 0
    seconds: float = 0.0
    lp_mean: float = 0.0  # largest per-result mean |Δ logprob| (report vs recompute)
    lp_max: float = 0.0  # largest per-token |Δ logprob|
    verifier: str = "torch"

    def tail_rate(self) -> float:
        """Estimated per-result false-refusal rate at the tolerance (see the module docstring)."""
        if not self.tokens:
            return float("nan")
        pos = sorted(self.positive)
        share = len(pos) / self.tokens
        if len(pos) < 8:  # too few to fit: a rule-of-three bound on the share, with the largest seen as the scale
            share = max(share, 3.0 / self.tokens)
            scale = max(pos[-1] if pos else 1e-6, 1e-6)
            tail = share * math.exp(-self.tolerance / scale)
        else:
            top = pos[-max(8, len(pos) // 4) :]
            u = top[0]
            scale = max(1e-12, sum(x - u for x in top) / len(top))
            tail = share * len(top) / len(pos) * math.exp(-(self.tolerance - u) / scale)
        per_token = min(1.0, tail)
        return 1.0 - (1.0 - per_token) ** (self.tokens / max(1, self.results))


@dataclass
class AttackRow:
    kind: str
    tolerance_class: str
    results: int = 0
    same_as_honest: int = 0
    refused: int = 0


class Judge:
    """The verifier's recompute and margins (completion_stats with keys), plus each position's free choice."""

    def __init__(self, setup: Setup) -> None:
        self.s = setup
        self.logprobs: list[list[float]] = []  # the last result's recomputed logprobs (the logprob check's)

    def margins(self, results: list[tuple[list[list[int]], list[list[int]], int]], tolerance: float | None = None
                ) -> list[tuple[list[list[float]], float]]:
        """Per result: the margins of each completion's tokens, and (with ``tolerance``) the summed free-choice
        bits over its tokens."""
        import torch

        from shared.policy import _logits, completion_stats
        from shared.sampler import job_word, keyed_scores_torch, plain_segments

        out = []
        with torch.no_grad():
            for prompts, comps, key in results:
                stats = completion_stats(self.s.model, prompts, comps, temperature=self.s.temperature,
                                         pad_id=self.s.pad, share_prompts=True,
                                         segments=plain_segments(key, [len(c) for c in comps]))
                assert stats.margins is not None
                rows = [r[: len(c)] for r, c in zip(stats.margins.tolist(), comps, strict=True)]
                self.logprobs = [r[: len(c)] for r, c in zip(stats.logprobs.tolist(), comps, strict=True)]
                bits = 0.0
                if tolerance is not None:
                    logits, ids, mask = _logits(self.s.model, prompts, comps, self.s.temperature, self.s.pad, True)
                    n, width = ids.shape
                    scores = keyed_scores_torch(
                        logits, 1.0, torch.full((n, width), job_word(key), dtype=torch.long),
                        torch.arange(n)[:, None].expand(n, width), torch.arange(width)[None, :].expand(n, width))
                    best = scores.max(-1).values
                    within = (scores >= (best - tolerance)[..., None]).sum(-1).to(torch.float64)
                    bits = float((torch.log2(within) * mask).sum())
                out.append((rows, bits))
        return out


class LlamaJudge:
    """The verifier's llama.cpp recompute (coordinator.engine.llama_verifier) on the class's own GGUF: margins and
    logprobs from one teacher-forced pass; free choice is not measured (0 bits: no second pass over the scores)."""

    def __init__(self, folder: Path, temperature: float) -> None:
        from coordinator.engine.llama_verifier import LlamaRecompute

        self.recompute = LlamaRecompute(lambda _v: folder, temperature=temperature, threads=1)
        self.logprobs: list[list[float]] = []

    def margins(self, results: list[tuple[list[list[int]], list[list[int]], int]], tolerance: float | None = None
                ) -> list[tuple[list[list[float]], float]]:
        from shared.sampler import plain_segments

        out = []
        for prompts, comps, key in results:
            group = next((k for k in range(1, len(prompts)) if prompts[k] != prompts[0]), len(prompts))
            stats = self.recompute.recompute_stats(0, prompts, comps, plain_segments(key, [len(c) for c in comps]),
                                                   group)
            assert stats.margins is not None
            self.logprobs = stats.logprobs
            out.append((stats.margins, 0.0))
        return out


class ReplayJudge:
    """The verifier's bf16 replay of a torch client's generations (coordinator.engine.torch_replay) on the folder the
    client loaded; free choice is not measured (0 bits), as for :class:`LlamaJudge`."""

    def __init__(self, folder: Path, temperature: float, pad: int) -> None:
        from coordinator.engine.torch_replay import TorchReplay

        self.recompute = TorchReplay(lambda _v: folder, dtype="bfloat16", device="cpu", temperature=temperature,
                                     pad_id=pad)
        self.logprobs: list[list[float]] = []

    def margins(self, results: list[tuple[list[list[int]], list[list[int]], int]], tolerance: float | None = None
                ) -> list[tuple[list[list[float]], float]]:
        from shared.sampler import plain_segments

        out = []
        for prompts, comps, key in results:
            stats = self.recompute.recompute_stats(0, prompts, comps, plain_segments(key, [len(c) for c in comps]))
            assert stats.margins is not None
            self.logprobs = stats.logprobs
            out.append((stats.margins, 0.0))
        return out


def _results(idx: list[int], comps: list[list[int]], setup: Setup, per_result: int, group: int, key: int
             ) -> tuple[list[list[int]], list[list[int]], int]:
    return [setup.prompts[i] for i in idx for _ in range(group)], comps, key


def honest(setup: Setup, judge: Any, row: ClassRow, backend: Any, n: int, shape: tuple[int, int, int],
           first: int, tol: float) -> None:
    from coordinator.core.verify import check_choices, choice_stats, logprob_stats
    from shared.errors import ProtocolError

    per_result, group, max_tokens = shape
    stream = Prompts(setup, per_result, first)
    t0 = time.monotonic()
    for r in range(n):
        idx = stream.take(1)
        key = 10_000_019 * (first + r + 1) + int(row.temperature * 1000)
        job = _job([setup.prompts[i] for i in idx], group, max_tokens, setup.temperature, setup.stops, key)
        sampled = backend.generate(job, lambda: False)
        comps = [list(x.token_ids) for x in sampled]
        measure = r % BITS_EVERY == 0
        ((rows, bits),) = judge.margins([_results(idx, comps, setup, per_result, group, key)],
                                        tol if measure else None)
        lp = logprob_stats([list(x.logprobs) for x in sampled], judge.logprobs)
        row.lp_mean, row.lp_max = max(row.lp_mean, lp.mean_abs), max(row.lp_max, lp.max_abs)
        row.results += 1
        if measure:
            row.bits += bits
            row.bits_tokens += sum(len(c) for c in comps)
        for m in (m for rr in rows for m in rr):
            row.tokens += 1
            if m > 0:
                row.positive.append(m)
                row.worst = max(row.worst, m)
        try:
            check_choices(choice_stats(rows), tol)
        except ProtocolError:
            row.refused += 1
        if (r + 1) % 500 == 0:
            print(f"  {row.name} T={row.temperature:g}: {r + 1}/{n} results, {row.refused} refused, worst "
                  f"{row.worst:.3g}", flush=True)
    row.seconds += time.monotonic() - t0


def attacks(setup: Setup, judge: Judge, n: int, shape: tuple[int, int, int], tolerances: dict[str, float],
            first: int, own: dict[str, tuple[Any, float]] | None = None,
            done: Callable[[list[AttackRow]], None] | None = None) -> list[AttackRow]:
    """Attack results judged by the torch recompute at each of ``tolerances``, and by each of ``own``'s judges
    (label → (judge, tolerance): a llama.cpp class's own-precision recompute) at its own tolerance. ``done`` sees
    the rows after every attack result (a run stopped early keeps what it judged)."""
    import torch

    from coordinator.core.verify import check_choices, choice_stats
    from shared.errors import ProtocolError
    from shared.policy import generate

    per_result, group, max_tokens = shape
    stream = Prompts(setup, per_result, first)
    rng = random.Random(first)
    eos = setup.stops[0]
    vocab = int(setup.model.get_input_embeddings().num_embeddings)
    non_stop = [t for t in range(vocab) if t not in setup.stops]
    rows: dict[tuple[str, str], AttackRow] = {}

    def sample(prompts: list[list[int]], g: int, key: int | None) -> list[list[int]]:
        with torch.no_grad():
            return [list(x.token_ids) for x in generate(setup.model, prompts, group_size=g,
                                                        temperature=setup.temperature, max_tokens=max_tokens,
                                                        stop_ids=setup.stops, seed=key, pad_id=setup.pad)]

    def forced(i: int) -> list[int]:
        return list(setup.tokenizer.encode(" " + setup.answers[i]))[: max_tokens - 1] + [eos]

    def steer(prompt: list[int], target: list[int], key: int, rollout: int) -> list[int]:
        """Top-4 steering: at each position the likeliest-4 token that continues ``target``, else the keyed one."""
        from shared.sampler import choose_torch, job_word

        out: list[int] = []
        with torch.no_grad():
            for t in range(max_tokens):
                logits = setup.model(input_ids=torch.tensor([prompt + out])).logits[0, -1].float()
                top = logits.topk(4).indices.tolist()
                want = target[t] if t < len(target) else eos
                tok = want if want in top else int(choose_torch(logits[None], setup.temperature,
                                                                torch.tensor([job_word(key)]),
                                                                torch.tensor([rollout]), t)[0])
                out.append(tok)
                if tok in setup.stops:
                    break
        return out

    for r in range(n):
        idx = stream.take(1)
        key = 7_000_003 * (first + r + 1)
        prompts = [setup.prompts[i] for i in idx]
        flat = [p for p in prompts for _ in range(group)]
        honest_comps = sample(prompts, group, key)
        cands: dict[str, list[list[int]]] = {
            "greedy": sample(prompts, group, None),
            "forced-correct": [forced(i) for i in idx for _ in range(group)],
            "junk": [[rng.choice(non_stop) for _ in range(max_tokens)] for _ in range(len(flat))],
            "top-4 steering": [steer(flat[j], forced(idx[j // group]), key, j) for j in range(len(flat))],
        }
        pool: list[list[int]] = []  # best-of-16: 16 honest groups under other keys, the best-rewarded group kept
        for k in range(16):
            pool += sample(prompts, group, key + 1 + k)
        picked: list[list[int]] = []
        for j, i in enumerate(idx):
            groups = [[pool[(k * per_result + j) * group + g] for g in range(group)] for k in range(16)]
            score = [sum(setup.task.reward(setup.items[i], setup.tokenizer.decode(c, skip_special_tokens=True))
                         for c in grp) for grp in groups]
            picked += groups[int(np.argmax(score))]
        cands["best-of-16 by reward"] = picked
        cands[SHOPPING] = honest_comps  # judged by the other classes' own recomputes only (see the docstring)
        for kind, comps in cands.items():
            judged = []
            if kind != SHOPPING:
                ((margin_rows, _),) = judge.margins([(flat, comps, key)])
                judged = [(cls, tol, margin_rows, comps == honest_comps) for cls, tol in tolerances.items()]
            for cls, (own_judge, tol) in (own or {}).items():
                ((own_rows, _),) = own_judge.margins([(flat, comps, key)])
                # the class's own keyed sample is the one whose every token is its recompute's keyed choice
                judged.append((cls, tol, own_rows, all(m <= 0.0 for r in own_rows for m in r)))
            for cls, tol, margin_rows, same in judged:
                row = rows.setdefault((kind, cls), AttackRow(kind, cls))
                row.results += 1
                if same:
                    row.same_as_honest += 1
                    continue
                try:
                    check_choices(choice_stats(margin_rows), tol)
                except ProtocolError:
                    row.refused += 1
        if done is not None:
            done(list(rows.values()))
    return list(rows.values())


def bf16_copy(folder: Path, out: Path) -> Path:
    """The model folder with its safetensors weights rounded to bf16 (a `snapshots.dtype = "bfloat16"` snapshot)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    for shard in sorted(out.glob("*.safetensors")):
        import torch

        state = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(shard)).items()}
        save_file(state, str(shard), metadata={"format": "pt"})
    return out


def pooled(rows: list[ClassRow], atk: list[AttackRow]) -> tuple[list[ClassRow], list[AttackRow]]:
    """One row per class, temperature and verifier (and per attack kind and class) from the rows of several shards:
    counts add up, the margins pool (so the tail fit sees them all), the largest stay the largest. Rows that judged
    nothing (a run with ``--results 0``) drop out."""
    by: dict[tuple[str, float, str, float], ClassRow] = {}
    for r in (r for r in rows if r.results):
        key = (r.name, r.temperature, r.verifier, r.tolerance)
        if key not in by:
            by[key] = ClassRow(r.name, r.temperature, r.tolerance, verifier=r.verifier)
        p = by[key]
        p.results, p.tokens, p.refused = p.results + r.results, p.tokens + r.tokens, p.refused + r.refused
        p.positive += r.positive
        p.worst, p.lp_mean, p.lp_max = max(p.worst, r.worst), max(p.lp_mean, r.lp_mean), max(p.lp_max, r.lp_max)
        p.bits, p.bits_tokens, p.seconds = p.bits + r.bits, p.bits_tokens + r.bits_tokens, p.seconds + r.seconds
    kinds: dict[tuple[str, str], AttackRow] = {}
    for a in atk:
        q = kinds.setdefault((a.kind, a.tolerance_class), AttackRow(a.kind, a.tolerance_class))
        q.results, q.same_as_honest, q.refused = (q.results + a.results, q.same_as_honest + a.same_as_honest,
                                                   q.refused + a.refused)
    return list(by.values()), list(kinds.values())


def _row_json(r: ClassRow) -> dict[str, Any]:
    return r.__dict__ | {"positive": sorted(r.positive), "tail_rate": r.tail_rate()}


def table(rows: list[ClassRow], atk: list[AttackRow]) -> str:
    lines = ["| class | verifier | T | results | tokens | off the argmax | worst honest margin | tolerance | refused | "
             "est. false-refusal rate per result | free choice (bits/token) | largest mean / token \\|Δ logprob\\| "
             "| s/result |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bits = f"{r.bits / max(1, r.bits_tokens):.2e}" if r.verifier == "torch" else "–"
        lines.append(f"| {r.name} | {r.verifier} | {r.temperature:g} | {r.results} | {r.tokens} | "
                     f"{len(r.positive) / max(1, r.tokens):.4%} | {r.worst:.3g} | {r.tolerance:g} | {r.refused} | "
                     f"{r.tail_rate():.1e} | {bits} | {r.lp_mean:.2e} / {r.lp_max:.2e} | "
                     f"{r.seconds / max(1, r.results):.3f} |")
    lines += ["", "| attack | tolerance of | results | same as honest | refused of the others |", "|---|---|---|---|---|"]
    for a in atk:
        other = a.results - a.same_as_honest
        rate = f"{a.refused}/{other} ({a.refused / other:.1%})" if other else "–"
        lines.append(f"| {a.kind} | {a.tolerance_class} | {a.results} | {a.same_as_honest} | {rate} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=int, default=2000, help="honest results per class and temperature")
    ap.add_argument("--attacks", type=int, default=200, help="results per attack kind (temperature 1.0)")
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--classes", default="torch-f32,torch-bf16w,torch-bf16,llama-f16,llama-q8_0,llama-q6_K,llama-q5_K_M,"
                    "llama-q4_K_M")
    ap.add_argument("--verifier", choices=("own", "torch"), default="own", help="own: a llama.cpp class is judged "
                    "by llama.cpp on its own GGUF (the coordinator's verifier); torch: by the torch recompute")
    ap.add_argument("--model-dir", type=Path, default=None, help="the tiny model's folder (default: build/cache it)")
    ap.add_argument("--shape", default=None, help="prompts per result, completions per prompt, max new tokens "
                    "(e.g. 1,4,16 at the 0.5 B shape; default: the coordinator's job defaults)")
    ap.add_argument("--attack-tolerances", default="", help="more tolerances to judge the attacks at, as "
                    "LABEL=VALUE in logit units, comma-separated (candidates for a class's default)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--shard", type=int, default=0, help="which share of a calibration spread over several runs "
                    "this is: shard i draws its keys and prompts from its own range (i × 10⁶ onwards), so runs with "
                    "different shards judge different results and --add pools them into one row per class")
    ap.add_argument("--add", type=Path, action="append", default=[], help="pool the class rows and attacks of an "
                    "earlier run's --json into the table: the same class, temperature and verifier become one row "
                    "(give each run its own --shard)")
    ap.add_argument("--write-docs", action="store_true", help=f"replace the table under '{SECTION}' in {DOCS}")
    args = ap.parse_args()

    import torch

    from coordinator.config import VerificationConfig
    from coordinator.engine.evaluation import pad_id
    from coordinator.publish.gguf_export import export_folder
    from shared.policy import load_tokenizer
    from swarm_client.backends.llama_backend import LlamaBackend
    from swarm_client.backends.torch_backend import TorchBackend

    torch.set_num_threads(1)
    shape = job_shape(args.shape)
    if args.model_dir is None:
        from coordinator.engine.tiny_model import ensure_tiny_model

        base = ensure_tiny_model()
    else:
        base = args.model_dir
    vcfg = VerificationConfig()

    def tolerance(cls: str) -> float:
        """The class's keyed tolerance; torch-bf16 judged by the float32 pass (--verifier torch) gets torch's."""
        own_class = cls.startswith("llama-") or (cls == "torch-bf16" and args.verifier == "own")
        return vcfg.choice_tolerance(cls if own_class else "torch")

    own_judges: dict[str, tuple[Any, float]] = {}

    t0 = time.monotonic()
    rows: list[ClassRow] = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"f32": base}
        for cls in filter(None, args.classes.split(",")):  # "" with --add: only pool earlier runs
            backend_name, _, precision = cls.partition("-")
            if backend_name == "torch":  # bf16w: bf16 snapshot weights, computed in float32; bf16: computed in bf16
                folder = base if precision != "bf16w" else folders.get("bf16w") or bf16_copy(base, Path(tmp) / "bf16")
                folders[precision] = folder
                backend: Any = TorchBackend(device="cpu", threads=1,
                                            dtype="bfloat16" if precision == "bf16" else "float32")
                backend.load(folder)
                if cls == "torch-bf16" and args.verifier == "own":
                    own_judges[cls] = (ReplayJudge(folder, 1.0, pad_id(load_tokenizer(folder))), tolerance(cls))
            else:
                folder = base
                gdir = Path(tmp) / precision
                gdir.mkdir()
                export_folder(base, gdir / "model.gguf", precision)
                backend = LlamaBackend(device="cpu", threads=1, n_ctx=64)
                backend.load(gdir)
                if args.verifier == "own":
                    own_judges[cls] = (LlamaJudge(gdir, 1.0), tolerance(cls))
            for k, temperature in enumerate(float(t) for t in args.temperatures.split(",")):
                setup = load_setup(folder, temperature)  # the verifier's replica: float32 from the same weights
                own = args.verifier == "own" and (backend_name == "llama" or cls == "torch-bf16")
                row = ClassRow(cls, temperature, tolerance(cls) / temperature,  # logit units ÷ T
                               verifier=("torch bf16 replay" if backend_name == "torch" else "llama.cpp, own file")
                               if own else "torch")
                judge: Any = Judge(setup)
                if own:
                    judge = (ReplayJudge(folder, temperature, setup.pad) if backend_name == "torch"
                             else LlamaJudge(Path(tmp) / precision, temperature))
                honest(setup, judge, row, backend, args.results, shape,
                       first=args.shard * SHARD_STRIDE + k * args.results, tol=row.tolerance)
                rows.append(row)
                print(f"[{time.monotonic() - t0:6.0f}s] {cls} T={temperature:g}: {row.results} results, "
                      f"{row.refused} refused, worst {row.worst:.3g}", flush=True)
                if args.json:  # what is done so far, so a run cut short still leaves its figures
                    args.json.write_text(json.dumps({"classes": [_row_json(r) for r in rows], "attacks": []}))
            del backend
        setup = load_setup(base, 1.0)
        tols = {"torch": tolerance("torch-f32")}
        if args.verifier == "torch":
            tols |= {"llama-f16": tolerance("llama-f16"), "llama-q8_0": tolerance("llama-q8_0")}
        for spec in filter(None, args.attack_tolerances.split(",")):  # label=logit units, e.g. "q8_0 at 3=3.0"
            label, _, value = spec.partition("=")
            tols[label.strip()] = float(value)
        def save(atk: list[AttackRow]) -> None:  # what is judged so far, so a run cut short keeps its figures
            if args.json:
                args.json.write_text(json.dumps({"classes": [_row_json(r) for r in rows],
                                                 "attacks": [a.__dict__ for a in atk]}))

        atk = attacks(setup, Judge(setup), args.attacks, shape, tols, first=ATTACK_FIRST + args.shard * SHARD_STRIDE,
                      own=own_judges, done=save) if args.attacks else []
        print(f"[{time.monotonic() - t0:6.0f}s] attacks done", flush=True)
    for path in args.add:
        earlier = json.loads(path.read_text())
        rows += [ClassRow(**{k: v for k, v in d.items() if k != "tail_rate"}) for d in earlier["classes"]]
        atk += [AttackRow(**d) for d in earlier["attacks"]]
    rows, atk = pooled(rows, atk)
    text = table(rows, atk)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"classes": [_row_json(r) for r in rows], "attacks": [a.__dict__ for a in atk]}))
    if args.write_docs:
        doc = DOCS.read_text()
        head = (f"{SECTION}\n\n`python bench/choice_calibration.py --results {args.results} --attacks "
                f"{args.attacks}` (tiny model, {shape[0]}×{shape[1]} completions of ≤ {shape[2]} tokens per result, "
                f"2-core CPU, one run):\n\n")
        if SECTION in doc:
            start = doc.index(SECTION)
            end = doc.find("\n## ", start + len(SECTION))
            doc = doc[:start] + head + text + "\n" + (doc[end:] if end != -1 else "")
        else:
            doc = doc.rstrip() + "\n\n" + head + text + "\n"
        DOCS.write_text(doc)


if __name__ == "__main__":
    main()
