"""A --load checkpoint is checked file by file before training: what is refused, and what is not."""

import json
import os
import zipfile

import pytest

from megatron.resihp.checkpoint_files import check_checkpoint


def _checkpoint(root, iteration=4):
    shard = root / f"iter_{iteration:07d}" / "mp_rank_00_000"
    shard.mkdir(parents=True)
    # torch.save writes a zip archive; members hold the pickled tree and the tensors' bytes.
    with zipfile.ZipFile(shard / "model_optim_rng.pt", "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00." * 50)
        archive.writestr("archive/data/0", os.urandom(4096))
    (root / f"iter_{iteration:07d}" / "metadata.json").write_text(json.dumps({"iteration": iteration}))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return shard / "model_optim_rng.pt"


def test_a_whole_checkpoint_and_a_fresh_folder_pass(tmp_path):
    _checkpoint(tmp_path / "ckpt")
    check_checkpoint(str(tmp_path / "ckpt"))
    (tmp_path / "fresh").mkdir()
    check_checkpoint(str(tmp_path / "fresh"))


@pytest.mark.parametrize("cut", [1, 100, 3000])
def test_a_truncated_archive_is_named(tmp_path, cut):
    path = _checkpoint(tmp_path)
    os.truncate(path, path.stat().st_size - cut)
    with pytest.raises(ValueError, match=r"--load .*mp_rank_00_000/model_optim_rng\.pt"):
        check_checkpoint(str(tmp_path))


def test_a_tracker_naming_a_missing_iteration_or_no_number_is_refused(tmp_path):
    _checkpoint(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("9")
    with pytest.raises(ValueError, match="iter_0000009, which does not exist"):
        check_checkpoint(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("nine")
    with pytest.raises(ValueError, match="not an iteration number"):
        check_checkpoint(str(tmp_path))


def test_broken_metadata_and_a_missing_folder_are_refused(tmp_path):
    _checkpoint(tmp_path)
    (tmp_path / "iter_0000004" / "metadata.json").write_text("{\"iteration\": ")
    with pytest.raises(ValueError, match="metadata.json does not parse"):
        check_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="is not a folder"):
        check_checkpoint(str(tmp_path / "nowhere"))


def _torch_dist_checkpoint(root, iteration=3):
    """A torch.distributed.checkpoint folder as Megatron's torch_dist format writes it (one process)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    folder = root / f"iter_{iteration:07d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.randn(64, 64), "b": torch.zeros(3)}, checkpoint_id=str(folder))
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return folder


def test_a_torch_dist_checkpoint_cut_short_or_with_a_broken_index_is_named(tmp_path):
    folder = _torch_dist_checkpoint(tmp_path)
    check_checkpoint(str(tmp_path))
    (data,) = folder.glob("*.distcp")
    os.truncate(data, data.stat().st_size - 1)
    with pytest.raises(ValueError, match=rf"{data.name} is {data.stat().st_size} bytes but .metadata places data "
                                         rf"up to byte {data.stat().st_size + 1}: it is cut short"):
        check_checkpoint(str(tmp_path))
    data.unlink()
    with pytest.raises(ValueError, match=rf"{data.name} is missing \(.metadata lists it\)"):
        check_checkpoint(str(tmp_path))
    index = _torch_dist_checkpoint(tmp_path / "other") / ".metadata"
    os.truncate(index, index.stat().st_size // 2)
    with pytest.raises(ValueError, match=r"\.metadata does not load as a torch_dist index"):
        check_checkpoint(str(tmp_path / "other"))
