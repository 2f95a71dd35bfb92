"""Bad input files are refused on Megatron-LM's training loop (no --resihp-* flag) before anything starts.

Each case launches 2 real ranks through the local launcher, as a user would, and checks: exit
code 2, the reason said once (not by every rank), no traceback, and nothing written: no output,
checkpoint, tensorboard or cache folder, and the input folders exactly as they were. A job on the
real files trains and writes nothing beside the data (megatron-core's index caches go to the
default --data-cache-path); its torch-format checkpoint, cut short, is the bad --load case.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.dist.input_files import listing, truncated_copy, write_corpus
from tests.dist.launch import run_job

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

NPROC = 2
# A tiny GPT on Megatron's own flags; 40 documents, so --split 98,2,0 gives validation 1 document.
TINY_MEGATRON = [
    "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--log-interval", "1",
    "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
]
SPLIT = ["--split", "98,2,0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A job on the real files with the default cache folder: (the process, its save folder, the cache home,
    the data folder's listing before it ran)."""
    tmp = tmp_path_factory.mktemp("trained")
    before = listing(corpus.parent)
    proc = run_job(NPROC, [*TINY_MEGATRON, *SPLIT, "--data-path", str(corpus), "--save", str(tmp / "save"),
                           "--ckpt-format", "torch", "--save-interval", "2"],
                   timeout_s=240, env_extra={"XDG_CACHE_HOME": str(tmp / "cache")})
    return proc, tmp / "save", tmp / "cache", before


def test_a_job_on_real_files_writes_nothing_beside_them(corpus, trained):
    proc, save, cache, before = trained
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iteration        2/       2" in proc.stdout
    assert listing(corpus.parent) == before
    assert any((cache / "resihp-megatron" / "data-cache").glob("*.npy")), "the index caches go to the cache folder"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def _truncated_checkpoint(save, folder):
    """A copy of the trained job's torch-format checkpoint with its model file cut in half."""
    shutil.copytree(save, folder, dirs_exist_ok=True)
    (path,) = folder.rglob("model_optim_rng.pt")
    os.truncate(path, path.stat().st_size // 2)
    return folder


CASES = {
    "missing-data-path": lambda tmp, prefix, save: (
        [*SPLIT, "--data-path", str(tmp / "input" / "nothing_here")], "nothing_here.idx not found"),
    "truncated-idx": lambda tmp, prefix, save: (
        [*SPLIT, "--data-path", str(truncated_copy(prefix, tmp / "input", ".idx"))], "data.idx"),
    "truncated-bin": lambda tmp, prefix, save: (
        [*SPLIT, "--data-path", str(truncated_copy(prefix, tmp / "input", ".bin"))], "data.bin"),
    "truncated-checkpoint": lambda tmp, prefix, save: (
        [*SPLIT, "--data-path", str(prefix), "--load", str(_truncated_checkpoint(save, tmp / "input"))],
        "model_optim_rng.pt is not a readable torch.save archive"),
    # The default split 969,30,1 leaves the test split of 40 documents without one.
    "empty-split": lambda tmp, prefix, save: (
        ["--data-path", str(prefix)], "the test split gets none of the 40 documents"),
    "missing-vocab-file": lambda tmp, prefix, save: (
        ["--mock-data", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp / "input" / "vocab.json"),
         "--merge-file", str(tmp / "input" / "merges.txt")], "--vocab-file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_once_before_anything_is_written(tmp_path, corpus, trained, case):
    (tmp_path / "input").mkdir()
    extra, named = CASES[case](tmp_path, corpus, trained[1])
    corpus_before, input_before = listing(corpus.parent), listing(tmp_path / "input")
    save, tensorboard, cache = tmp_path / "save", tmp_path / "tb", tmp_path / "cache"
    args = [*TINY_MEGATRON, "--save", str(save), "--tensorboard-dir", str(tensorboard), *extra]
    proc = run_job(NPROC, args, timeout_s=120, env_extra={"XDG_CACHE_HOME": str(cache)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and named in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not save.exists() and not tensorboard.exists() and not cache.exists()
    assert listing(corpus.parent) == corpus_before and listing(tmp_path / "input") == input_before


@pytest.mark.parametrize("left_out, named", [("--eval-interval", "--eval-interval"),
                                             ("--save-interval", "assert args.save_interval is not None")])
def test_a_resilient_job_runs_megatrons_loop_which_refuses_a_flag_megatron_needs_and_asserts_on(tmp_path, left_out,
                                                                                                 named):
    # Left out, megatron-core 0.19.2 stops every rank with a traceback: it divides by the missing
    # evaluation interval as it sizes its data, and asserts a save interval without a message.
    job = [*TINY_MEGATRON, "--save-interval", "2"]
    args = [a for i, a in enumerate(job) if left_out not in (a, job[i - 1])]
    save = tmp_path / "save"
    proc = run_job(NPROC, [*args, "--mock-data", "--save", str(save), "--resihp-enable"], timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and named in errors[0] and left_out in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout and not save.exists()
