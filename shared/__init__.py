"""What the coordinator and the volunteer client both speak: wire messages, signatures, hashing, manifests.

Nothing in this package imports torch or transformers at module import time, so that a third-party client
or a status tool can use it without the learner's dependencies.
"""

PROTOCOL_VERSION = 6
"""Bumped on any incompatible change to a message or endpoint; both sides refuse a mismatch."""
