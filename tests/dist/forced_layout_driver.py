"""Runs pretrain_gpt_resilient.py's job, switching to a given Layout at a given iteration.

Lets a test drive the in-place executor (groups, state moves, layer-wise gradient sync) through a
known heterogeneous layout, independent of what the planner would choose on a noisy machine.
Extra flags, removed before the job's own parsing:
    --forced-layout JSON   ``[[layers of stage 0, layers of stage 1, ...] per replica]``
    --forced-at N          iteration after which to switch
    --forced-quotas A,B    micro-batches per replica from then on
    --forced-tp JSON       optional ``[[TP degree of each stage] per replica]``; a stage keeps the
                           first ranks of its old TP group, the others become spares and leave
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pretrain_gpt_resilient as entry  # noqa: E402
from megatron.resihp.arguments import parse_args  # noqa: E402
from megatron.resihp.resilience import ResilienceHooks  # noqa: E402
from megatron.resihp.training import pretrain  # noqa: E402
from resihp_ext.layout import Layout, ReplicaSpec, StageSpec  # noqa: E402
from resihp_ext.shard_map import transfers  # noqa: E402


def _pop(argv: list[str], flag: str) -> str:
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


def main() -> None:
    argv = sys.argv[1:]
    layers = json.loads(_pop(argv, "--forced-layout"))
    at = int(_pop(argv, "--forced-at"))
    quotas = [int(q) for q in _pop(argv, "--forced-quotas").split(",")]
    tp = json.loads(_pop(argv, "--forced-tp")) if "--forced-tp" in argv else None
    args = entry.ARGS = parse_args(argv)

    class ForcedLayout(ResilienceHooks):
        def after_iteration(self, iteration, elapsed_s, result, objects, current):
            objects, current = super().after_iteration(iteration, elapsed_s, result, objects, current)
            if iteration != at:
                return objects, current
            replicas = []
            for r, (old, counts) in enumerate(zip(self.layout.replicas, layers)):
                first, stages = 0, []
                for p, (stage, n) in enumerate(zip(old.stages, counts)):
                    degree = tp[r][p] if tp else stage.tp_degree
                    stages.append(StageSpec(first, n, stage.ranks[:degree]))
                    first += n
                replicas.append(ReplicaSpec(tuple(stages)))
            new_layout = Layout(tuple(replicas), self.layout.model)
            planned = transfers(self.layout, new_layout)  # what a plan for this layout carries
            self._take(objects, current)
            self.replan.change_layout(new_layout, planned, iteration)
            objects = self.run.objects
            self.events.emit("forced_layout", iteration, layers=layers, quotas=quotas, bytes_moved=self.moved_bytes,
                             moves=[t.to_dict() for t in planned if t.crosses])
            return objects, quotas

    pretrain(args, entry.datasets_provider, entry.forward_step,
             resilience_factory=ForcedLayout)


if __name__ == "__main__":
    main()
