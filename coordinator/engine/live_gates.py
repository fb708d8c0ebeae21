"""The learner's live tensors lent to the publisher: the optimizer update waits until they are written.

Why: a checkpoint (coordinator.engine.learner_checkpoints) and, where the live weights already are what is published,
a version's weights (coordinator.engine.snapshot_export) are handed to the publisher as references, not copies
(2 B/param less at the learner's peak). The next step's forward and backward passes may run meanwhile, as they only
read the weights; its optimizer update (coordinator.engine.policy_step) would change them, so it waits here. The
publisher never waits for the learner, so these waits end (a failed write releases too).
"""

from __future__ import annotations

import threading
import time


class LiveGates:
    """What the next optimizer update waits for: the checkpoint's release (written first), then the version's."""

    def __init__(self) -> None:
        # set while a checkpoint is being written from the live tensors: the next optimizer step waits for it
        self.checkpoint: threading.Event | None = None
        # set while a version's files are being written from the live weights (snapshot_files): the same
        self.publish: threading.Event | None = None

    def lend_for_checkpoint(self) -> threading.Event:
        """A new gate for a checkpoint of the live tensors; the publisher sets it once they are written."""
        gate = threading.Event()
        self.checkpoint = gate
        return gate

    def lend_for_publication(self, written: threading.Event) -> None:
        """The live weights are being written as a version; ``written`` is set once they are."""
        self.publish = written

    def wait(self) -> tuple[float, float]:
        """Before an optimizer update: wait until the publisher has released what it was handed, the checkpoint's
        tensors and the version's weights; seconds waited for each. Nothing is lent afterwards."""
        waited = _wait(self.checkpoint), _wait(self.publish)
        self.checkpoint = self.publish = None
        return waited


def _wait(gate: threading.Event | None) -> float:
    if gate is None or gate.is_set():
        return 0.0
    t0 = time.monotonic()
    gate.wait()
    return time.monotonic() - t0
