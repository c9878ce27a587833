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

from shared.errors import ShardsinkError

#: Modules with a ``register(subparsers) -> None`` function.
_MODULES: tuple[str, ...] = (
    "shardsink.cli.stack",
    "shardsink.cli.produce",
    "shardsink.cli.catalog",
    "shardsink.cli.data",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args) or 0)
    except ShardsinkError as e:
        from shared.errors import CommandError

        # A controller's typed answer prints its kind (IdentifierMissing, ReadBeforeSince...).
        name = str(getattr(e, "kind", "")) if isinstance(e, CommandError) else type(e).__name__
        print(f"error: {name or type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def print_json(obj: object) -> None:
    print(json.dumps(obj, sort_keys=True, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
