"""`--help` lists every --resihp-* flag with its whole help, whatever characters the help holds."""

import dataclasses

import pytest

from megatron.resihp.resihp_flags import add_resihp_args
from resihp_ext.config import ResiHPConfig


def _parser():
    import argparse

    parser = argparse.ArgumentParser(prog="pretrain_gpt_resilient.py")
    add_resihp_args(parser)
    return parser


def test_help_lists_every_resihp_flag():
    text = _parser().format_help()  # argparse %-formats help strings: a bare % used to crash it
    for field in dataclasses.fields(ResiHPConfig):
        assert "--resihp-" + field.name.replace("_", "-") in text
    assert "(0.05 = 5%)" in " ".join(text.split())
    # A help that spans lines in config.py is whole, not cut at its first line.
    assert "all within --resihp-intermittent-window-iters, is slow in bursts" in " ".join(text.split())


@pytest.mark.parametrize("flag, value, says", [
    ("--resihp-persistence-gap-iters", "-1", "must be >= 0"),
    ("--resihp-persistence-iters", "0", "must be >= 1"),
    ("--resihp-max-speed-drift", "0.3", "below --resihp-slowdown-threshold - 1"),
    ("--resihp-verify-margin", "1.5", "must be in [0, 1)"),
    ("--resihp-compile-timeout-s", "0", "must be > 0"),
])
def test_a_bad_resihp_value_exits_2_naming_its_flag(monkeypatch, capsys, flag, value, says):
    from megatron.resihp.gpt_pretrain import resilience_config

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = _parser().parse_args([flag, value])
    with pytest.raises(SystemExit) as exit_info:
        resilience_config(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and says in err, err


def test_the_persistence_gap_reaches_the_config():
    def config(*argv):
        args = _parser().parse_args(list(argv))
        return ResiHPConfig(**{f.name: getattr(args, "resihp_" + f.name) for f in dataclasses.fields(ResiHPConfig)})

    assert config().persistence_gap_iters == 1
    assert config("--resihp-persistence-gap-iters", "0").persistence_gap_iters == 0


def test_the_resilient_script_prints_megatrons_flags_and_the_resihp_flags_on_help():
    # Megatron-LM's own parser: megatron-core 0.19.2 ships a help string with a bare "%", which made
    # --help raise; the --resihp-* flags are listed without any other --resihp-* flag on the line.
    import subprocess
    import sys

    from scripts.child_env import REPO, job_env

    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt_resilient.py"), "--help"], cwd=REPO,
                          env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = " ".join(proc.stdout.split())
    assert "--moe-paged-stash-buffer-size-factor-cuda" in text and "(e.g. 1.10 = 10%)" in text
    for field in dataclasses.fields(ResiHPConfig):
        assert "--resihp-" + field.name.replace("_", "-") in text
