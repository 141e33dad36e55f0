"""The `pdserve` command reference: every subcommand's usage and flags, read from the argparse parsers."""

from __future__ import annotations

import argparse

from docs_gen.markdown import banner, cell, table
from launcher.cli import build_parser

USAGE_WIDTH = 100  # fixed, so the page does not depend on the terminal it was generated in

INTRO = """# The `pdserve` command

`pdserve` is the console script of the package (`launcher/cli.py`). `--log-level` (or `PDSERVE_LOG_LEVEL`) goes
before the subcommand: `pdserve --log-level info up`. Log lines are `key=value` on stderr.
"""


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the order they were added."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
    return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]


def flag_default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if isinstance(action, argparse._StoreTrueAction) else "on"
    if action.default is None or action.default is argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def flag_help(action: argparse.Action, exclusive: dict[argparse.Action, list[str]]) -> str:
    text = (action.help or "").replace("%%", "%")
    if action.choices is not None:
        text = f"one of {', '.join(f'`{c}`' for c in action.choices)}" + (f"; {text}" if text else "")
    if action in exclusive:
        text += f" (exactly one of {', '.join(exclusive[action])})"
    return cell(text)


def flag_name(action: argparse.Action) -> str:
    name = ", ".join(action.option_strings)
    takes_value = action.nargs != 0
    metavar = action.metavar or (None if action.choices is not None else action.dest.upper())
    return f"`{name} {metavar}`" if takes_value and metavar else f"`{name}`"


def flag_rows(parser: argparse.ArgumentParser) -> list[list[str]]:
    exclusive = {}
    for group in parser._mutually_exclusive_groups:
        names = [a.option_strings[0] for a in group._group_actions]
        exclusive.update({a: names for a in group._group_actions})
    return [[flag_name(a), flag_default(a), flag_help(a, exclusive)]
            for a in parser._actions
            if a.option_strings and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def render() -> str:
    parser = build_parser()
    parts = [banner("launcher/cli.py, launcher/simulated_worker.py and planner/commands.py"), INTRO]
    parts.append(table(["flag", "default", "meaning"], flag_rows(parser)))
    for name, help_text, sub in subcommands(parser):
        parts.append(f"## `pdserve {name}`\n\n{cell(help_text)}.\n\n```\n{usage(sub)}\n```\n")
        parts.append(table(["flag", "default", "meaning"], flag_rows(sub)))
    return "\n".join(parts)
