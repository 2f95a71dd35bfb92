"""Input files for the tests: a small real corpus, damaged copies of it, a Hugging Face tokenizer
folder made on the spot, and a listing that shows whether a job wrote anything."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.dist.launch import REPO


def preprocess_tool():
    """``tools/preprocess_data.py`` loaded as a module (registered in ``sys.modules``, so its
    worker processes can unpickle its functions), for tests that call it in-process."""
    spec = importlib.util.spec_from_file_location("preprocess_data", REPO / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = module
    spec.loader.exec_module(module)
    return module


def tokenizer_from_flags(*flags: str):
    """The tokenizer megatron-core builds from Megatron's tokenizer flags ``flags``, as training and
    ``tools/preprocess_data.py`` build it."""
    tool = preprocess_tool()
    return tool.build_tokenizer(tool.build_parser().parse_args(["--input", "x", "--output-prefix", "y", *flags]))


def listing(folder: Path) -> list[tuple[str, int]]:
    """Every path under ``folder`` with its size: equal before and after when nothing was written."""
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*"))


def corpus_texts() -> list[str]:
    """The small real corpus's 40 short documents."""
    return [f"Document {i}: " + "a resilient job reads whole files. " * (i % 5 + 1) for i in range(40)]


def write_corpus(folder: Path, tokenizer: tuple[str, ...] = ("--tokenizer-type", "ByteLevelTokenizer"),
                 name: str = "good") -> Path:
    """``corpus_texts`` preprocessed with ``tokenizer`` (Megatron's tokenizer flags; the byte-level
    tokenizer unless named) under ``folder / name``; returns the dataset prefix."""
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus_texts()))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(folder / "corpus.jsonl"),
         "--output-prefix", str(folder / name), *tokenizer, "--append-eod", "--workers", "1"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return folder / f"{name}_text_document"


def truncated_copy(prefix: Path, folder: Path, suffix: str) -> Path:
    """A copy of the dataset ``prefix`` in ``folder`` whose ``suffix`` file (.idx or .bin) lost 7 bytes."""
    for s in (".idx", ".bin"):
        shutil.copy(f"{prefix}{s}", folder / f"data{s}")
    path = folder / f"data{suffix}"
    os.truncate(path, path.stat().st_size - 7)
    return folder / "data"


def hugging_face_tokenizer(folder: Path, texts: list[str], vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on ``texts`` and saved in ``folder`` as Hugging Face saves
    one (``tokenizer.json``, ``tokenizer_config.json``; EOS ``<|endoftext|>``): what
    ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model FOLDER`` reads, with no download.
    Returns the ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts * 20, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(folder)
    return bpe
