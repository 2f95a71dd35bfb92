"""A real Slurm for tests: finding or starting one on this machine, submitting, watching, killing.

Responsible for: using a running Slurm that ``SLURM_CONF`` (or the one ``scripts/slurm/local_cluster.sh``
left under its folder) points to, or starting that script's cluster (one node, or two nodes in
network namespaces) when Slurm's daemons are installed, and saying in one line why not otherwise,
so the tests skip with that reason. It never installs packages: ``scripts/test.sh`` does that,
best-effort, before the suite.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.child_env import REPO, job_env

CLUSTER_SCRIPT = REPO / "scripts" / "slurm" / "local_cluster.sh"
SBATCH = REPO / "scripts" / "slurm" / "pretrain_resilient.sbatch"
# local_cluster.sh's folders: a one-node cluster's, and a two-node cluster's (its own controller).
_DIRS = {1: Path(os.environ.get("RESIHP_SLURM_DIR", "/tmp/resihp-slurm")), 2: Path("/tmp/resihp-slurm2")}


@dataclass
class Cluster:
    env: dict[str, str]  # a job's environment plus SLURM_CONF (and local_cluster.sh's settings)
    started: bool  # this module started it (and stops it)

    def run(self, *cmd: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def stop(self) -> None:
        if self.started:
            subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop"], env=self.env, capture_output=True, timeout=60)


def _answers(env: dict[str, str], nodes: int) -> bool:
    """At least ``nodes`` nodes are up (idle, mixed or allocated)."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return False
    up = {line.split()[0] for line in proc.stdout.splitlines()
          if len(line.split()) == 2 and line.split()[1] in ("idle", "mix", "alloc")}
    return proc.returncode == 0 and len(up) >= nodes


def find_or_start(nodes: int = 1) -> tuple[Cluster | None, str]:
    """A Slurm of ``nodes`` nodes (1 or 2) the tests can submit to, or None and why there is none.

    Returns:
        (cluster, "") when one answers; (None, reason) otherwise.
    """
    if shutil.which("sbatch") is None or shutil.which("slurmctld") is None:
        return None, ("Slurm is not installed (no sbatch/slurmctld on PATH); `bash scripts/slurm/local_cluster.sh "
                      "install` installs Debian's packages as root, and scripts/test.sh tries that first")
    folder = _DIRS[nodes]
    given = os.environ.get("SLURM_CONF") if nodes == 1 else None
    for conf in filter(None, (given, str(folder / "slurm.conf"))):
        env = job_env({"SLURM_CONF": conf})
        if Path(conf).is_file() and _answers(env, nodes):
            return Cluster(env, started=False), ""
    env = job_env({"SLURM_CONF": str(folder / "slurm.conf"), "RESIHP_SLURM_DIR": str(folder),
                   "RESIHP_SLURM_NODES": str(nodes)})
    proc = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or not _answers(env, nodes):
        what = "Slurm" if nodes == 1 else "a two-node Slurm (two slurmd's in network namespaces)"
        return None, f"{what} could not start here: {(proc.stderr.strip() or proc.stdout.strip())[-400:]}"
    return Cluster(env, started=True), ""


def lose_node(name: str) -> None:
    """A node of the two-node cluster dies: its link goes down, then every process in its network
    namespace (its slurmd, slurmstepd, ranks and beacons) is SIGKILLed. With the link down first,
    no peer gets a reset for its connections: they learn of it by heartbeats and timeouts, as
    when a machine loses power."""
    index = name.removeprefix("n")
    subprocess.run(["ip", "link", "set", f"resihp-v{index}", "down"], check=True, timeout=15)
    pids = subprocess.run(["ip", "netns", "pids", f"resihp-{name}"], capture_output=True, text=True, timeout=15)
    for pid in pids.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Job:
    job_id: str
    output: Path

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def story(self) -> str:
        """What the job's output says happened, for a failing test's message: the project's own
        lines (``resihp:``, the beacons'), Slurm's (``srun:``, the batch script's) and every
        traceback whole, without Megatron's per-iteration lines that bury them."""
        return told(self.text())


_TOLD = (" resihp: ", "heartbeat:", "srun:", "pretrain_resilient.sbatch:", "Error", "error:")


def told(output: str, limit: int = 12000) -> str:
    """The last ``limit`` characters of the lines of ``output`` that tell what happened (``Job.story``)."""
    kept, in_traceback = [], False
    for line in output.splitlines():
        if line.startswith("Traceback"):
            in_traceback = True
        if in_traceback or any(mark in line for mark in _TOLD):
            kept.append(line)
        if in_traceback and line and not line[0].isspace() and not line.startswith(("Traceback", "During", "The above")):
            in_traceback = False  # the exception's own line ends it
    return "\n".join(kept)[-limit:]


def submit(cluster: Cluster, out_dir: Path, ntasks_per_node: int, args: list[str], nodes: int = 1,
           script: str = "pretrain_gpt_resilient.py", export: str | None = None) -> Job:
    """``sbatch scripts/slurm/pretrain_resilient.sbatch SCRIPT ARGS`` from the checkout; ``export``:
    variables set for the job beside the submitter's (``VAR=VALUE,...``)."""
    output = out_dir / "slurm.out"
    exported = [f"--export=ALL,{export}"] if export else []
    proc = cluster.run("sbatch", "--parsable", f"--nodes={nodes}", f"--ntasks-per-node={ntasks_per_node}",
                       f"--output={output}", f"--chdir={REPO}", *exported, str(SBATCH), script, *args)
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    return Job(proc.stdout.strip().split(";")[0], output)


def job_fields(cluster: Cluster, job: Job) -> dict[str, str]:
    """``scontrol show job``'s fields (JobState, ExitCode, ...); empty once Slurm forgot the job."""
    proc = cluster.run("scontrol", "show", "job", "-o", job.job_id)
    if proc.returncode != 0:
        return {}
    return dict(item.split("=", 1) for item in proc.stdout.split() if "=" in item)


_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def wait(cluster: Cluster, job: Job, timeout_s: float) -> dict[str, str]:
    """Waits for the job to end (cancelling it past ``timeout_s``) and returns its fields."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fields = job_fields(cluster, job)
        if fields.get("JobState") in _ENDED:
            return fields
        time.sleep(0.5)
    cluster.run("scancel", job.job_id)
    raise AssertionError(f"job {job.job_id} still running after {timeout_s} s; cancelled:\n{job.story()}")


def task_pids(cluster: Cluster, job: Job, step: int = 0) -> dict[int, int]:
    """Global task rank -> pid of the task itself (its first process; a rank's beacon is its child),
    from ``scontrol listpids``: how an operator finds the process of a rank on its node."""
    proc = cluster.run("scontrol", "listpids", f"{job.job_id}.{step}")
    rows = [line.split() for line in proc.stdout.splitlines()[1:] if line.split()]
    by_task: dict[int, list[int]] = {}
    for row in rows:
        if len(row) == 5 and row[4].isdigit():
            by_task.setdefault(int(row[4]), []).append(int(row[0]))
    pids = {}
    for task, candidates in by_task.items():
        listed = set(candidates)
        roots = [p for p in candidates if _parent(p) not in listed]
        if len(roots) == 1:
            pids[task] = roots[0]
    return pids


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[1])
