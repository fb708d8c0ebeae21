"""What each GGUF precision costs a llama.cpp volunteer: file bytes per parameter, the client's memory once loaded,
its decode speed (and the raw llama.cpp loop's beside it), how long the coordinator takes to make the file and to
recompute a result on it — measured on one model, projected to 7 B.

    PYTHONPATH=. nice -n 5 python bench/gguf_precisions.py [--model qwen0.5b | --model-dir DIR]
        [--precisions f16,q8_0,q6_K,q5_K_M,q4_K_M,q4_0] [--threads 2] [--tokens 64] [--json out.json]

``--model qwen0.5b`` builds Qwen2.5-0.5B's shape with random weights (hidden 896, 24 layers, vocabulary 151,936;
494 M parameters; ~25 s), saved in float32. Each precision is written the coordinator's way
(coordinator.publish.gguf_export: f16 by our writer, the rest by llama.cpp's quantiser from it) and loaded the
client's way (swarm_client.backends.llama_backend.LlamaBackend, n_ctx 2048 as `join` uses, f16 KV cache). Memory
is the peak resident set (VmHWM) of a fresh process that loads the file and decodes ``--tokens`` tokens with the
keyed sampler (each precision in its own process, so nothing of an earlier one is counted). Speeds need a quiet
machine: run it alone. The 7 B column scales the measured
bytes per parameter to Qwen2.5-7B's 7.62 B parameters and adds the measured non-weight memory unchanged (an
underestimate: a 7 B model's KV cache and compute buffers are larger).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARAMS_7B = 7.62e9
PROBE = r"""
import json, sys, time
from pathlib import Path
from swarm_client.backends.llama_backend import LlamaBackend
folder, threads, tokens = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
b = LlamaBackend(device="cpu", threads=threads)
t0 = time.monotonic(); b.load(folder); load_s = time.monotonic() - t0
prompt = list(range(3, 35))
b.sample(prompt, temperature=1.0, max_tokens=4, stop_ids=frozenset({-1}), key=1, rollout=0)  # warm
t0 = time.monotonic(); samples = []
for r in range(4):  # one group: the first rollout prefills the prompt, the others reuse its cache (as a job's)
    samples.append(b.sample(prompt, temperature=1.0, max_tokens=tokens, stop_ids=frozenset({-1}), key=2, rollout=r,
                            fresh=r == 0).token_ids)
ours = sum(map(len, samples)) / (time.monotonic() - t0)
# VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's peak at fork (the bench holds a float32 model)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
# raw llama.cpp: the library's own sampler and generation loop on the same model, prompt and lengths
llm, m = b.llm, 0
t0 = time.monotonic()
for r in range(4):
    for i, _ in enumerate(llm.generate(prompt, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, reset=True)):
        m += 1
        if i + 1 >= tokens:
            break
raw = m / (time.monotonic() - t0)
# the verifier's llama.cpp recompute of that group (coordinator.engine.llama_verifier: replaying its evaluations)
from coordinator.engine.llama_verifier import LlamaRecompute
rec = LlamaRecompute(lambda v: folder, temperature=1.0, threads=threads)
rec.recompute_stats(0, [prompt], samples[:1], None)  # loads the file: timed apart (load_s), once per version
t0 = time.monotonic(); rec.recompute_stats(0, [prompt] * 4, samples, None, group=4); verify_s = time.monotonic() - t0
print(json.dumps({"load_s": load_s, "tokens_per_s": ours, "raw_tokens_per_s": raw, "peak_rss": hwm * 1024,
                  "verify_s": verify_s, "samples": samples, "prompt": prompt}))
"""


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
            probe = subprocess.run([sys.executable, "-c", PROBE, str(folder), str(args.threads), str(args.tokens)],
                                   capture_output=True, text=True, check=True)
            measured = json.loads(probe.stdout.strip().splitlines()[-1])
            rss = measured["peak_rss"]
            row = {"precision": precision, "bytes": size, "bytes_per_param": size / params, "made_s": made_s,
                   "client_peak_rss": rss, "tokens_per_s": measured["tokens_per_s"], "load_s": measured["load_s"],
                   "raw_tokens_per_s": measured["raw_tokens_per_s"], "llama_verify_s": measured["verify_s"],
                   "torch_verify_s": torch_verify_s(model_dir, measured["prompt"], measured["samples"], args.threads),
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
    if args.json:
        args.json.write_text(json.dumps({"params": params, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
