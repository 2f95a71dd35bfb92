"""Whether a ``--load`` checkpoint is complete and readable, checked before training starts.

Responsible for finding the iteration Megatron's tracker file names and opening every file of that
iteration's folder the way its loader will: a ``.pt`` file is a zip archive (torch.save's format)
whose directory must open and whose members must lie inside the file; ``.json`` files must parse;
any other file must be readable. A missing tracker, a missing folder, an empty folder or a file
that fails is named, with the fix, in a ``ValueError``. It opens each archive's directory only
(a few KiB per file, not the tensors) and never writes.

Both layouts are covered: this project's and Megatron-LM's (``iter_NNNNNNN/mp_rank_TT_PPP/
model_optim_rng.pt``, or ``torch_dist``'s ``*.distcp`` files with their ``.metadata``). A
``torch_dist`` folder's ``.metadata`` must load, and each ``.distcp`` file it lists must reach the
last byte it places there (a ``.distcp`` file is raw bytes: only those ranges show a cut).
"""

from __future__ import annotations

import json
import os
import zipfile

TRACKER = "latest_checkpointed_iteration.txt"
_DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a torch_dist folder
_FIX = "resume from an earlier checkpoint (edit latest_checkpointed_iteration.txt) or drop --load"


def latest_iteration(root: str) -> int | None:
    """The iteration the tracker file under ``root`` names, or None when it has none."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return int(f.read().strip())


def latest_iteration_folder(load_dir: str) -> str | None:
    """The folder the tracker file names, or None when ``load_dir`` holds no checkpoint yet.

    Raises:
        ValueError: the tracker names no iteration, or one whose folder is missing.
    """
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        folder = os.path.join(load_dir, "release")
    elif text.isdigit():
        folder = os.path.join(load_dir, f"iter_{int(text):07d}")
    else:
        raise ValueError(f"--load {load_dir}: {tracker} holds {text!r}, not an iteration number; {_FIX}")
    if not os.path.isdir(folder):
        raise ValueError(f"--load {load_dir}: {tracker} names {os.path.basename(folder)}, which does not exist; {_FIX}")
    return folder


def _check_file(path: str) -> str | None:
    """Why ``path`` cannot be loaded, or None."""
    size = os.path.getsize(path)
    if path.endswith(".pt"):
        if size == 0:
            return "is empty"
        try:
            with zipfile.ZipFile(path) as archive:
                for member in archive.infolist():
                    if member.header_offset + member.compress_size > size:
                        return f"is cut short inside {member.filename}"
        except (zipfile.BadZipFile, OSError) as err:
            return f"is not a readable torch.save archive ({err})"
        return None
    if path.endswith(".json"):
        try:
            with open(path) as f:
                json.load(f)
        except (ValueError, OSError) as err:
            return f"does not parse as JSON ({err})"
        return None
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        return f"cannot be read ({err})"
    return None


def _check_torch_dist(folder: str) -> tuple[str, str] | None:
    """(file, why) for the first file of a ``torch_dist`` checkpoint that cannot be loaded, or None."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(folder).read_metadata()
    except Exception as err:  # an unpickling error can be of any type
        return os.path.join(folder, _DCP_METADATA), f"does not load as a torch_dist index ({type(err).__name__})"
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return path, f"is missing ({_DCP_METADATA} lists it)"
        size = os.path.getsize(path)
        if size < end:
            return path, f"is {size} bytes but {_DCP_METADATA} places data up to byte {end}: it is cut short"
    return None


def check_checkpoint(load_dir: str) -> None:
    """Raise ``ValueError`` naming ``--load`` and the file unless the latest checkpoint is whole.

    A folder without a tracker file is a fresh start (nothing to check), as Megatron treats it.

    Args:
        load_dir: the ``--load`` folder.
    """
    if not os.path.isdir(load_dir):
        raise ValueError(f"--load {load_dir} is not a folder; give the --save folder of an earlier run")
    folder = latest_iteration_folder(load_dir)
    if folder is None:
        return
    files = sorted(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names)
    if not files:
        raise ValueError(f"--load {load_dir}: {folder} is empty; {_FIX}")
    for path in files:
        problem = _check_file(path)
        if problem is None and os.path.basename(path) == _DCP_METADATA:
            path, problem = _check_torch_dist(os.path.dirname(path)) or (path, None)
        if problem is not None:
            raise ValueError(f"--load {load_dir}: {path} {problem}; {_FIX}")
