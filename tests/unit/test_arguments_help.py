"""`--help` lists every --resihp-* flag with its help line, whatever characters the help holds."""

import dataclasses

from megatron.training.arguments import build_parser
from resihp_ext.config import ResiHPConfig


def test_help_lists_every_resihp_flag():
    text = build_parser().format_help()  # argparse %-formats help strings: a bare % used to crash it
    for field in dataclasses.fields(ResiHPConfig):
        assert "--resihp-" + field.name.replace("_", "-") in text
    assert "(0.05 = 5%)" in " ".join(text.split())
