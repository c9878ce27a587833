"""The ``shardsink`` command line.

Each area contributes its subcommands through a ``register(subparsers)`` function in its own
module (listed in ``_MODULES``), so that the CLI grows without one file owning everything.
Errors print one clear line and exit non-zero.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from shared.errors import ShardsinkError

#: Modules with a ``register(subparsers) -> None`` function.
_MODULES: tuple[str, ...] = (
    "shardsink.cli.stack",
    "shardsink.cli.produce",
    "shardsink.cli.catalog",
    "shardsink.cli.data",
)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: InvalidUsageError: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardsink",
        description="Keep a changing collection as versioned, self-correcting shards on S3.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, one line already printed)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        from shardsink.cli.util import quiet_logging

        quiet_logging()
        return int(func(args) or 0)
    except ShardsinkError as e:
        from shared.errors import kind_of

        # One vocabulary (shared.errors.ERROR_KINDS): a controller's answer and the same
        # failure found by the CLI itself print the same kind.
        print(f"error: {kind_of(e)}: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        where = f" {e.filename!r}" if e.filename else ""
        print(f"error: InvalidUsageError: expected to use{where}, found {(e.strerror or str(e)).lower()}",
              file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: InvalidUsageError: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def print_json(obj: object) -> None:
    print(json.dumps(obj, sort_keys=True, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
