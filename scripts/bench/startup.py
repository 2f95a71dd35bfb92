"""Job start-up: launch to first finished iteration, ranks forked from a fork server of the launch's
own (``scripts/launch_local.py``, the default) against ranks forked from a fork server shared by
many launches (``--fork-server``, ``scripts/shared_fork_server.py``), ranks that import everything
themselves (``--preload none``) and torchrun, all measured in this run.

    python scripts/bench/startup.py [--nproc 8] [--repeats 3] [--json]

Each repeat runs the launches one after another (in a rotating order, so the host's drift hits
each alike) on the same 1-iteration job of the tiny test model on Megatron-LM's loop,
TP2 x PP2 x DP(N/4). The shared server is started once, before the first repeat, as a test
session or a sweep starts it; its own start-up is reported apart. Reports the median seconds from
starting the launcher to the first iteration's event, and to the launcher's exit, and the ratios
against the launch's own fork server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.child_env import job_env  # noqa: E402

SCRIPT = REPO / "pretrain_gpt_resilient.py"
MODEL = ("--device cpu --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
         "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 512 --split 99,1,0 --eval-iters 0 --eval-interval 1000 "
         "--log-interval 1 --train-iters 1").split()
LAUNCH_LOCAL = [sys.executable, str(REPO / "scripts" / "launch_local.py")]
LAUNCHES = {
    "fork_server": lambda n, _: [*LAUNCH_LOCAL, f"--nproc-per-node={n}"],
    "shared_server": lambda n, sock: [*LAUNCH_LOCAL, f"--nproc-per-node={n}", "--fork-server", sock],
    "no_preload": lambda n, _: [*LAUNCH_LOCAL, f"--nproc-per-node={n}", "--preload", "none"],
    "torchrun": lambda n, _: [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"],
}
# Each launch is told which server to use; none reads it from the caller's environment.
ENV = job_env(without=["RESIHP_FORK_SERVER"])


def start_shared_server(sock: str) -> tuple[subprocess.Popen, float]:
    """The shared fork server, and the seconds it took to import and listen."""
    start = time.time()
    server = subprocess.Popen([sys.executable, str(REPO / "scripts" / "shared_fork_server.py"), sock, str(SCRIPT),
                               "--die-with-parent"], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    if server.stdout.readline().strip() != "ready":
        raise SystemExit(f"the shared fork server did not start (exit {server.wait()})")
    return server, time.time() - start


def launch(name: str, nproc: int, sock: str) -> dict:
    """Seconds from start to the first iteration's event and to the launcher's exit."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "events.jsonl"
        shape = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"] if nproc % 4 == 0 else []
        start = time.time()
        proc = subprocess.run([*LAUNCHES[name](nproc, sock), str(SCRIPT), *MODEL, *shape,
                               "--resihp-event-log", str(log)], cwd=REPO, env=ENV, capture_output=True, text=True)
        end = time.time()
        if proc.returncode:
            raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        first = min(r["time"] for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "iteration")
        return {"to_first_iteration_s": first - start, "to_exit_s": end - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8, help="ranks (a multiple of 4 runs TP2 x PP2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.nproc < 1 or args.repeats < 1:
        parser.error("--nproc and --repeats must be >= 1")
    names = list(LAUNCHES)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        sock = str(Path(tmp) / "fork-server.sock")
        server, server_start_s = start_shared_server(sock)
        try:
            for repeat in range(args.repeats):
                for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                    runs[name].append(launch(name, args.nproc, sock))
        finally:
            server.terminate()
            server.wait()
    out = {"nproc": args.nproc, "repeats": args.repeats, "cpu_count": os.cpu_count(),
           "shared_server_start_s": round(server_start_s, 2), "launches": {}}
    for name in names:
        out["launches"][name] = {key: round(statistics.median(r[key] for r in runs[name]), 2)
                                 for key in ("to_first_iteration_s", "to_exit_s")}
        out["launches"][name]["per_repeat_to_first_iteration_s"] = [round(r["to_first_iteration_s"], 2)
                                                                    for r in runs[name]]
    base = out["launches"]["fork_server"]["to_first_iteration_s"]
    out["over_fork_server"] = {name: round(out["launches"][name]["to_first_iteration_s"] / base, 3) for name in names}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.nproc} ranks on {out['cpu_count']} CPUs, {args.repeats} repeats, 1-iteration job; the shared "
          f"server took {out['shared_server_start_s']:.2f} s to start, once")
    for name in names:
        r = out["launches"][name]
        print(f"  {name:<13} first iteration after {r['to_first_iteration_s']:6.2f} s (repeats "
              f"{r['per_repeat_to_first_iteration_s']}), exit after {r['to_exit_s']:6.2f} s, "
              f"x{out['over_fork_server'][name]} of the fork server")


if __name__ == "__main__":
    main()
