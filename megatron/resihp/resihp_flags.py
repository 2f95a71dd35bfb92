"""The ``--resihp-*`` flags, for Megatron-LM's ``extra_args_provider``.

Responsible for generating one argparse flag per ``ResiHPConfig`` field (field ``foo_bar`` becomes
``--resihp-foo-bar``, dest ``resihp_foo_bar``, its help the first paragraph of the field's
docstring), so the dataclass stays the one description of what resilience can be asked for.
Values are checked by ``ResiHPConfig`` itself.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import typing

from resihp_ext.config import ResiHPConfig


def _field_help(cls: type) -> dict[str, str]:
    """The first paragraph of the docstring under each dataclass field (attribute docstrings), on one line."""
    tree = ast.parse(inspect.getsource(cls)).body[0]
    docs, previous = {}, None
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            previous = node.target.id
        elif previous and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[previous] = " ".join(str(node.value.value).strip().split("\n\n")[0].split())
            previous = None
    return docs


def add_resihp_args(parser: argparse.ArgumentParser) -> None:
    """The ``--resihp-*`` group, one flag per ``ResiHPConfig`` field (dest ``resihp_<field>``)."""
    g = parser.add_argument_group("resihp", "resilience: detection, planning, in-place adaptation")
    helps = _field_help(ResiHPConfig)
    hints = typing.get_type_hints(ResiHPConfig)
    for f in dataclasses.fields(ResiHPConfig):
        flag = "--resihp-" + f.name.replace("_", "-")
        kind = hints[f.name]
        dest = "resihp_" + f.name
        help_text = helps.get(f.name, "").replace("%", "%%")  # argparse %-formats help strings
        if kind is bool:
            g.add_argument(flag, dest=dest, action="store_true", help=help_text)
        elif typing.get_origin(kind) is list:
            g.add_argument(flag, dest=dest, action="append", default=[], help=help_text + " (repeatable)")
        else:
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            default = f.default if f.default is not dataclasses.MISSING else None
            g.add_argument(flag, dest=dest, type=base, default=default, help=f"{help_text} (default {default})")
