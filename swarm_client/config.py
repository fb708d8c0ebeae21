"""The volunteer's config file: TOML in the user's config dir, whose values command-line flags override.

Precedence, highest first: a flag given on the command line → the config file → the built-in default.
The file is ``client.toml`` in the user config dir (Linux: ~/.config/echo-swarm/client.toml, macOS:
~/Library/Application Support/echo-swarm/client.toml), or the path in $ECHO_SWARM_CONFIG, or ``--config``.
Keys are the `join` option names with ``_`` or ``-`` (``max_memory_gb = 6``, ``window = ["22:00-07:00"]``);
an unknown key is an error naming the valid ones, so a typo never silently does nothing.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shared.errors import EchoSwarmError
from swarm_client.paths import ClientPaths, default_home
from swarm_client.settings import FLAG_FIELDS as ALIASES  # a flag's name is also a valid key
from swarm_client.settings import JoinConfig

FILE_NAME = "client.toml"


class ClientConfigError(EchoSwarmError):
    """The config file or a flag value is invalid; the message names the key and what to write instead."""


def default_config_path() -> Path:
    env = os.environ.get("ECHO_SWARM_CONFIG")
    if env:
        return Path(env)
    from platformdirs import user_config_dir

    return Path(user_config_dir("echo-swarm")) / FILE_NAME


def load_file(path: Path, *, required: bool) -> dict[str, Any]:
    """Read a config file into join-option names. A missing default file is simply empty."""
    if not path.exists():
        if required:
            raise ClientConfigError(f"config file {path} does not exist")
        return {}
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ClientConfigError(f"cannot read config file {path}: {exc}") from None
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        out[ALIASES.get(name, name)] = value
    if isinstance(out.get("windows"), str):
        out["windows"] = [out["windows"]]
    for key in ("home", "cache_dir", "log_dir"):
        if isinstance(out.get(key), str):
            out[key] = str(Path(out[key]).expanduser())
    return out


def merge(file_values: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """Flags that were given (not None, and not an empty list) override the file's values."""
    given = {k: v for k, v in flags.items() if v is not None and v != []}
    return file_values | given


def build(flags: dict[str, Any], config_path: Path | None = None) -> Any:
    """Flags (None = not given) + config file → a validated JoinConfig, or ClientConfigError. Without a home (flag,
    key or $ECHO_SWARM_HOME) the cache and the log go to the platform's folders (swarm_client.paths)."""
    path = config_path or default_config_path()
    values = merge(load_file(path, required=config_path is not None), flags)
    if not values.get("url"):
        raise ClientConfigError("no coordinator URL: run `echo-swarm join URL`, or put url = \"http://...\" in "
                                f"{path}")
    home = values.get("home")
    paths = ClientPaths.defaults_for(Path(home) if isinstance(home, str | Path) else None)
    values["home"] = paths.home
    values.setdefault("cache_dir", paths.cache)
    values.setdefault("log_dir", paths.logs)
    try:
        return JoinConfig.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors())
        if any(e["type"] == "extra_forbidden" for e in exc.errors()):
            problems += f" (valid keys: {', '.join(sorted(set(JoinConfig.model_fields) | set(ALIASES)))})"
        raise ClientConfigError(f"invalid client settings (from flags or {path}): {problems}") from None


def client_paths(home_flag: Path | None, config_path: Path | None = None) -> Any:
    """The folders a client started with these options uses (for `echo-swarm env` and `client` commands)."""
    values = load_file(config_path or default_config_path(), required=config_path is not None)
    home = home_flag if home_flag is not None else values.get("home")
    paths = ClientPaths.defaults_for(Path(home) if isinstance(home, str | Path) else None)
    return ClientPaths.of(paths.home, Path(values["cache_dir"]) if isinstance(values.get("cache_dir"), str)
                          else paths.cache, Path(values["log_dir"]) if isinstance(values.get("log_dir"), str)
                          else paths.logs)


def resolve_home(flag: Path | None, config_path: Path | None = None) -> Path:
    """The client home as `join` would pick it (flag → config file's ``home`` → default), so that
    `echo-swarm client pause` finds a client whose home was set only in the config file."""
    if flag is not None:
        return flag
    home = load_file(config_path or default_config_path(), required=config_path is not None).get("home")
    return Path(home) if isinstance(home, str) else default_home()
