"""What the three command lines (kvctl, kvservice, kvworker) share: --version, help that shows every flag's
default, the documented exit codes, the log flags, and errors that name the flag and the file.

Shell completion: argparse offers none, and none is written by hand here.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvservice import __version__
from kvservice.contract.logs import FORMATS, LEVELS


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help whose every flag ends with its default, when it has one a reader needs (not off, unset or empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "%(default)" in text or default is argparse.SUPPRESS
                or default is None or isinstance(default, bool) or default == [] or action.nargs == 0):
            return text
        shown = "none" if default == "" else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def exit_epilog(exit_codes: dict[int, str]) -> str:
    """The "exit status" section at the end of a --help."""
    return "exit status:\n" + "\n".join(f"  {code:>3}  {what}" for code, what in sorted(exit_codes.items()))


def parser(prog: str, description: str, exit_codes: dict[int, str]) -> argparse.ArgumentParser:
    """An ArgumentParser with --version and the exit codes at the end of --help."""
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter,
                                epilog=exit_epilog(exit_codes))
    add_version(p)
    return p


def add_version(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="print the version and exit")


class _SubParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)


def subparsers(p: argparse.ArgumentParser, **kw: Any) -> argparse._SubParsersAction:
    """Subcommands whose --help uses the same formatter."""
    return p.add_subparsers(parser_class=_SubParser, **kw)


def add_log_args(p: argparse.ArgumentParser, level: str = "INFO") -> None:
    """--log-level and --log-format (kvservice/contract/logs.py)."""
    p.add_argument("--log-level", default=level, type=str.upper, choices=LEVELS, help="least severe level logged")
    p.add_argument("--log-format", default="text", choices=FORMATS,
                   help="text: one line per record for people; json: one JSON object per line (ts, level, logger, "
                        "message; pool, request_id, epoch, ... where known) for log pipelines")


def existing_file(value: str) -> str:
    """An argparse type: a path to an existing file (argparse's error then names the flag: "argument --pools:
    pools.yaml: no such file")."""
    path = Path(value)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{value}: no such file")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value}: a directory, not a file")
    return value


def existing_path(value: str) -> str:
    """An argparse type: a path to an existing file or directory."""
    if not Path(value).exists():
        raise argparse.ArgumentTypeError(f"{value}: no such file or directory")
    return value


def all_actions(p: argparse.ArgumentParser) -> list[tuple[argparse.ArgumentParser, argparse.Action]]:
    """(parser, action) of every option of a parser and of its subcommands' (for the tests of these rules)."""
    out = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                out += all_actions(sp)
        elif action.option_strings:
            out.append((p, action))
    return out
