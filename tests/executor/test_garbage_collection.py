"""Garbage collection between iterations: settle before training, Megatron's --manual-gc."""

import argparse
import gc

import pytest

from megatron.resihp import garbage_collection
from megatron.resihp.arguments import parse_args
from tests.cli_args import TINY_CPU_ARGS


def _full_collections(fn) -> int:
    seen = []

    def count(phase, info):
        if phase == "stop" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(count)
    try:
        fn()
    finally:
        gc.callbacks.remove(count)
    return len(seen)


def test_manual_gc_turns_automatic_collection_off_and_collects_at_the_interval():
    args = argparse.Namespace(manual_gc=True, manual_gc_interval=3)
    assert gc.isenabled()
    try:
        assert _full_collections(lambda: garbage_collection.start(args)) == 1  # the settle
        assert not gc.isenabled()
        ran = [_full_collections(lambda i=i: garbage_collection.after_iteration(args, i)) for i in range(1, 8)]
        assert ran == [0, 0, 1, 0, 0, 1, 0]
    finally:
        garbage_collection.finish(args)
    assert gc.isenabled()


def test_without_manual_gc_only_the_settle_collects():
    args = argparse.Namespace(manual_gc=False, manual_gc_interval=1)
    assert _full_collections(lambda: garbage_collection.start(args)) == 1
    assert gc.isenabled()
    assert _full_collections(lambda: garbage_collection.after_iteration(args, 1)) == 0
    garbage_collection.finish(args)
    assert gc.isenabled()


def test_negative_interval_is_refused_with_the_flag_named(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    base = list(TINY_CPU_ARGS)
    assert parse_args(base + ["--manual-gc", "--manual-gc-interval", "10"]).manual_gc_interval == 10
    with pytest.raises(SystemExit) as exit_info:
        parse_args(base + ["--manual-gc", "--manual-gc-interval", "-1"])
    assert exit_info.value.code == 2
    assert "--manual-gc-interval must be >= 0" in capsys.readouterr().err


def test_the_pause_clock_counts_collections_and_their_time_until_stopped():
    clock = garbage_collection.PauseClock()
    try:
        assert clock.read() == (0.0, 0)
        gc.collect()
        gc.collect(0)
        paused_s, full = clock.read()
        assert paused_s > 0 and full == 1
    finally:
        clock.stop()
    gc.collect()
    assert clock.read() == (paused_s, full)
    clock.stop()  # twice is harmless
