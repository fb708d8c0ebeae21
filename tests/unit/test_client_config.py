"""The client config file: flags override the file, the file overrides the defaults; errors name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm_client.config import ClientConfigError, build, default_config_path, merge, resolve_home


def flags(**given: object) -> dict[str, object]:
    """All join flags as the CLI passes them: None for every flag not given on the command line."""
    names = ["url", "home", "backend", "device", "threads", "gpu_layers", "max_memory_gb", "min_free_disk_gb",
             "cache_max_gb", "idle_only", "idle_min_percent", "windows", "benchmark", "panel", "name", "max_jobs",
             "exit_when_finished", "max_cpu_percent", "retries", "coordinator_key"]
    return {n: None for n in names} | given


def test_flag_beats_file_beats_default(tmp_path: Path) -> None:
    cfg_file = tmp_path / "client.toml"
    cfg_file.write_text('url = "http://file:8470"\nthreads = 3\nname = "from-file"\nidle-only = true\n'
                        'window = "22:00-07:00"\nmax_memory_gb = 6.5\n')
    cfg = build(flags(threads=2, home=tmp_path / "home"), cfg_file)
    assert cfg.threads == 2  # flag
    assert cfg.name == "from-file" and cfg.url == "http://file:8470" and cfg.idle_only  # file
    assert cfg.windows == ["22:00-07:00"] and cfg.max_memory_gb == 6.5  # file (dash/alias/str→list)
    assert cfg.retries == 5 and cfg.min_free_disk_gb == 1.0 and cfg.benchmark  # defaults
    assert cfg.home == tmp_path / "home"
    # a flag explicitly turning a file's boolean off wins too
    assert build(flags(idle_only=False, home=tmp_path), cfg_file).idle_only is False


def test_default_file_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg_file = tmp_path / "elsewhere.toml"
    cfg_file.write_text('url = "http://env:1"\nhome = "~/echo-home"\n')
    monkeypatch.setenv("ECHO_SWARM_CONFIG", str(cfg_file))
    assert default_config_path() == cfg_file
    cfg = build(flags())
    assert cfg.url == "http://env:1" and cfg.home == Path("~/echo-home").expanduser()


def test_missing_default_file_is_fine_but_missing_explicit_file_is_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ECHO_SWARM_CONFIG", str(tmp_path / "none.toml"))
    assert build(flags(url="http://x:1", home=tmp_path)).url == "http://x:1"
    with pytest.raises(ClientConfigError, match="does not exist"):
        build(flags(url="http://x:1"), tmp_path / "none.toml")
    with pytest.raises(ClientConfigError, match="no coordinator URL"):
        build(flags(home=tmp_path))


@pytest.mark.parametrize(("text", "match"), [
    ("thraeds = 2", "thraeds.*valid keys:.*threads"),
    ("threads = 0", "threads"),
    ('window = ["25:00-07:00"]', "hour above 23"),
    ("max_memory_gb = -1", "max_memory_gb"),
    ("threads = [", "cannot read config file"),
    ('name = "me\\u001b[2J"', "name.*U\\+001B.*printable text only"),  # the coordinator would refuse it anyway
])
def test_bad_values_name_the_key(tmp_path: Path, text: str, match: str) -> None:
    cfg_file = tmp_path / "client.toml"
    cfg_file.write_text('url = "http://x:1"\n' + text + "\n")
    with pytest.raises(ClientConfigError, match=match):
        build(flags(home=tmp_path), cfg_file)


def test_merge_ignores_flags_not_given() -> None:
    assert merge({"a": 1, "w": ["x"]}, {"a": None, "w": [], "b": 2}) == {"a": 1, "w": ["x"], "b": 2}


def test_client_commands_find_the_home_set_in_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg_file = tmp_path / "client.toml"
    monkeypatch.setenv("ECHO_SWARM_CONFIG", str(cfg_file))
    monkeypatch.setenv("ECHO_SWARM_HOME", str(tmp_path / "env-home"))
    assert resolve_home(None) == tmp_path / "env-home"  # no file: the default
    cfg_file.write_text(f'home = "{tmp_path / "file-home"}"\n')
    assert resolve_home(None) == tmp_path / "file-home"
    assert resolve_home(tmp_path / "flag-home") == tmp_path / "flag-home"


def test_p2p_jobs_need_p2p_and_a_coordinator_multiaddr_names_its_peer(tmp_path: Path) -> None:
    none = tmp_path / "none.toml"
    none.write_text("")
    base = flags(url="http://c:1", home=tmp_path)
    with pytest.raises(ClientConfigError, match="add --p2p"):
        build(base | {"p2p_jobs": True}, none)
    peer = "12D3KooWPBEVhrN8TkQWfg5sSJuic6XcVh9gGqRjweaR7bgcuSiS"
    cfg = build(base | {"p2p": True, "p2p_jobs": True, "p2p_coordinator": [f"/ip4/203.0.113.7/tcp/8471/p2p/{peer}"]},
                none)
    assert cfg.p2p_jobs and cfg.p2p_coordinator
    for bad in (["/ip4/203.0.113.7/tcp/8471"], [f"/ip4/1.2.3.4/tcp/1/p2p/{peer}", "/ip4/1.2.3.4/tcp/2/p2p/12D3KooWx"]):
        with pytest.raises(ClientConfigError, match=r"end in /p2p/<its peer id>"):
            build(base | {"p2p": True, "p2p_coordinator": bad}, none)
