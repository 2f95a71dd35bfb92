"""Packed documents on Megatron-LM's loop: real processes, variable-length mock documents
(``--mock-doc-lengths``) and attention within each document (``--reset-attention-mask``).

A pipeline stage that attended across documents would compute another function than a job whose
layers all sit on one stage. So a checkpoint saved by a one-stage run is trained on by a one-stage
and a three-stage run: both log the same losses only if the middle stage also keeps attention
within each document (it has no batch in stock Megatron; dropping its documents' bounds moves
the loss by ~4e-4 relative). The same with each micro-batch flattened to one sequence
(``--packed-seq-layout thd``), which the stages then exchange.
"""

from __future__ import annotations

import pytest

from tests.dist.launch import check, run_job
from tests.dist.megatron_jobs import job_args, logged_losses, replaced

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

PACKED = ["--mock-doc-lengths", "lognormal:median=12,sigma=1.0,min=2,max=64", "--reset-attention-mask",
          "--reset-position-ids", "--eod-mask-loss"]


def _args(tmp, name: str, stages: int, *extra: str) -> list[str]:
    return [*replaced(job_args(tmp, name), {
        "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": str(stages), "--num-layers": "3",
        "--global-batch-size": "4", "--train-iters": "3", "--ckpt-format": "torch_dist", "--save-interval": "1",
    }), *PACKED, *extra]


# thd: each micro-batch of 2 samples flattened to one sequence; the stages then send each other
# [2 s, 1, h], which Megatron's schedules are given in place of [s, 2, h] (``packed_documents.install``).
LAYOUTS = {"sbhd": [], "thd": ["--packed-seq-layout", "thd", "--micro-batch-size", "2"]}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_middle_pipeline_stage_attends_within_each_packed_document(tmp_path, layout):
    check(run_job(1, _args(tmp_path, "saved", 1, *LAYOUTS[layout]), timeout_s=300))
    (tmp_path / "saved" / "latest_checkpointed_iteration.txt").write_text("1")
    runs = {}
    for stages in (1, 3):
        proc = run_job(stages, _args(tmp_path, f"pp{stages}", stages, *LAYOUTS[layout], "--load", str(tmp_path / "saved")),
                       timeout_s=300)
        check(proc)
        runs[stages] = logged_losses(proc.stdout)
    assert sorted(runs[1]) == [2, 3], runs
    assert [runs[3][i] for i in (2, 3)] == pytest.approx([runs[1][i] for i in (2, 3)], rel=1e-6)


@pytest.mark.parametrize("extra, named", [
    (["--mock-doc-lengths", "fixed:length=8"], "--mock-doc-lengths only applies with --mock-data"),
    (["--mock-data", "--mock-doc-lengths", "gamma:k=1"], "--mock-doc-lengths"),
    (["--mock-data", "--packed-seq-layout", "thd"], "--packed-seq-layout thd needs --reset-attention-mask"),
])
def test_packed_document_flags_it_cannot_run_exit_2_naming_the_flag(tmp_path, extra, named):
    args = [a for a in job_args(tmp_path, "ckpt") if a != "--mock-data"]
    args = replaced(args, {"--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1"}) + extra
    proc = run_job(1, args, timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert named in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr[-3000:]
    assert not (tmp_path / "ckpt").exists()
