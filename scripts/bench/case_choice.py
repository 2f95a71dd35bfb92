"""The command line that benches of named cases share: which cases to run, and where and how to report.

Responsible for the flags ``--cases TEXT ...`` (run the cases whose name holds one of the texts),
``--list``, ``--json`` and ``--workdir``, and for turning them into the cases to run: a text that
matches no case is refused (exit 2) with every case's name.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def add_case_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cases", nargs="+", metavar="TEXT",
                        help="run only the cases whose name contains one of these texts")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--workdir", help="keep logs here (default: a temporary folder)")


def chosen_cases(parser: argparse.ArgumentParser, args: argparse.Namespace, every: list) -> list:
    """The cases of ``every`` (each with a ``name``) that ``args.cases`` names, all without it; with
    ``--list``, prints every name and returns none. Exits 2 when ``--cases`` matches none."""
    if args.list:
        print("\n".join(c.name for c in every))
        return []
    chosen = [c for c in every if not args.cases or any(t in c.name for t in args.cases)]
    if not chosen:
        parser.error(f"--cases matched none of: {', '.join(c.name for c in every)}")
    return chosen


def work_folder(args: argparse.Namespace, prefix: str) -> Path:
    """``--workdir``, made if missing, or a new temporary folder."""
    work = Path(args.workdir or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return work
