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
