"""Bad input files and injections are refused by a launched job before it does anything.

Each case launches 4 real ranks through the local launcher, as a user would, and checks: exit
code 2, the reason said once (not by every rank), no traceback, and nothing written: no output
folder, no event log, and the input folder exactly as it was (megatron-core would otherwise build
its index cache inside the data folder).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.dist.input_files import listing, truncated_copy, write_corpus
from tests.dist.launch import TINY_GPT, run_job

NPROC = 4
# The tiny model on real files, with the byte-level tokenizer the corpus is written with.
_MOCK = ("--mock-data", "--tokenizer-type", "--vocab-size")
DATA_ARGS = [a for i, a in enumerate(TINY_GPT) if a not in _MOCK and TINY_GPT[i - 1] not in ("--tokenizer-type", "--vocab-size")]
DATA_ARGS += ["--tokenizer-type", "ByteLevelTokenizer"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _checkpoint_with_a_truncated_file(folder):
    import torch

    shard = folder / "iter_0000002" / "mp_rank_00_000"
    shard.mkdir(parents=True)
    torch.save({"iteration": 2, "model": {"w": torch.zeros(64, 64)}}, shard / "model_optim_rng.pt")
    (folder / "iter_0000002" / "metadata.json").write_text(json.dumps({"iteration": 2}))
    (folder / "latest_checkpointed_iteration.txt").write_text("2")
    path = shard / "model_optim_rng.pt"
    os.truncate(path, path.stat().st_size // 2)


CASES = {
    "missing-data-path": lambda tmp, prefix: (["--data-path", str(tmp / "input" / "nothing_here")], "--data-path"),
    "truncated-idx": lambda tmp, prefix: (["--data-path", str(truncated_copy(prefix, tmp / "input", ".idx"))],
                                          "data.idx"),
    "truncated-bin": lambda tmp, prefix: (["--data-path", str(truncated_copy(prefix, tmp / "input", ".bin"))],
                                          "data.bin"),
    "truncated-checkpoint": lambda tmp, prefix: (
        ["--data-path", str(prefix), "--load", str(tmp / "input")], "model_optim_rng.pt"),
    "injection-rank-outside-the-world": lambda tmp, prefix: (
        ["--data-path", str(prefix), "--resihp-inject", "kill:rank=99,at=2"], "rank 99"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_once_before_anything_is_written(tmp_path, corpus, case):
    (tmp_path / "input").mkdir()
    if case == "truncated-checkpoint":
        _checkpoint_with_a_truncated_file(tmp_path / "input")
    extra, named = CASES[case](tmp_path, corpus)
    corpus_before, input_before = listing(corpus.parent), listing(tmp_path / "input")
    log, save = tmp_path / "events.jsonl", tmp_path / "save"
    proc = run_job(NPROC, [*DATA_ARGS, "--train-iters", "2", "--save", str(save), "--resihp-event-log", str(log),
                           *extra], timeout_s=240, env_extra={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and named in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not log.exists() and not save.exists()
    assert listing(corpus.parent) == corpus_before and listing(tmp_path / "input") == input_before


def test_a_job_on_real_files_writes_nothing_beside_them(tmp_path, corpus):
    before = listing(corpus.parent)
    cache = tmp_path / "cache"
    # All 40 documents train: the default split would leave the validation split of so small a
    # corpus without a document, where megatron-core's index building never ends.
    proc = run_job(NPROC, [*DATA_ARGS, "--pipeline-model-parallel-size", "2", "--train-iters", "2", "--split", "100,0,0",
                           "--data-path", str(corpus), "--resihp-event-log", str(tmp_path / "events.jsonl")],
                   timeout_s=240, env_extra={"XDG_CACHE_HOME": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert listing(corpus.parent) == before
    assert any(cache.rglob("*.npy")), "the index caches go to the cache folder"
