"""Honest keyed-sampler margins far beyond the sample: the noise redrawn on measured pairs of logits.

    PYTHONPATH=. nice -n 5 python bench/choice_tail.py --model-dir DIR [--model-dir DIR2 ...]
        [--classes llama-f32,llama-f16,llama-q8_0] [--results 300] [--draws 200] [--temperatures 1.0,0.7]
        [--shape P,G,T] [--json out.json]

Why: an honest token is refused only where the client's and the verifier's logits differ enough, at a position
where the two best noised scores nearly tie, to flip the keyed choice by more than the tolerance. Counting refusals
in a sample sees that event a few hundred times per million tokens at best (bench/choice_calibration.py). But the
margin of an honest token depends on nothing but the two logit vectors at its position (the client's l', the
verifier's l, both ÷ T) and the noise G: the client sends x = argmax(l' + G), the verifier's margin is
max(l + G) − (l_x + G_x). The keyed noise is a fixed pseudo-random function of (key, rollout, position, token)
distributed as independent standard Gumbels, so at each measured position the probability that an honest token's
margin exceeds a tolerance τ is P_G[margin > τ | l, l'] — which fresh Gumbel draws estimate ``--draws`` times per
position instead of once. Positions come from real honest results: the client's LlamaBackend generating (its logits
recorded as it chooses each token), the verifier's recompute (shared.policy's teacher-forced pass) on the same
completions; the model folders can be any checkpoints (e.g. the demo's trained versions: how honest margins grow as
training sharpens the policy).

At a large vocabulary only the top ``--top`` tokens by max(l, l') are drawn one by one; the rest are one aggregate
token whose logit is their logsumexp on each side (the maximum of Gumbel-perturbed logits is Gumbel at the
logsumexp), exact for the choice unless a token of the rest wins — whose probability the table states.

Reported per class, checkpoint and temperature: draws (positions × draws), the share of draws where the honest
token is not the verifier's exact argmax, the largest margin seen, the observed rate of margins above the class's
tolerance, and the rate fitted beyond (an exponential on the largest margins), per token and per result of the
shape's size.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sampling_calibration import Prompts, _job, job_shape, load_setup  # noqa: E402

KEEP_TOP = 4000  # largest margins kept per row for the tail fit
THRESHOLDS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


@dataclass
class TailRow:
    cls: str
    model: str
    temperature: float
    tolerance: float  # logit units ÷ T (what the verifier applies to tempered margins)
    positions: int = 0
    draws: int = 0
    tokens_per_result: float = 0.0
    off_argmax: int = 0
    rest_wins: int = 0  # draws whose choice on either side was the aggregate of the tokens beyond --top
    above: dict[str, int] = field(default_factory=dict)  # threshold (tempered units) → draws above it
    top: list[float] = field(default_factory=list)  # the largest margins (at most KEEP_TOP)
    max_logit_gap: float = 0.0  # largest |l' − l| among each position's top tokens (tempered units)

    def fitted(self, tol: float) -> float:
        """Per-draw rate of a margin above ``tol``: observed where enough draws lie above it, else an exponential
        fitted to the largest quarter of the kept margins (maximum likelihood), extrapolated."""
        if not self.draws:
            return float("nan")
        top = sorted(self.top)
        if len(top) < 16:
            return 3.0 / self.draws if not top or top[-1] <= tol else len([m for m in top if m > tol]) / self.draws
        tail = top[-max(16, len(top) // 4):]
        u = tail[0]
        if tol <= u:
            return sum(1 for m in top if m > tol) / self.draws
        scale = max(1e-12, sum(m - u for m in tail) / len(tail))
        return len(tail) / self.draws * math.exp(-(tol - u) / scale)


def record_llama_logits() -> list[np.ndarray]:
    """Wrap the llama.cpp backend's keyed choice so that each step's logits row is kept (a copy) before choosing."""
    import swarm_client.backends.llama_backend as lb

    seen: list[np.ndarray] = []
    real = lb.choose_np

    def choose(logits: np.ndarray, temperature: float, key: int, rollout: int, position: int) -> int:
        seen.append(np.array(logits, dtype=np.float32, copy=True))
        return real(logits, temperature, key, rollout, position)

    lb.choose_np = choose  # type: ignore[assignment]
    return seen


def resample(row: TailRow, client: np.ndarray, verifier: np.ndarray, draws: int, top: int,
             rng: np.random.Generator) -> None:
    """Draws of fresh Gumbel noise at each position of ``client``/``verifier`` (tempered logits [P, V])."""
    p, vocab = client.shape
    k = min(top, vocab)
    joint = np.maximum(client, verifier)
    if k < vocab:
        idx = np.argpartition(-joint, k - 1, axis=1)[:, :k]
        cl, ve = np.take_along_axis(client, idx, 1), np.take_along_axis(verifier, idx, 1)
        mask = np.ones_like(client, dtype=bool)
        np.put_along_axis(mask, idx, False, axis=1)
        rest_c = np.logaddexp.reduce(np.where(mask, client, -np.inf), axis=1)
        rest_v = np.logaddexp.reduce(np.where(mask, verifier, -np.inf), axis=1)
        cl = np.concatenate([cl, rest_c[:, None]], axis=1)
        ve = np.concatenate([ve, rest_v[:, None]], axis=1)
    else:
        cl, ve = client, verifier
    row.max_logit_gap = max(row.max_logit_gap, float(np.abs(cl[:, :k] - ve[:, :k]).max()))
    width = cl.shape[1]
    per = max(1, 2_000_000 // (draws * width))  # positions per chunk: ~2 M noised scores at once
    for s in range(0, p, per):
        c, v = cl[s : s + per, None, :], ve[s : s + per, None, :]
        g = rng.gumbel(size=(c.shape[0], draws, width)).astype(np.float32)
        sc, sv = c + g, v + g
        pick = sc.argmax(-1)
        best = sv.max(-1)
        margin = best - np.take_along_axis(sv, pick[..., None], -1)[..., 0]
        row.draws += margin.size
        row.off_argmax += int((margin > 0).sum())
        if k < vocab:
            row.rest_wins += int(((pick == k) | (sv.argmax(-1) == k)).sum())
        for t in THRESHOLDS:
            row.above[f"{t:g}"] = row.above.get(f"{t:g}", 0) + int((margin > t).sum())
        big = margin[margin > 0].ravel()
        if big.size:
            row.top = sorted([*row.top, *np.sort(big)[-KEEP_TOP:].tolist()])[-KEEP_TOP:]
    row.positions += p


def run_class(cls: str, folder: Path, temperature: float, results: int, shape: tuple[int, int, int], draws: int,
              top: int, tmp: Path, seed: int) -> TailRow:
    import torch

    from coordinator.config import VerificationConfig
    from coordinator.publish.gguf_export import export_folder
    from shared.policy import _logits
    from swarm_client.backends.llama_backend import LlamaBackend

    _, _, precision = cls.partition("-")
    tol = VerificationConfig().choice_tolerance(cls)  # the class is "llama-<precision>"
    row = TailRow(cls, folder.name, temperature, tol / temperature)
    gdir = tmp / f"{folder.name}-{precision}"
    if not gdir.exists():
        gdir.mkdir()
        export_folder(folder, gdir / "model.gguf", precision)
    setup = load_setup(folder, temperature)
    per_result, group, max_tokens = shape
    backend = LlamaBackend(device="cpu", threads=1, n_ctx=max(64, max(len(p) for p in setup.prompts) + max_tokens))
    backend.load(gdir)
    seen = record_llama_logits()
    stream = Prompts(setup, per_result, seed)
    rng = np.random.default_rng(seed)
    tokens = 0
    for r in range(results):
        idx = stream.take(1)
        key = 90_000_049 * (seed + r + 1) + int(temperature * 1000)
        job = _job([setup.prompts[i] for i in idx], group, max_tokens, temperature, setup.stops, key)
        seen.clear()
        comps = [list(x.token_ids) for x in backend.generate(job, lambda: False)]
        prompts = [setup.prompts[i] for i in idx for _ in range(group)]
        with torch.no_grad():
            logits, _, _ = _logits(setup.model, prompts, comps, temperature, setup.pad, True)
        ver = np.concatenate([logits[b, : len(c)].numpy() for b, c in enumerate(comps)])
        cli = np.stack(seen) / np.float32(temperature)
        assert cli.shape == ver.shape, (cli.shape, ver.shape)
        tokens += len(ver)
        resample(row, cli, ver.astype(np.float32), draws, top, rng)
    row.tokens_per_result = tokens / max(1, results)
    return row


def table(rows: list[TailRow]) -> str:
    lines = ["| class | model | T | positions × draws | off the argmax | largest margin | tolerance ÷ T | "
             "above it, observed | per token, fitted | per result, fitted | largest |l′ − l| (top tokens) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        seen = sum(1 for m in r.top if m > r.tolerance)
        per_tok = r.fitted(r.tolerance)
        per_res = -math.expm1(r.tokens_per_result * math.log1p(-min(per_tok, 1 - 1e-16)))
        lines.append(f"| {r.cls} | {r.model} | {r.temperature:g} | {r.positions:,} × {r.draws // max(1, r.positions)} "
                     f"| {r.off_argmax / max(1, r.draws):.4%} | {max(r.top, default=0.0):.3g} | {r.tolerance:.3g} | "
                     f"{seen} of {r.draws:,} | {per_tok:.1e} | {per_res:.1e} | {r.max_logit_gap:.3g} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, action="append", required=True, help="a model folder (repeatable)")
    ap.add_argument("--classes", default="llama-f32,llama-f16,llama-q8_0")
    ap.add_argument("--results", type=int, default=300, help="honest results per class, model and temperature")
    ap.add_argument("--draws", type=int, default=200, help="Gumbel draws per measured position")
    ap.add_argument("--top", type=int, default=512, help="tokens drawn one by one per position (the rest: one)")
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--shape", default=None, help="prompts per result, completions per prompt, max new tokens")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    shape = job_shape(args.shape)
    rows: list[TailRow] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_s:
        for folder in args.model_dir:
            for cls in args.classes.split(","):
                for k, temperature in enumerate(float(t) for t in args.temperatures.split(",")):
                    row = run_class(cls, folder, temperature, args.results, shape, args.draws, args.top, Path(tmp_s),
                                    seed=1000 * k)
                    rows.append(row)
                    print(f"[{time.monotonic() - t0:6.0f}s] {cls} {folder.name} T={temperature:g}: "
                          f"{row.positions} positions, largest margin {max(row.top, default=0):.3g}", flush=True)
                    if args.json:
                        args.json.write_text(json.dumps([r.__dict__ for r in rows]))
    print(table(rows))


if __name__ == "__main__":
    main()
