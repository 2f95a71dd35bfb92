"""Write a corpus of real English text that every machine already has: Python's own docs.

Responsible for producing, offline and deterministically, a JSONL training corpus (one
``{"text": ...}`` object per line) from the docstrings of the Python standard library: one
document per module (its docstring plus those of its public functions) and one per public class
(its docstring plus those of its public methods). Nothing is downloaded; the output depends only
on the Python version that runs it.

Usage::

    python tools/make_corpus.py [--output data/generated/corpus.jsonl] [--max-mb 4]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import sys
import warnings

# Modules whose import has side effects (opens a browser, prints, starts a GUI) or that are
# test suites rather than documentation.
_SKIP_PREFIXES = (
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3",
    "ensurepip", "pydoc_data", "xxlimited", "msilib", "winreg", "winsound", "_",
)
_MIN_DOC_CHARS = 200


def _clean(doc: str | None) -> str:
    return inspect.cleandoc(doc).strip() if doc else ""


def _public_members(obj: object) -> list[tuple[str, object]]:
    names = sorted(n for n in vars(obj) if not n.startswith("_")) if hasattr(obj, "__dict__") else []
    return [(n, vars(obj)[n]) for n in names]


def _module_documents(name: str, module: object) -> list[str]:
    """Documents for one module: the module with its functions, then each class."""
    docs: list[str] = []
    parts = [f"Module {name}\n\n{_clean(module.__doc__)}"]
    for member_name, member in _public_members(module):
        # Only what the module defines itself, so re-exports are not repeated in other modules.
        if getattr(member, "__module__", None) != name:
            continue
        if inspect.isfunction(member) or inspect.isbuiltin(member):
            doc = _clean(member.__doc__)
            if doc:
                parts.append(f"{member_name}\n{doc}")
        elif inspect.isclass(member):
            cls_parts = [f"Class {name}.{member_name}\n\n{_clean(member.__doc__)}"]
            for meth_name, meth in _public_members(member):
                doc = _clean(getattr(meth, "__doc__", None)) if callable(meth) else ""
                # Inherited boilerplate ("Return repr(self).") teaches nothing; keep real text.
                inherited = _clean(getattr(getattr(object, meth_name, None), "__doc__", None))
                if doc and doc != inherited:
                    cls_parts.append(f"{member_name}.{meth_name}\n{doc}")
            text = "\n\n".join(p for p in cls_parts if p.strip())
            if len(text) >= _MIN_DOC_CHARS:
                docs.append(text)
    text = "\n\n".join(parts)
    if len(text) >= _MIN_DOC_CHARS:
        docs.insert(0, text)
    return docs


def collect_documents(max_bytes: int) -> list[str]:
    """Import the standard library modules in name order and gather their documents.

    Args:
        max_bytes: Stop once the documents total this many UTF-8 bytes.

    Returns:
        The documents, in a deterministic order.
    """
    documents: list[str] = []
    total = 0
    for name in _module_names():
        module = _quiet_import(name)
        if module is None:
            continue
        # Silence deprecation warnings that touching some attributes (typing.io) raises.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module_docs = _module_documents(name, module)
        for doc in module_docs:
            size = len(doc.encode("utf-8"))
            if total + size > max_bytes:
                return documents
            documents.append(doc)
            total += size
    return documents


def _skipped(name: str) -> bool:
    return any(
        part == p or part.startswith(p) for part in name.split(".") for p in _SKIP_PREFIXES
    )


def _quiet_import(name: str) -> object | None:
    """Import ``name`` silencing import-time chatter; None if it does not exist here."""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except Exception:  # not built on this platform (winreg, ...): skip rather than fail
        return None


def _module_names() -> list[str]:
    """Standard library modules and their submodules, sorted, minus the skipped ones."""
    names = set()
    for top in sys.stdlib_module_names:
        if _skipped(top):
            continue
        names.add(top)
        module = _quiet_import(top)
        if module is None or not hasattr(module, "__path__"):
            continue
        for info in pkgutil.walk_packages(module.__path__, top + ".", onerror=lambda _: None):
            if not _skipped(info.name):
                names.add(info.name)
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="data/generated/corpus.jsonl", help="JSONL file to write")
    parser.add_argument("--max-mb", type=float, default=4.0, help="stop after this many MB of text")
    args = parser.parse_args(argv)
    if args.max_mb <= 0:
        parser.error(f"--max-mb must be > 0, got {args.max_mb}")
    documents = collect_documents(int(args.max_mb * 1e6))
    if not documents:
        print("make_corpus: no documents found (is this a stripped Python without docstrings?)", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tmp = f"{args.output}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in documents:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    os.replace(tmp, args.output)
    size_mb = os.path.getsize(args.output) / 1e6
    print(f"make_corpus: wrote {len(documents)} documents, {size_mb:.2f} MB to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
