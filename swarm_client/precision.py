"""Which GGUF precision a llama.cpp client runs: the best one the run offers that fits this machine.

A run may publish every version in several precisions (the coordinator's snapshots.gguf and snapshots.gguf_also),
each file's precision stated in the signed manifest. The volunteer says `--precision auto` (the default) or names
one. The choice is made from the manifest alone, before anything is downloaded, with the same memory estimate the
download's pre-check uses (swarm_client.footprint), and the client names it in every lease: the coordinator then
recomputes its results on that very file, so a smaller precision is checked exactly as tightly as a larger one —
it only costs the policy some fidelity, which the learner corrects for (π_b is the file's own).
"""

from __future__ import annotations

from collections.abc import Callable

from shared.messages import Manifest
from swarm_client.resources import ResourceRefusal

#: Best first: the order `auto` tries the offered precisions in.
QUALITY = ("f32", "f16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_0")


def offered_precisions(manifest: Manifest) -> dict[str, int]:
    """The whole-model GGUF precisions a version is published in, with each file's size (best first); empty for
    a run that publishes no GGUF, or a coordinator whose manifests state no precision."""
    sizes = {f.precision: f.size for f in manifest.files if f.form == "gguf" and f.precision is not None}
    return {p: sizes[p] for p in sorted(sizes, key=lambda p: QUALITY.index(p) if p in QUALITY else len(QUALITY))}


def choose_precision(offered: dict[str, int], asked: str, fits: Callable[[int], bool]) -> str | None:
    """The precision to lease in: ``asked`` when it is not "auto" (refused in one line when the run does not offer
    it), else the best offered one whose file of that size ``fits`` this machine, else the smallest (whose
    download pre-check then says in numbers why it does not fit). None: the run states no precisions (lease
    with the run's default)."""
    if asked != "auto":
        if offered and asked not in offered:
            raise ResourceRefusal(f"this run publishes GGUF at {', '.join(offered)}, not {asked}: join with "
                                  f"--precision auto (the best that fits this machine) or one of those")
        return asked if offered else None
    if not offered:
        return None
    for precision, size in offered.items():
        if fits(size):
            return precision
    return min(offered, key=lambda p: offered[p])
