"""coordinator.memory: with the mmap threshold fixed, blocks above it go back to the system when freed, and
``release_free_heap`` returns the free pages that holes between live small blocks leave in an arena — the pages a
publisher thread left resident under the learner's next step. Run in a fresh interpreter, so malloc's state is
this test's alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import ctypes, json, threading
from coordinator.memory import release_free_heap, return_freed_memory

def rss():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024

assert return_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
out = {}

def work():
    size = 64 * 1024  # below the 1 MiB threshold: from this thread's arena
    blocks = []
    for _ in range(4000):
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)  # touched: resident
        blocks.append(p)
    before = rss()
    for p in blocks[::2]:  # every other block: holes between live blocks, which free() cannot give back
        libc.free(p)
    out["after_free"] = before - rss()
    out["released"] = release_free_heap()
    out["after_trim"] = before - rss()
    out["freed"] = size * 2000
    for p in blocks[1::2]:
        libc.free(p)

t = threading.Thread(target=work)
t.start()
t.join()
print(json.dumps(out))
"""


def test_free_pages_between_live_blocks_go_back_only_when_trimmed() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["released"] is True
    assert out["after_free"] < 0.2 * out["freed"]  # free() alone kept the holes resident
    assert out["after_trim"] > 0.8 * out["freed"]  # malloc_trim gave their pages back
