"""Options of a command group accepted after its subcommand.

click reads a group's options only before the subcommand's name, so `echo-swarm admin status --run-dir X` was
refused ("No such option: --run-dir") although it is what people type. :func:`hoist_group_options` moves such an
option (and its value) back to where click expects it — only when the subcommand has no option of that name
itself, so nothing changes meaning.
"""

from __future__ import annotations

from typing import Any

# typer vendors its own click, so commands and parameters are recognised by what they have, not by class


def _options(command: Any) -> dict[str, bool]:
    """Option spelling → whether it takes a value, for ``command``'s own options."""
    out: dict[str, bool] = {}
    for param in getattr(command, "params", ()):
        if getattr(param, "param_type_name", "") == "option":
            for name in (*param.opts, *param.secondary_opts):
                out[name] = not (param.is_flag or param.count)
    return out


def hoist_group_options(group: Any, args: list[str]) -> list[str]:
    """``args`` with every group-level option that follows a subcommand moved right after that group's name."""
    if not isinstance(getattr(group, "commands", None), dict):
        return args
    own = _options(group)
    skip = False
    for i, arg in enumerate(args):
        if skip:  # the value of the group option before it
            skip = False
            continue
        if arg == "--":
            return args
        if arg.startswith("-"):
            name, eq, _ = arg.partition("=")
            skip = own.get(name, False) and not eq
            continue
        sub = group.commands.get(arg)
        if sub is None:
            return args
        head, tail = args[: i + 1], hoist_group_options(sub, args[i + 1:])
        sub_own = _options(sub)
        moved: list[str] = []
        rest: list[str] = []
        j = 0
        while j < len(tail):
            word = tail[j]
            if word == "--":
                rest += tail[j:]
                break
            name, eq, _ = word.partition("=")
            if name in own and name not in sub_own:
                moved.append(word)
                if own[name] and not eq and j + 1 < len(tail):
                    moved.append(tail[j + 1])
                    j += 1
            else:
                rest.append(word)
            j += 1
        return head[:i] + moved + [arg] + rest if moved else head + rest
    return args
