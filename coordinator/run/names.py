"""The roles' names: how each role process is called in the store's role status, its lock file, its doorbell
socket and its log lines. One place, so that the role that writes a name and the ones that read it agree.
"""

from __future__ import annotations

API = "api"
LEARNER = "learner"
P2P = "p2p"
VERIFIER_PREFIX = "verifier-"
#: The roles ``echo-swarm coordinator --role`` starts.
ROLES = (API, LEARNER, "verifier", P2P)
#: The client id the co-located learner (sync_mode "colocated") generates its own rollouts under.
LOCAL_CLIENT = "0" * 32


def verifier_name(index: int) -> str:
    """Verifier worker ``index``'s name: "verifier-0", "verifier-1", …"""
    return f"{VERIFIER_PREFIX}{index}"


def api_name(index: int) -> str:
    """The API process's name: "api", or "api-N" for the N-th extra API process on a shared PostgreSQL store."""
    return f"{API}-{index}" if index else API
