"""What resilience on Megatron-LM's loop cannot carry yet is named, one reason per flag, before a job starts."""

import argparse

import pytest

from megatron.resihp.megatron_loop_support import unsupported_flags
from resihp_ext.config import ResiHPConfig


def megatron_args(**changes) -> argparse.Namespace:
    """Megatron's defaults for the flags the check reads."""
    args = argparse.Namespace(use_distributed_optimizer=False, virtual_pipeline_model_parallel_size=None,
                              context_parallel_size=1, expert_model_parallel_size=1, use_megatron_fsdp=False,
                              use_torch_fsdp2=False, dataloader_type="single", num_layers=4,
                              pipeline_model_parallel_size=2, tensor_model_parallel_size=1, save=None,
                              ckpt_format="torch_dist")
    vars(args).update({k: v for k, v in changes.items() if k != "resihp"})
    return args


def test_a_plain_job_with_kills_hangs_and_recovery_phase_kills_may_run():
    cfg = ResiHPConfig(enable=True, inject=["kill:rank=1,at=2", "hang:rank=2,at=3", "kill:rank=3,at=4,during=reform",
                                            "kill:rank=4,at=4,during=rendezvous", "kill:rank=5,at=8,during=shutdown",
                                            "raise:rank=6,at=2,during=backward", "kill:rank=7,at=1,during=setup",
                                            "kill:rank=2,at=5,during=exit-check", "kill:rank=3,at=6,during=readmission",
                                            "kill:rank=0,at=4,during=save-tracker"])
    assert unsupported_flags(megatron_args(), cfg) == []
    # Each rank's part of Adam's state is copied on another rank, so its failures are survived too.
    assert unsupported_flags(megatron_args(use_distributed_optimizer=True), cfg) == []
    between = ResiHPConfig(enable=True, inject=["kill:rank=1,at=3,during=update"])
    assert unsupported_flags(megatron_args(use_distributed_optimizer=True), between) == []


@pytest.mark.parametrize("cfg", [
    ResiHPConfig(detect_only=True),
    ResiHPConfig(enable=True, trace="t.jsonl", verify_iters=5, verify_margin=0.1),
    ResiHPConfig(enable=True, inject=["slow:rank=1,factor=2,at=3", "slow:rank=2,factor=3,at=4,until=9",
                                      "slow:rank=3,factor=2,at=2,on=2,off=3", "misjudge:rank=1,factor=4,at=3",
                                      "link:src=0,dst=4,factor=9,at=3"]),
], ids=["detect-only", "trace-and-trial", "slowdowns"])
def test_fail_slow_detection_its_trial_and_slowdown_injections_may_run(cfg):
    assert unsupported_flags(megatron_args(), cfg) == []
    assert unsupported_flags(megatron_args(use_distributed_optimizer=True), cfg) == []


@pytest.mark.parametrize("changes, named", [
    ({"context_parallel_size": 2}, "--context-parallel-size"),
    ({"expert_model_parallel_size": 4}, "--expert-model-parallel-size"),
    ({"use_torch_fsdp2": True}, "--use-torch-fsdp2"),
    ({"dataloader_type": "cyclic"}, "--dataloader-type cyclic"),
    ({"use_tp_pp_dp_mapping": True}, "--use-tp-pp-dp-mapping"),
    ({"use_distributed_optimizer": True, "optimizer": "sgd"}, "--optimizer sgd with --use-distributed-optimizer"),
    ({"use_distributed_optimizer": True, "use_precision_aware_optimizer": True}, "--use-precision-aware-optimizer"),
    ({"resihp": ResiHPConfig(enable=True, inject=["kill:rank=1,at=3,during=update"])}, "pass --use-distributed-optimizer"),
    ({"resihp": ResiHPConfig(enable=True, inject=["kill:rank=1,at=3,during=save-rename"])}, "during=save-rename"),
    ({"resihp": ResiHPConfig(enable=True, inject=["kill:rank=1,at=3,during=save-tracker"])}, "use rank=0"),
    ({"check_weight_hash_across_dp_replicas_interval": 10}, "--check-weight-hash-across-dp-replicas-interval"),
    ({"log_straggler": True}, "--log-straggler"),
    ({"async_save": True, "async_strategy": "nvrx"}, "--async-strategy nvrx"),
    ({"resihp": ResiHPConfig(enable=True, inject=["kill:rank=1,at=3,during=finalize"])}, "pass --async-save"),
    ({"resihp": ResiHPConfig(enable=True, inject=["stall:rank=1,at=3,seconds=30"])}, "pass --save DIR"),
    ({"resihp": ResiHPConfig(enable=True, inject=["slow:rank=1,factor=2,at=1,during=replan"]),
      "pipeline_model_parallel_size": 1}, "a re-plan that moves layers"),
    ({"resihp": ResiHPConfig(enable=True, device_memory_gb=40.0), "pipeline_model_parallel_size": 1},
     "--resihp-device-memory-gb"),
])
def test_each_feature_not_carried_yet_is_named(changes, named):
    found = unsupported_flags(megatron_args(**changes), changes.get("resihp", ResiHPConfig(enable=True)))
    assert len(found) == 1 and named in found[0], found


def test_device_memory_sizes_the_plans_of_a_job_whose_layers_move_or_whose_tp_degree_may_shrink():
    # It bounds the layers a fail-slow re-plan may put on a stage, the degree a stage group that lost
    # ranks goes on at, and under the distributed optimizer the replicas that may go on: accepted
    # where any may happen, refused with the reasons where none.
    sized = ResiHPConfig(enable=True, device_memory_gb=40.0)
    assert unsupported_flags(megatron_args(tensor_model_parallel_size=2), sized) == []
    assert unsupported_flags(megatron_args(tensor_model_parallel_size=2, save="ckpt"), sized) == []
    # Under the interleaved schedule too: a shrunk replica's model chunks are rebuilt at its degree.
    assert unsupported_flags(megatron_args(tensor_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
                             sized) == []
    # Under the distributed optimizer it bounds the degree every replica may go on at, where a save
    # lays the optimizer's state out by parameter, and the layers of every replica's shared split.
    assert unsupported_flags(megatron_args(tensor_model_parallel_size=2, use_distributed_optimizer=True), sized) == []
    assert unsupported_flags(megatron_args(tensor_model_parallel_size=2, use_distributed_optimizer=True, save="ckpt",
                                           dist_ckpt_optim_fully_reshardable=True), sized) == []
    # Every replica keeps TP 1, but layers move between its stages.
    assert unsupported_flags(megatron_args(), sized) == []
    # Under the interleaved schedule with the distributed optimizer too.
    assert unsupported_flags(megatron_args(tensor_model_parallel_size=2, use_distributed_optimizer=True,
                                           virtual_pipeline_model_parallel_size=2), sized) == []
    # Under the distributed optimizer it also bounds each rank's share of the optimizer state when
    # fewer replicas go on, whatever else the job changes.
    assert unsupported_flags(megatron_args(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                           use_distributed_optimizer=True), sized) == []
    for changes, why in (({"save": "ckpt", "ckpt_format": "torch"}, "--ckpt-format torch"),
                         ({"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}, "TP 1")):
        found = unsupported_flags(megatron_args(**{"tensor_model_parallel_size": 2, **changes}), sized)
        assert len(found) == 1 and "--resihp-device-memory-gb" in found[0] and why in found[0], found
        assert "layers stay on their stages" in found[0], found
    unrecovered = unsupported_flags(megatron_args(tensor_model_parallel_size=2), ResiHPConfig(device_memory_gb=40.0))
    assert len(unrecovered) == 1 and "--resihp-enable is off" in unrecovered[0], unrecovered


def test_standbys_probe_where_a_re_plan_may_drop_a_slow_replica():
    # A fail-slow re-plan may leave a slow replica out, under either schedule; its ranks probe their
    # devices at the interval asked for.
    probing = ResiHPConfig(enable=True, standby_probe_interval_s=2.0)
    assert unsupported_flags(megatron_args(), probing) == []
    assert unsupported_flags(megatron_args(use_distributed_optimizer=True), probing) == []
    assert unsupported_flags(megatron_args(virtual_pipeline_model_parallel_size=2), probing) == []


def test_megatron_cores_own_asynchronous_saves_run_with_their_kill_phases_and_storage_stalls():
    # Its writers are this process's children, which a change of world kills and starts again.
    kills = ResiHPConfig(enable=True, inject=["kill:rank=1,at=3,during=finalize", "kill:rank=2,at=2,during=save-scheduled",
                                              "stall:rank=3,at=2,seconds=30"])
    assert unsupported_flags(megatron_args(async_save=True, async_strategy="mcore", save="ckpt"), kills) == []
    stall = ResiHPConfig(enable=True, inject=["stall:rank=3,at=2,seconds=30"])
    assert unsupported_flags(megatron_args(save="ckpt"), stall) == []  # the rank itself waits in the save


def test_between_step_checks_are_refused_only_when_failures_are_recovered():
    # Without --resihp-enable a failure ends the job as in stock Megatron-LM, so nothing is refused.
    args = megatron_args(check_weight_hash_across_dp_replicas_interval=10, log_straggler=True, async_save=True)
    assert unsupported_flags(args, ResiHPConfig(detect_only=True)) == []


def test_the_interleaved_schedule_carries_every_fault_and_fail_slow_detection():
    interleaved = megatron_args(virtual_pipeline_model_parallel_size=2)
    kills = ResiHPConfig(enable=True, inject=["kill:rank=1,at=2", "hang:rank=2,at=3", "raise:rank=3,at=2,during=backward"])
    assert unsupported_flags(interleaved, kills) == []
    assert unsupported_flags(megatron_args(virtual_pipeline_model_parallel_size=2, use_distributed_optimizer=True),
                             kills) == []
    asks = ResiHPConfig(enable=True, trace="t.jsonl", inject=["slow:rank=1,factor=2,at=3", "link:src=0,dst=4,factor=9,at=3"])
    assert unsupported_flags(interleaved, asks) == []
    assert unsupported_flags(interleaved, ResiHPConfig(detect_only=True)) == []


def test_a_job_placed_by_a_layout_runs_under_either_schedule():
    # The interleaved schedule's chunks are read from the layout (``megatron_loop_stages.launch_chunks``).
    assert unsupported_flags(megatron_args(virtual_pipeline_model_parallel_size=2,
                                           pipeline_model_parallel_layout="Et|t|t|tL"), ResiHPConfig(enable=True)) == []
    assert unsupported_flags(megatron_args(pipeline_model_parallel_layout="Et|tttL"), ResiHPConfig(enable=True)) == []
