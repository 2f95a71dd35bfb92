"""A synchronous ``torch_dist`` save, megatron-core's write-results queue against the in-process one
(``megatron/resihp/sync_save_results.py``), both measured in this run.

    python scripts/bench/checkpoint_save.py [--ranks 8] [--repeats 3] [--json]

Each repeat starts ``--ranks`` CPU processes in one gloo group twice, once per way, and has every
rank save its shard of a small model's tensors (4 MiB per rank, 16 tensors) with megatron-core's
``dist_checkpointing.save``, as Megatron-LM's ``save_checkpoint`` does in ``torch_dist``. A save is
timed from its start to the last rank's return, the first save of each process (megatron-core
starts its Manager then) and a second one. Reports the medians and the ratio of megatron-core's
way over the in-process one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TENSORS, ELEMENTS = 16, 65536  # per rank: 16 fp32 tensors of 256 KiB


def _saves(rank: int, world: int, port: int, in_process: bool, root: str, out: str) -> None:
    import argparse as _argparse
    import logging

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.resihp import cpu_training

    cpu_training.enable()
    logging.getLogger("megatron.core.dist_checkpointing").setLevel(logging.ERROR)  # a deprecation note per save
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    if in_process:
        from megatron.resihp import sync_save_results

        sync_save_results.install(_argparse.Namespace(async_save=False))
    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.randn(ELEMENTS), (0, rank, world), replica_id=0)
             for i in range(TENSORS)}
    seconds = []
    for save in range(2):
        folder = Path(root) / f"save{save}"
        if rank == 0:
            folder.mkdir()
        dist.barrier()
        start = time.perf_counter()
        dist_checkpointing.save(state, str(folder))
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.destroy_process_group()


def run(ranks: int, port: int, in_process: bool) -> list[float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "seconds.json")
        mp.spawn(_saves, args=(ranks, port, in_process, tmp, out), nprocs=ranks)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8, help="CPU processes (>= 1)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way (>= 1)")
    parser.add_argument("--port", type=int, default=29617)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.ranks < 1 or args.repeats < 1:
        parser.error("--ranks and --repeats must be >= 1")
    runs: dict[str, list[list[float]]] = {"megatron_core": [], "in_process": []}
    for repeat in range(args.repeats):
        for way in (runs if repeat % 2 == 0 else reversed(list(runs))):  # alternate, so drift hits both
            runs[way].append(run(args.ranks, args.port, way == "in_process"))
    result = {"ranks": args.ranks, "cpu_count": os.cpu_count(), "repeats": args.repeats,
              "load_average": round(os.getloadavg()[0], 1)}
    for way, seconds in runs.items():
        result[way] = {"first_save_s": round(statistics.median(s[0] for s in seconds), 3),
                       "second_save_s": round(statistics.median(s[1] for s in seconds), 3)}
    result["first_save_ratio"] = round(result["megatron_core"]["first_save_s"] / result["in_process"]["first_save_s"], 2)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.ranks} ranks on {result['cpu_count']} CPUs, {args.repeats} repeats, torch_dist, synchronous")
    for way in runs:
        print(f"  {way:<14} first save {result[way]['first_save_s']:.3f} s  second {result[way]['second_save_s']:.3f} s")
    print(f"  first save, megatron-core's queue / in-process: {result['first_save_ratio']:.2f}x "
          f"(load average {result['load_average']})")


if __name__ == "__main__":
    main()
