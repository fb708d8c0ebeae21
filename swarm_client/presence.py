"""Is this machine on battery, and is someone using it? Read from what each platform exposes, by the client
between jobs (swarm_client.schedule decides what to do with the answers).

On battery:
- Linux: /sys/class/power_supply. On battery when no mains or USB supply is online and a system battery (not a
  mouse's: ``scope`` Device) is discharging.
- macOS: ``pmset -g batt`` ("Now drawing from 'Battery Power'").
- elsewhere, or when neither says: not on battery (a desktop), so work is never blocked by a guess.

Time since the last keyboard or mouse input (for ``--idle-only``):
- macOS: ``ioreg -c IOHIDSystem`` (HIDIdleTime, nanoseconds);
- Linux desktops: GNOME's idle monitor over D-Bus (``gdbus``, X11 and Wayland), else ``xprintidle`` (X11);
- None where nothing answers (a server, a service without a desktop session): the idle test then falls back to
  CPU load, as before.
Every probe is a short subprocess with a timeout; a failure is "unknown", never an error.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

SYSFS_POWER = Path("/sys/class/power_supply")
PROBE_TIMEOUT_S = 2.0
_AC_TYPES = {"Mains", "USB", "USB_C", "USB_PD", "USB_PD_DRP", "Wireless"}


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def linux_on_battery(root: Path = SYSFS_POWER) -> bool | None:
    """True on battery, False on mains, None when ``root`` has no supplies (no such folder: not Linux, a VM)."""
    try:
        supplies = [p for p in root.iterdir() if p.is_dir()]
    except OSError:
        return None
    if not supplies:
        return None
    discharging = False
    for supply in supplies:
        kind = _read(supply / "type")
        if kind in _AC_TYPES and _read(supply / "online") == "1":
            return False
        if kind == "Battery" and _read(supply / "scope") != "Device" and _read(supply / "status") == "Discharging":
            discharging = True
    return discharging


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def parse_pmset(text: str) -> bool | None:
    m = re.search(r"drawing from '([^']+)'", text)
    return None if m is None else m.group(1) == "Battery Power"


def macos_on_battery() -> bool | None:
    out = _run(["pmset", "-g", "batt"])
    return None if out is None else parse_pmset(out)


def on_battery(sysfs: Path = SYSFS_POWER) -> bool:
    """This platform's answer; False when it has none."""
    if sys.platform == "darwin":
        answer = macos_on_battery()
    else:
        answer = linux_on_battery(sysfs)
    return bool(answer)


def parse_ioreg_idle(text: str) -> float | None:
    m = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', text)
    return None if m is None else int(m.group(1)) / 1e9


def parse_mutter_idle(text: str) -> float | None:
    m = re.search(r"uint64\s+(\d+)", text)
    return None if m is None else int(m.group(1)) / 1e3


def parse_xprintidle(text: str) -> float | None:
    text = text.strip()
    return int(text) / 1e3 if text.isdigit() else None


def input_idle_s() -> float | None:
    """Seconds since the last keyboard or mouse input on this machine's desktop, or None where unknown."""
    if sys.platform == "darwin":
        out = _run(["ioreg", "-c", "IOHIDSystem", "-d", "4"])
        return None if out is None else parse_ioreg_idle(out)
    if os.environ.get("DBUS_SESSION_BUS_ADDRESS"):
        out = _run(["gdbus", "call", "--session", "--dest", "org.gnome.Mutter.IdleMonitor", "--object-path",
                    "/org/gnome/Mutter/IdleMonitor/Core", "--method", "org.gnome.Mutter.IdleMonitor.GetIdletime"])
        if out is not None and (idle := parse_mutter_idle(out)) is not None:
            return idle
    if os.environ.get("DISPLAY"):
        out = _run(["xprintidle"])
        if out is not None:
            return parse_xprintidle(out)
    return None
