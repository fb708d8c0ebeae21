"""Where a client keeps what: its home (identity key, pinned coordinator keys, pause/status files, the control
page's token), its snapshot cache and its log.

With the default home (no ``--home``, no ``home`` key, no $ECHO_SWARM_HOME) each kind goes to the platform's own
folder, so a backup of the config folder does not carry gigabytes of model weights and a cache cleaner may drop
the cache: the home in the user config dir (~/.config/echo-swarm), the cache in the user cache dir
(~/.cache/echo-swarm/snapshots, or $ECHO_SWARM_CACHE/snapshots) and the log in the user log dir
(~/.local/state/echo-swarm/log). A home given explicitly keeps everything of that client together in it
(``cache/``, ``logs/``): how several clients share one machine, and how the tests run.

Earlier versions kept the cache in the home (config dir); :func:`migrate_cache` moves such a cache to the cache
dir once, so nothing is downloaded again.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

APP = "echo-swarm"
SNAPSHOTS = "snapshots"


def default_home() -> Path:
    env = os.environ.get("ECHO_SWARM_HOME")
    if env:
        return Path(env)
    from platformdirs import user_config_dir

    return Path(user_config_dir(APP))


def platform_cache_dir() -> Path:
    env = os.environ.get("ECHO_SWARM_CACHE")  # also where the tiny model is cached (coordinator.engine.tiny_model)
    if env:
        return Path(env) / SNAPSHOTS
    from platformdirs import user_cache_dir

    return Path(user_cache_dir(APP)) / SNAPSHOTS


def platform_log_dir() -> Path:
    from platformdirs import user_log_dir

    return Path(user_log_dir(APP))


@dataclass(frozen=True)
class ClientPaths:
    home: Path
    cache: Path
    logs: Path

    @classmethod
    def of(cls, home: Path, cache_dir: Path | None, log_dir: Path | None) -> ClientPaths:
        """``cache_dir`` / ``log_dir`` None: in the home (``cache/``, ``logs/``)."""
        return cls(home, cache_dir or home / "cache", log_dir or home / "logs")

    @classmethod
    def defaults_for(cls, home: Path | None) -> ClientPaths:
        """What a client started with ``home`` (None: none given; $ECHO_SWARM_HOME counts as given) uses when no
        cache or log folder is set explicitly."""
        if home is None and os.environ.get("ECHO_SWARM_HOME"):
            home = Path(os.environ["ECHO_SWARM_HOME"])
        if home is None:
            return cls(default_home(), platform_cache_dir(), platform_log_dir())
        return cls.of(home, None, None)


def migrate_cache(home: Path, cache: Path) -> Path | None:
    """Move a snapshot cache an earlier version left in ``home/cache`` to ``cache`` (the platform cache dir), once:
    only when the new place is still empty. A rename when both are on one file system, else a copy (hard links
    between a version's files and their blobs are rebuilt as copies: the cache prunes and re-links them).
    Returns the old folder when it moved something."""
    old = home / "cache"
    if old.resolve() == cache.resolve() or not old.is_dir():
        return None
    if cache.exists() and any(cache.iterdir()):
        return None
    cache.parent.mkdir(parents=True, exist_ok=True)
    if cache.exists():
        cache.rmdir()
    try:
        os.rename(old, cache)
    except OSError:
        shutil.copytree(old, cache, symlinks=True)
        shutil.rmtree(old, ignore_errors=True)
    return old
