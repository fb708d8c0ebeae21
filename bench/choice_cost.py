"""What the keyed sampler costs, side by side in one run: the verifier's recompute with and without the keyed
margins (the check added to the pass it already runs), and a llama.cpp client's decode with the keyed sampler
against llama.cpp's own sampler on the same prompts.

    PYTHONPATH=. nice -n 5 python bench/choice_cost.py [--model qwen05b|tiny] [--reps 3] [--threads 2]
        [--json out.json]

The model is bench/scale.py's: the Qwen2.5-0.5B architecture from its config with random weights (151,936-token
vocabulary, where the per-token noise over the vocabulary weighs most), or the tiny model. Both sides run the
project's real code: shared.policy.completion_stats (the verifier's function) with and without the jobs'
segments, and swarm_client.backends.llama_backend.LlamaBackend.sample against llama-cpp-python's
``Llama.generate`` with its sampler at the same temperature (top_k 0, top_p 1). Each rep measures both, in
alternating order (with/without, then without/with: a load that rises or falls during a rep weighs on both alike),
and gives one paired ratio; the figure is the median of the reps' paired ratios, with their spread. On a shared
machine a ratio of medians moved by ±4 % between runs; the paired median is what decides a 5 % target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def verifier_cost(folder: Path, reps: int, prompts_n: int, group: int, prompt_len: int, max_tokens: int
                  ) -> dict[str, Any]:
    import torch

    from shared.policy import completion_stats, generate, load_model
    from shared.sampler import plain_segments

    model = load_model(folder).eval()
    vocab = int(model.get_input_embeddings().num_embeddings)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, min(vocab, 256), (prompt_len,), generator=g).tolist() for _ in range(prompts_n)]
    with torch.no_grad():
        samples = generate(model, prompts, group_size=group, temperature=1.0, max_tokens=max_tokens, stop_ids=[vocab],
                           seed=12345, pad_id=0)
    comps = [list(s.token_ids) for s in samples]
    flat = [p for p in prompts for _ in range(group)]
    segments = plain_segments(12345, [len(c) for c in comps])
    plain_s: list[float] = []
    keyed_s: list[float] = []
    worst = 0.0
    def plain() -> None:
        t0 = time.perf_counter()
        completion_stats(model, flat, comps, temperature=1.0, pad_id=0, share_prompts=True)
        plain_s.append(time.perf_counter() - t0)

    def keyed() -> None:
        nonlocal worst
        t0 = time.perf_counter()
        st = completion_stats(model, flat, comps, temperature=1.0, pad_id=0, share_prompts=True, segments=segments)
        keyed_s.append(time.perf_counter() - t0)
        assert st.margins is not None
        worst = max(worst, float(st.margins.max()))

    with torch.no_grad():
        plain()  # warm-up (first-touch pages, thread pools), not counted
        plain_s.clear()
        for rep in range(reps):
            for run in ((plain, keyed) if rep % 2 == 0 else (keyed, plain)):
                run()
    ratios = [k / p for k, p in zip(keyed_s, plain_s, strict=True)]
    return {"completions": len(comps), "tokens": sum(len(c) for c in comps), "vocab": vocab,
            "plain_s": statistics.median(plain_s), "keyed_s": statistics.median(keyed_s),
            "ratio": statistics.median(ratios), "ratios": ratios, "worst_honest_margin": worst}


def client_cost(folder: Path, reps: int, threads: int, prompts_n: int, prompt_len: int, max_tokens: int
                ) -> dict[str, Any]:
    from coordinator.publish.gguf_export import export_folder
    from swarm_client.backends.llama_backend import LlamaBackend

    with tempfile.TemporaryDirectory() as tmp:
        gdir = Path(tmp)
        export_folder(folder, gdir / "model.gguf", "f16")
        backend = LlamaBackend(device="cpu", threads=threads, n_ctx=prompt_len + max_tokens + 8)
        backend.load(gdir)
    llm = backend.llm
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(prompt_len)] for i in range(prompts_n)]
    raw_rates: list[float] = []
    keyed_rates: list[float] = []
    no_stop: frozenset[int] = frozenset()
    def raw(rep: int) -> None:
        tokens, t0 = 0, time.perf_counter()
        for i, p in enumerate(prompts):
            llm.set_seed(rep * 1000 + i)
            n = 0
            for _tok in llm.generate(p, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                                     reset=True):
                n += 1
                if n >= max_tokens:
                    break
            tokens += n
        raw_rates.append(tokens / (time.perf_counter() - t0))

    def keyed(rep: int) -> None:
        tokens, t0 = 0, time.perf_counter()
        for i, p in enumerate(prompts):
            s = backend.sample(p, temperature=1.0, max_tokens=max_tokens, stop_ids=no_stop, key=rep * 1000 + i,
                               rollout=0)
            tokens += len(s.token_ids)
        keyed_rates.append(tokens / (time.perf_counter() - t0))

    for rep in range(reps):
        for run in ((raw, keyed) if rep % 2 == 0 else (keyed, raw)):
            run(rep)
    ratios = [k / r for k, r in zip(keyed_rates, raw_rates, strict=True)]
    return {"raw_tok_s": statistics.median(raw_rates), "keyed_tok_s": statistics.median(keyed_rates),
            "ratio": statistics.median(ratios), "ratios": ratios, "raw_reps": raw_rates, "keyed_reps": keyed_rates,
            "threads": threads, "vocab": llm.n_vocab()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("qwen05b", "tiny"), default="qwen05b")
    ap.add_argument("--model-dir", type=Path, default=None, help="use this model folder instead of building one")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch
    from scale import build_model

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_dir or build_model(args.model, Path(tmp))
        ver = verifier_cost(folder, args.reps, prompts_n=8, group=8, prompt_len=24, max_tokens=16)
        print(f"verifier: {ver['completions']} completions, {ver['tokens']} tokens, V={ver['vocab']}: recompute "
              f"{ver['plain_s']:.2f} s, with the keyed margins {ver['keyed_s']:.2f} s (paired ×{ver['ratio']:.3f}, "
              f"reps {min(ver['ratios']):.3f}–{max(ver['ratios']):.3f}); worst honest margin "
              f"{ver['worst_honest_margin']:.3g}", flush=True)
        cli = client_cost(folder, args.reps, args.threads, prompts_n=4, prompt_len=24, max_tokens=32)
        print(f"llama.cpp f16 client, {cli['threads']} threads, V={cli['vocab']}: llama.cpp's sampler "
              f"{cli['raw_tok_s']:.1f} tok/s, keyed sampler {cli['keyed_tok_s']:.1f} tok/s "
              f"(paired ×{cli['ratio']:.3f}, reps {min(cli['ratios']):.3f}–{max(cli['ratios']):.3f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "verifier": ver, "client": cli}, indent=2))


if __name__ == "__main__":
    main()
