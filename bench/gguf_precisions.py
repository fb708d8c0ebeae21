"""What each GGUF precision costs a llama.cpp volunteer: file bytes per parameter, the client's memory once loaded,
its decode speed beside the raw llama.cpp loop's, how long the coordinator takes to make the file and to recompute a
result on it — measured on one model, projected to 7 B.

    PYTHONPATH=. nice -n 5 python bench/gguf_precisions.py [--model qwen0.5b | --model-dir DIR]
        [--precisions f16,q8_0,q6_K,q5_K_M,q4_K_M,q4_0] [--threads 2] [--tokens 64] [--reps 5] [--json out.json]

``--model qwen0.5b`` builds Qwen2.5-0.5B's shape with random weights (hidden 896, 24 layers, vocabulary 151,936;
494 M parameters; ~25 s), saved in float32. Each precision is written the coordinator's way
(coordinator.publish.gguf_export: f16 by our writer, the rest by llama.cpp's quantiser from it) and loaded the
client's way (swarm_client.backends.llama_backend.LlamaBackend, n_ctx 2048 as `join` uses, f16 KV cache), each in a
fresh process, so nothing of an earlier one is counted. Memory is that process's peak resident set (VmHWM).

Decode: groups of 4 rollouts × ``--tokens`` tokens, the client's keyed sampler (``LlamaBackend.sample``) against
llama.cpp's own ``generate`` loop and sampler on the same llama context — the same evaluations on both sides (the
group's first rollout prefills the prompt in one batch, the others reuse its cache), so the difference is the
loop's own work. ``--reps`` pairs run in alternating order (client first, then raw first) and the figures are
medians: tokens/s, the paired ratio client ÷ raw (over all pairs, and over the quiet ones: under 0.15 cores of
other load on both sides), CPU time per token (the process's, every thread), the time per
token spent outside llama.cpp's eval (the keyed choice, log-softmax and copies; llama.cpp's sampler on the raw
side), and the other processes' load meanwhile, in cores (from /proc/stat). llama.cpp's threads wait on each other
at every step, so a core taken by another process slows its eval many times over: the ratio is only meaningful
where that load is near 0; the time outside the eval is the figure least moved by it, and the bench also gives the
ratio the two loops' own times make beside the run's least disturbed eval (both sides evaluate the same tokens the
same way, so that eval is common to both). The 7 B column scales the
measured bytes per parameter to Qwen2.5-7B's 7.62 B parameters and adds the measured non-weight memory unchanged
(an underestimate: a 7 B model's KV cache and compute buffers are larger).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARAMS_7B = 7.62e9
PROBE_FLAG = "--probe"
PROMPT = list(range(3, 35))
GROUP = 4  # rollouts per prompt, as a job's group: the first evaluates the prompt from scratch, the others reuse it
QUIET_LOAD = 0.15  # cores: a pair of decode groups during which other processes used less counts as quiet


def machine_busy_s() -> float:
    """CPU seconds every process on this machine has spent so far (Linux /proc/stat; the other work on a shared
    machine is this minus our own process's CPU time over a span)."""
    with open("/proc/stat") as fh:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fh.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class EvalClock:
    """Seconds spent inside ``llm.eval`` (llama.cpp's evaluation: the prompt's batches and every sampled token),
    by shadowing the method on the instance — what both loops share; the rest of a loop's time is its own."""

    def __init__(self, llm: Any) -> None:
        self.seconds = 0.0
        inner = llm.eval

        def timed(tokens: Any) -> None:
            t0 = time.perf_counter()
            inner(tokens)
            self.seconds += time.perf_counter() - t0

        llm.eval = timed


def measured(run: Callable[[], int], clock: EvalClock) -> dict[str, float]:
    """Run one group; its tokens, wall and CPU seconds (this process's, every thread), seconds in llama.cpp's eval,
    and the other processes' load on the machine meanwhile (cores)."""
    busy0, cpu0, eval0, t0 = machine_busy_s(), time.process_time(), clock.seconds, time.perf_counter()
    tokens = run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "eval_s": clock.seconds - eval0,
            "other_load": max(0.0, machine_busy_s() - busy0 - cpu) / wall}


def decode_side_by_side(backend: Any, tokens: int, reps: int) -> tuple[dict[str, Any], list[list[int]]]:
    """The client's keyed sampler (``LlamaBackend.sample``) against llama.cpp's own ``generate`` loop and sampler on
    the same model, prompt and lengths, with the same evaluations (each group's first rollout prefills the prompt
    in one batch, the others reuse its cache and evaluate its last token, then one token at a time): ``reps`` pairs
    in alternating order (client first, then raw first: a load that rises or falls weighs on both alike), after one
    unmeasured pair. Per side the medians of tokens/s, CPU ms and ms beyond llama.cpp's eval per token; the median
    of the paired ratios client ÷ raw; the other processes' load."""
    llm = backend.llm
    clock = EvalClock(llm)
    no_stop: frozenset[int] = frozenset({-1})
    samples: list[list[int]] = []

    def client(key: int) -> int:
        samples[:] = [backend.sample(PROMPT, temperature=1.0, max_tokens=tokens, stop_ids=no_stop, key=key,
                                     rollout=r, fresh=r == 0).token_ids for r in range(GROUP)]
        return sum(map(len, samples))

    def raw() -> int:
        llm.reset()  # the group's first rollout prefills the prompt from scratch, as the client's does
        n = 0
        for _ in range(GROUP):
            for i, _tok in enumerate(llm.generate(PROMPT, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, reset=True)):
                n += 1
                if i + 1 >= tokens:
                    break
        return n

    client(1)
    raw()
    runs: dict[str, list[dict[str, float]]] = {"client": [], "raw": []}
    kept: list[list[int]] = []
    for rep in range(reps):
        for side in (("client", "raw") if rep % 2 == 0 else ("raw", "client")):
            runs[side].append(measured(functools.partial(client, rep + 2) if side == "client" else raw, clock))
            if side == "client" and not kept:
                kept = [list(s) for s in samples]

    def per_token(side: str, key: str) -> float:
        return statistics.median(r[key] / r["tokens"] * 1e3 for r in runs[side])

    out: dict[str, Any] = {"reps": reps, "group": GROUP, "runs": runs,
                           "paired_ratios": [r["wall_s"] / c["wall_s"] * c["tokens"] / r["tokens"]
                                             for c, r in zip(runs["client"], runs["raw"], strict=True)],
                           "other_load": statistics.median(r["other_load"] for side in runs.values() for r in side)}
    out["ratio"] = statistics.median(out["paired_ratios"])
    out["quiet_ratios"] = [q for q, c, r in zip(out["paired_ratios"], runs["client"], runs["raw"], strict=True)
                           if max(c["other_load"], r["other_load"]) < QUIET_LOAD]
    out["quiet_ratio"] = statistics.median(out["quiet_ratios"]) if out["quiet_ratios"] else None
    for side in runs:
        out[f"{side}_tokens_per_s"] = 1e3 / per_token(side, "wall_s")
        out[f"{side}_cpu_ms_per_token"] = per_token(side, "cpu_s")
        out[f"{side}_beyond_eval_ms_per_token"] = statistics.median(
            (r["wall_s"] - r["eval_s"]) / r["tokens"] * 1e3 for r in runs[side])
    # both sides evaluate the same tokens the same way: at the least disturbed eval of the run, the ratio is what
    # each loop adds beyond it (a figure built from measured parts, for a machine that is never quiet)
    quietest = min(r["eval_s"] / r["tokens"] for side in runs.values() for r in side) * 1e3
    out["quietest_eval_ms_per_token"] = quietest
    out["ratio_at_quietest_eval"] = ((quietest + out["raw_beyond_eval_ms_per_token"])
                                     / (quietest + out["client_beyond_eval_ms_per_token"]))
    return out, kept


def probe(folder: Path, threads: int, tokens: int, reps: int) -> dict[str, Any]:
    """What a fresh client process measures on one precision's file (printed as one JSON line)."""
    from swarm_client.backends.llama_backend import LlamaBackend

    b = LlamaBackend(device="cpu", threads=threads)
    t0 = time.monotonic()
    b.load(folder)
    load_s = time.monotonic() - t0
    decode, samples = decode_side_by_side(b, tokens, reps)
    # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's peak at fork (the bench holds a float32 model)
    with open("/proc/self/status") as fh:
        hwm = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    # the verifier's llama.cpp recompute of that group (coordinator.engine.llama_verifier: replaying its evaluations)
    from coordinator.engine.llama_verifier import LlamaRecompute

    rec = LlamaRecompute(lambda v: folder, temperature=1.0, threads=threads)
    rec.recompute_stats(0, [PROMPT], samples[:1], None)  # loads the file: timed apart (load_s), once per version
    t0 = time.monotonic()
    rec.recompute_stats(0, [PROMPT] * GROUP, samples, None, group=GROUP)
    verify_s = time.monotonic() - t0
    return {"load_s": load_s, "decode": decode, "peak_rss": hwm * 1024, "verify_s": verify_s, "samples": samples,
            "prompt": PROMPT}


def build_qwen05(out: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from coordinator.engine.tiny_model import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768,
                      rope_theta=1e6, tie_word_embeddings=True, bos_token_id=tok.eos_token_id,
                      eos_token_id=tok.eos_token_id)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


_TORCH: dict[str, object] = {}


def torch_verify_s(model_dir: Path, prompt: list[int], samples: list[list[int]], threads: int) -> float:
    """Seconds of the torch verifier's recompute (shared.policy.completion_stats, one batched float32 pass, the
    prompt shared) of the same group — what a llama.cpp result cost the verifier before issue 36."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared.policy import completion_stats

    torch.set_num_threads(threads)
    model = _TORCH.get(str(model_dir))
    if model is None:
        model = _TORCH[str(model_dir)] = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    prompts = [prompt] * len(samples)
    completion_stats(model, prompts[:1], samples[:1], temperature=1.0, pad_id=0)  # warm
    t0 = time.monotonic()
    completion_stats(model, prompts, samples, temperature=1.0, pad_id=0, share_prompts=True)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("qwen0.5b",), default=None)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--precisions", default="f16,q8_0,q6_K,q5_K_M,q4_K_M,q4_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="pairs of decode groups (client, raw) per precision")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from safetensors import safe_open

    from coordinator.publish.gguf_export import export_folder

    rows = []
    with tempfile.TemporaryDirectory(prefix="gguf-precisions-") as tmp:
        if args.model_dir is not None:
            model_dir = args.model_dir
        elif args.model == "qwen0.5b":
            model_dir = build_qwen05(Path(tmp) / "model")
        else:
            from coordinator.engine.tiny_model import ensure_tiny_model

            model_dir = ensure_tiny_model()
        params = 0
        for shard in model_dir.glob("*.safetensors"):
            with safe_open(str(shard), "np") as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    params += int(math.prod(fh.get_slice(name).get_shape()))
        for precision in args.precisions.split(","):
            folder = Path(tmp) / precision
            folder.mkdir()
            t0 = time.monotonic()
            export_folder(model_dir, folder / "model.gguf", precision)
            made_s = time.monotonic() - t0
            size = (folder / "model.gguf").stat().st_size
            child = subprocess.run([sys.executable, __file__, PROBE_FLAG, str(folder), str(args.threads),
                                    str(args.tokens), str(args.reps)], capture_output=True, text=True, check=True)
            got = json.loads(child.stdout.strip().splitlines()[-1])
            rss, decode = got["peak_rss"], got["decode"]
            row = {"precision": precision, "bytes": size, "bytes_per_param": size / params, "made_s": made_s,
                   "client_peak_rss": rss, "tokens_per_s": decode["client_tokens_per_s"], "load_s": got["load_s"],
                   "raw_tokens_per_s": decode["raw_tokens_per_s"], "decode": decode,
                   "llama_verify_s": got["verify_s"],
                   "torch_verify_s": torch_verify_s(model_dir, got["prompt"], got["samples"], args.threads),
                   "est_7b_bytes": size / params * PARAMS_7B + max(0, rss - size)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            (folder / "model.gguf").unlink()
    print(f"\n{params / 1e6:.0f} M parameters ({model_dir.name})\n")
    print("| precision | GGUF bytes | bytes/param | made in | client peak memory | decode tokens/s (÷ raw llama.cpp) "
          "| verifier s per group: llama.cpp replay / torch float32 | est. 7 B memory |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['bytes'] / 2**20:,.0f} MiB | {r['bytes_per_param']:.3f} | {r['made_s']:.1f} s | "
              f"{r['client_peak_rss'] / 2**30:.2f} GiB | {r['tokens_per_s']:.1f} "
              f"({r['tokens_per_s'] / r['raw_tokens_per_s']:.2f}) | {r['llama_verify_s']:.2f} / "
              f"{r['torch_verify_s']:.2f} | {r['est_7b_bytes'] / 2**30:.1f} GiB |")
    print(f"\nDecode side by side ({GROUP} rollouts x {args.tokens} tokens per group, {args.reps} pairs in alternating "
          f"order, {args.threads} threads; medians; other load = the other processes' CPU, in cores; a quiet pair: "
          f"under {QUIET_LOAD} on both sides):\n")
    print("| precision | client tokens/s | raw llama.cpp tokens/s | client / raw (paired, min-max) | the same, quiet "
          "pairs only | CPU ms/token client / raw | ms/token beyond llama.cpp's eval: client / raw | client / raw at the "
          "quietest eval (its ms/token) | other load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = r["decode"]
        quiet = (f"{d['quiet_ratio']:.3f} ({len(d['quiet_ratios'])} of {d['reps']})" if d["quiet_ratios"]
                 else f"none of {d['reps']}")
        print(f"| {r['precision']} | {d['client_tokens_per_s']:.1f} | {d['raw_tokens_per_s']:.1f} | {d['ratio']:.3f} "
              f"({min(d['paired_ratios']):.3f}-{max(d['paired_ratios']):.3f}) | {quiet} | "
              f"{d['client_cpu_ms_per_token']:.2f} / "
              f"{d['raw_cpu_ms_per_token']:.2f} | {d['client_beyond_eval_ms_per_token']:.2f} / "
              f"{d['raw_beyond_eval_ms_per_token']:.2f} | {d['ratio_at_quietest_eval']:.3f} "
              f"({d['quietest_eval_ms_per_token']:.1f}) | {d['other_load']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"params": params, "rows": rows}, indent=2))


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == PROBE_FLAG:  # a fresh process per precision (see the docstring)
        print(json.dumps(probe(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
    else:
        main()
