"""Adaptation benchmark on CPU: throughput under a slow rank, and time from a dead rank to training.

Measured in one invocation on a TP2 x PP2 x DP2 CPU job on Megatron-LM's loop (8 gloo processes,
fixed-length mock samples; with ``--packed-documents`` packed variable-length documents, attention
kept within each; torch-format checkpoints where a run saves):

(i) throughput (samples/s = global batch / median iteration ``elapsed_s``) of
    * a healthy run (``--resihp-detect-only``, so detection costs the same in every run),
    * ``--slow-rank`` slowed ``--factor`` x at ``--slow-at`` without adaptation
      (``--resihp-detect-only``),
    * the same with ``--resihp-enable`` (the loop re-plans layers and micro-batch quotas in place);
    each as a fraction of a capacity bound: healthy x (W - 1 + 1/factor) / W for W ranks, one of
    them at 1/factor speed (the throughput if the lost compute were spread perfectly);
    * pipeline link ``--link`` (default 0->4, replica 0's stage boundary) slowed ``--link-factor`` x
      at ``--slow-at``, without and with adaptation, as fractions of healthy throughput (a slow
      link takes no compute away). The emulated link keeps the host's loopback speed while the
      emulated devices compute 16x slower than a core, so it takes a factor like the default
      (600) for one slowed 32 KiB activation transfer (about 70 ms at the 3.7-5.1 ms/MiB measured
      on this host's loopback) to cost what a badly degraded link costs a real job: some 60% of a
      stage's compute per micro-batch;
    These runs emulate one device per rank (``--cpu-device-time-scale``, default 16): on a host
    with fewer cores than ranks the cores, not the slowest rank, would bound throughput, and no
    plan could win anything back;
    * ``--slow-rank`` slowed ``--factor`` x in bursts (``--bursts ON:OFF``) from ``--slow-at``, without
      and with adaptation, over ``--burst-iters`` iterations: mean throughput over the same whole
      periods after the adapted run's re-plan, as fractions of healthy and of a bound that is the
      capacity bound above during bursts and healthy between them;
    * ``--slow-rank`` slowed ``--factor`` x from ``--slow-at`` until ``--recover-at``, adapted, with
      recovery (a ``recovered`` verdict gives its micro-batches back) and with
      ``--resihp-no-recovery`` (they stay where the first re-plan put them), as fractions of healthy
      throughput over the same iterations after the recovery run's last re-plan;
    * on TP2 x DP4 (PP 1, where TP exclusion is what a very slow rank gets; under PP 2 the plan
      moves layers off its stage instead), ``--slow-rank`` slowed ``--standby-factor`` x from
      ``--slow-at`` until ``--recover-at``, adapted: the rank left out stands by and rejoins once
      healthy, or exits (``--resihp-no-standby``), as fractions of a healthy TP2 x DP4 run's
      throughput over the same iterations after the rejoin;
    * after ``--kill`` ranks are SIGKILLed at ``--slow-at``, adapted in place: on devices where a
      stage fits at TP 1, the survivors of a broken replica go on as a smaller-TP replica when the
      cost model fitted to the job says it pays; on devices that hold a stage only at its launch TP
      degree (``--resihp-device-memory-gb 0.004``) they are spares and only whole replicas go on.
      Both as fractions of healthy throughput over the same iterations;
(ii) fail-stop, ``--kill`` ranks (default 5) SIGKILLed at ``--kill-at``. ``--kill 2 --kill 5`` breaks both
    replicas (replica 1's stage 0 and replica 0's stage 1): in place, the survivors rebuild a replica
    from the two stage groups left whole; before that plan existed, this case needed a restart.
    * in place: ``scripts/launch_local.py`` + ``--resihp-enable`` with default flags; time from the
      ``inject`` event (written just before the kill) to the first ``iteration`` event after the
      ``adapted`` event (the killed iteration, redone on the new layout);
    * checkpoint-restart of the same job under torchrun, twice: saving every iteration (nothing
      completed is lost) and every ``--restart-save-interval`` iterations (the iterations since
      the last save are lost and redone). Each: time from the kill until torchrun has torn the job
      down (torchrun notices the exit itself, so that includes detection on one node), plus a
      relaunch with ``--load`` until the killed iteration is done again. Assumes the relaunch
      starts at once (no scheduler queue); the per-iteration saving cost is reported, not added.

    ``--interleaved`` runs the job under Megatron-LM's interleaved schedule (two model chunks per
    stage).

    python scripts/bench/adaptation.py [--json] [--iters 40] [--factor 2.0] [--slow-rank 7]
        [--link 0:4] [--link-factor 600] [--recover-at 22] [--kill 5]... [--restart-save-interval 4]
        [--standby-factor 8] [--bursts 4:4] [--burst-iters 80]
        [--skip throughput|slow|link|bursts|recover|standby|shrunk|fail_stop]... [--packed-documents]
        [--interleaved]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.child_env import job_env  # noqa: E402
from scripts.signal_rank import events, run_and_signal  # noqa: E402
NPROC, TP, PP = 8, 2, 2
GLOBAL_BATCH = 16  # fail-stop runs; the throughput runs take --global-batch
KILL_RANKS = (5,)
LINK_FACTOR = 600.0

# Megatron's loop needs an evaluation interval (--eval-iters 0: it never evaluates). A run that
# saves writes the torch format: the torch_dist default starts asynchronous writers on the first
# save, which would charge the restart baseline tens of seconds that a warm cluster does not pay.
MODEL = [
    "--device", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
    "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "512", "--log-interval", "10", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--tensor-model-parallel-size", str(TP), "--pipeline-model-parallel-size", str(PP),
    "--eval-iters", "0", "--eval-interval", "1000", "--ckpt-format", "torch",
]
# --packed-documents: several documents of lognormal lengths per sample, attention within each, so
# that micro-batches differ in cost as real packed data does.
PACKED_DOCUMENTS = [
    "--mock-doc-lengths", "lognormal:median=48,sigma=1.0,min=8,max=1024",
    "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
]


def job_model(args) -> list[str]:
    """The job's model flags, with ``args.packed_documents`` and ``args.interleaved`` (absent: off)."""
    return [*MODEL, *(PACKED_DOCUMENTS if getattr(args, "packed_documents", False) else []),
            *(["--num-layers-per-virtual-pipeline-stage", "1"] if getattr(args, "interleaved", False) else [])]


def launch(args: list[str], launcher: str = "torchrun", check: bool = True, timeout_s: float = 900):
    env = job_env()
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}"]
    else:
        cmd = [sys.executable, str(REPO / "scripts" / "launch_local.py"), f"--nproc-per-node={NPROC}"]
    start = time.time()
    proc = subprocess.run([*cmd, str(REPO / "pretrain_gpt_resilient.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    end = time.time()
    if check and proc.returncode:
        raise SystemExit(f"job failed ({proc.returncode}): {' '.join(args)}\n{proc.stderr[-3000:]}")
    return proc, start, end


def _distinct(rows: list[dict]) -> list[dict]:
    """Rows in order, each once (every survivor logs the same dead verdict)."""
    seen, out = set(), []
    for row in rows:
        key = json.dumps(row, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def _throughput_run(args, work: Path, name: str, extra: list[str], onset: int, fixed_start: bool = False,
                    launcher: str = "torchrun", period: int | None = None, iters: int | None = None) -> dict:
    """One throughput run: median iteration seconds in steady state, with its verdicts and re-plans.

    Measured from ``onset + 1`` on, or from the iteration after the last re-plan when that is later
    (unless ``fixed_start``, which compares two runs over the same iterations). With ``period`` (a
    fault that comes and goes), the mean over the last whole periods from there instead."""
    device = ["--cpu-device-time-scale", str(args.device_time_scale)] if args.device_time_scale else []
    log = work / f"{name}.events.jsonl"
    log.unlink(missing_ok=True)
    iters = iters or args.iters
    model = job_model(args)
    launch([*model, "--global-batch-size", str(args.global_batch), *device, "--train-iters", str(iters),
            "--resihp-event-log", str(log), *extra], launcher=launcher)
    adapted = events(log, "adapted")
    # Steady state: after the onset (and after the re-plan, when there is one) plus one iteration.
    start = onset + 1
    iteration_events = events(log, "iteration")
    if adapted and not fixed_start:
        after_replan = max(start, max(a["iteration"] for a in adapted) + 1)
        if sum(e["iteration"] > after_replan for e in iteration_events) >= 3:
            start = after_replan  # else too few iterations after the last re-plan: measure from onset
    if period:
        start = iters - (iters - start) // period * period
    times = [e["elapsed_s"] for e in iteration_events if e["iteration"] > start]
    if not times:
        raise SystemExit(f"{name}: no iteration left to measure after iteration {start} of {iters}; "
                         f"raise the run's iteration count")
    med = statistics.fmean(times) if period else statistics.median(times)
    return {
        "median_iteration_s" if not period else "mean_iteration_s": round(med, 4),
        "samples_per_s": round(args.global_batch / med, 3),
        "measured_iterations": len(times), "from_iteration": start + 1,
        "verdicts": _distinct([{k: v.get(k) for k in ("iteration", "kind", "ranks", "factor")}
                               for v in events(log, "verdict")]),
        "adapted": [{k: a.get(k) for k in ("iteration", "quotas", "layers_per_replica", "world_size", "duration_s")
                     if k in a} for a in adapted],
        "plans": [{k: p.get(k) for k in ("iteration", "policy", "action", "quotas")} for p in events(log, "plan")],
        "loadavg_after": os.getloadavg(),
    }


def throughput(args, work: Path) -> dict:
    """Healthy, one rank slow, and (unless skipped) one pipeline link slow; each fault with and
    without adaptation, all in this invocation."""
    out = {"healthy": _throughput_run(args, work, "healthy", ["--resihp-detect-only"], onset=2)}
    faults = {}
    if "slow" not in args.skip:
        faults["slow"] = f"slow:rank={args.slow_rank},factor={args.factor},at={args.slow_at}"
    if "link" not in args.skip:
        src, dst = args.link
        faults["link"] = f"link:src={src},dst={dst},factor={args.link_factor},at={args.slow_at}"
    for fault, spec in faults.items():
        inject = ["--resihp-inject", spec]
        out[f"{fault}_unadapted"] = _throughput_run(args, work, f"{fault}_unadapted",
                                                     ["--resihp-detect-only", *inject], args.slow_at)
        out[f"{fault}_adapted"] = _throughput_run(args, work, f"{fault}_adapted", ["--resihp-enable", *inject],
                                                   args.slow_at)
        out[f"{fault}_adapted_over_unadapted"] = round(
            out[f"{fault}_adapted"]["samples_per_s"] / out[f"{fault}_unadapted"]["samples_per_s"], 4)
    if "bursts" not in args.skip:
        out.update(_bursts(args, work, out["healthy"]["samples_per_s"]))
    if "recover" not in args.skip:
        out.update(_recovery(args, work))
    if "standby" not in args.skip:
        out.update(_standby(args, work))
    if "shrunk" not in args.skip:
        out.update(_after_fail_stop(args, work))
    healthy = out["healthy"]["samples_per_s"]
    for name in ("recover_kept_skewed", "recover_given_back", "killed_whole_replicas_only", "killed_smaller_tp"):
        if name in out:
            out[name]["fraction_of_healthy"] = round(out[name]["samples_per_s"] / healthy, 4)
    if "slow" in faults:
        bound = healthy * (NPROC - 1 + 1.0 / args.factor) / NPROC
        out["capacity_bound"] = {"samples_per_s": round(bound, 3),
                                 "definition": f"healthy x ({NPROC - 1} + 1/{args.factor}) / {NPROC}"}
        for name in ("healthy", "slow_unadapted", "slow_adapted"):
            out[name]["fraction_of_bound"] = round(out[name]["samples_per_s"] / bound, 4)
        out["adapted_over_unadapted"] = out["slow_adapted_over_unadapted"]
    # A slow link takes no compute away, so healthy throughput is its bound.
    for name in ("link_unadapted", "link_adapted"):
        if name in out:
            out[name]["fraction_of_healthy"] = round(out[name]["samples_per_s"] / healthy, 4)
    return out


def _bursts(args, work: Path, healthy: float) -> dict:
    """``--slow-rank`` slowed ``--factor`` x in bursts (``--bursts ON:OFF`` iterations) from ``--slow-at``:
    without adaptation, and adapted (a verdict once dropped verdicts recur, and a re-plan if it pays
    over bursts and calm weighed). Both measured as the mean over the same whole periods, those
    after the adapted run's last re-plan; as fractions of healthy and of a capacity bound."""
    on, off = args.bursts
    spec = f"slow:rank={args.slow_rank},factor={args.factor},at={args.slow_at},on={on},off={off}"
    adapted = _throughput_run(args, work, "bursts_adapted", ["--resihp-enable", "--resihp-inject", spec],
                              args.slow_at, period=on + off, iters=args.burst_iters)
    unadapted = _throughput_run(args, work, "bursts_unadapted", ["--resihp-detect-only", "--resihp-inject", spec],
                                adapted["from_iteration"] - 2, fixed_start=True, period=on + off,
                                iters=args.burst_iters)
    # In a burst at best the healthy rate with one rank's work spread perfectly; between bursts, healthy.
    share = on / (on + off)
    burst_bound = healthy * (NPROC - 1 + 1.0 / args.factor) / NPROC
    bound = 1.0 / (share / burst_bound + (1 - share) / healthy)
    out = {"bursts_unadapted": unadapted, "bursts_adapted": adapted,
           "bursts_adapted_over_unadapted": round(adapted["samples_per_s"] / unadapted["samples_per_s"], 4),
           "bursts_capacity_bound": {"samples_per_s": round(bound, 3),
                                     "definition": f"{share:g} of the time healthy x ({NPROC - 1} + 1/{args.factor}) / "
                                                   f"{NPROC}, the rest healthy (harmonic mean over time)"}}
    for run in (unadapted, adapted):
        run["fraction_of_healthy"] = round(run["samples_per_s"] / healthy, 4)
        run["fraction_of_bound"] = round(run["samples_per_s"] / bound, 4)
    return out


def _bursts_spec(text: str) -> tuple[int, int]:
    try:
        on, off = (int(x) for x in text.split(":"))
    except ValueError:
        on = off = 0
    if on < 1 or off < 1:
        raise argparse.ArgumentTypeError(f"--bursts takes ON:OFF iteration counts >= 1, e.g. 4:4; got {text!r}")
    return on, off


def _recovery(args, work: Path) -> dict:
    """``--slow-rank`` slowed ``--factor`` x from ``--slow-at`` until ``--recover-at`` (a throttled device
    that cools down), adapted both times: with recovery (its micro-batches are given back) and with
    ``--resihp-no-recovery`` (they stay skewed). Both measured over the same iterations, those after
    the recovery run's last re-plan."""
    spec = f"slow:rank={args.slow_rank},factor={args.factor},at={args.slow_at},until={args.recover_at}"
    back = _throughput_run(args, work, "recover_given_back", ["--resihp-enable", "--resihp-inject", spec],
                           args.recover_at)
    kept = _throughput_run(args, work, "recover_kept_skewed",
                           ["--resihp-enable", "--resihp-no-recovery", "--resihp-inject", spec],
                           back["from_iteration"] - 2, fixed_start=True)  # measured from onset + 2
    return {"recover_given_back": back, "recover_kept_skewed": kept,
            "recover_given_back_over_kept_skewed": round(back["samples_per_s"] / kept["samples_per_s"], 4)}


def _standby(args, work: Path) -> dict:
    """``--slow-rank`` slowed ``--standby-factor`` x from ``--slow-at`` until ``--recover-at``, so slow
    that the plan leaves ranks out, adapted both times: the ranks left out stand by and rejoin once
    healthy, or exit (``--resihp-no-standby``). Both measured over the same iterations, those after
    the rejoin."""
    spec = f"slow:rank={args.slow_rank},factor={args.standby_factor},at={args.slow_at},until={args.recover_at}"
    pp1 = ["--pipeline-model-parallel-size", "1"]
    healthy = _throughput_run(args, work, "standby_shape_healthy", [*pp1, "--resihp-detect-only"], onset=2)
    back = _throughput_run(args, work, "standby_rejoined", [*pp1, "--resihp-enable", "--resihp-inject", spec],
                           args.recover_at, launcher="local")
    gone = _throughput_run(args, work, "standby_off_exited",
                           [*pp1, "--resihp-enable", "--resihp-no-standby", "--resihp-inject", spec],
                           back["from_iteration"] - 2, fixed_start=True, launcher="local")
    for run in (back, gone):
        run["fraction_of_healthy"] = round(run["samples_per_s"] / healthy["samples_per_s"], 4)
    return {"standby_shape_healthy": healthy, "standby_rejoined": back, "standby_off_exited": gone,
            "standby_rejoined_over_exited": round(back["samples_per_s"] / gone["samples_per_s"], 4)}


def _after_fail_stop(args, work: Path) -> dict:
    """Throughput after ``--kill`` ranks die at ``--slow-at``, adapted in place with and without the
    smaller-TP replica, measured over the same iterations (from three after the kill)."""
    kills = [arg for rank in args.kill for arg in ("--resihp-inject", f"kill:rank={rank},at={args.slow_at}")]
    resilient = ["--resihp-enable", "--resihp-collective-timeout-s", "5", *kills]
    smaller = _throughput_run(args, work, "killed_smaller_tp", resilient, args.slow_at + 2, fixed_start=True,
                              launcher="local")
    whole = _throughput_run(args, work, "killed_whole_replicas_only", [*resilient, "--resihp-device-memory-gb", "0.004"],
                            args.slow_at + 2, fixed_start=True, launcher="local")
    return {"killed_smaller_tp": smaller, "killed_whole_replicas_only": whole,
            "killed_smaller_tp_over_whole_replicas_only": round(smaller["samples_per_s"] / whole["samples_per_s"], 4)}


def fail_stop(args, work: Path) -> dict:
    k = args.kill_at
    kills = [arg for rank in args.kill for arg in ("--resihp-inject", f"kill:rank={rank},at={k}")]
    iters = k + 3
    model = job_model(args)
    # In place.
    log = work / "inplace.events.jsonl"
    log.unlink(missing_ok=True)
    launch([*model, "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(iters), "--resihp-event-log",
            str(log), "--resihp-enable", *kills], launcher="local")
    inject = events(log, "inject")[0]["time"]
    adapted = events(log, "adapted")
    if not adapted:
        raise SystemExit(f"in-place run did not adapt; events: {[e for e in events(log) if e['event'] != 'iteration']}")
    after = [e for e in events(log, "iteration") if e["time"] > adapted[0]["time"]]
    dead = [v["time"] for v in events(log, "verdict") if v["kind"] == "dead"]
    pre = [e["elapsed_s"] for e in events(log, "iteration") if 2 < e["iteration"] < k]
    inplace = {
        "kill_to_first_dead_verdict_s": round(min(dead) - inject, 3) if dead else None,
        "kill_to_adapted_s": round(adapted[0]["time"] - inject, 3),
        "adapted_duration_s": round(adapted[0]["duration_s"], 3),
        "kill_to_first_iteration_after_s": round(after[0]["time"] - inject, 3),
        "first_iteration_after": after[0]["iteration"],
        "world_size_after": adapted[0]["world_size"],
        "median_iteration_s_before": round(statistics.median(pre), 4) if pre else None,
        "loadavg_after": os.getloadavg(),
    }
    # Checkpoint-restart of the same job, killed at the same point under torchrun: saving every
    # iteration (its best case: nothing lost) and at --restart-save-interval (work since the last
    # save is lost and redone).
    every = _restart(work, model, "restart_every_iteration", kills, k, iters, 1)
    interval = _restart(work, model, f"restart_every_{args.restart_save_interval}", kills, k, iters,
                        args.restart_save_interval)
    done = inplace["kill_to_first_iteration_after_s"]
    return {"kill_at": k, "killed_ranks": list(args.kill), "in_place": inplace,
            "stopped_in_place": _stopped_in_place(work, model, k, iters, args.kill[0]),
            "checkpoint_restart": every, "checkpoint_restart_interval": interval,
            "restart_over_in_place": round(every["kill_to_killed_iteration_done_s"] / done, 3),
            "restart_interval_over_in_place": round(interval["kill_to_killed_iteration_done_s"] / done, 3)}


def _stopped_in_place(work: Path, model: list[str], k: int, iters: int, rank: int) -> dict:
    """SIGSTOP sent from outside to ``rank``'s process once iteration ``k - 1`` is done, default
    flags: time from the signal to the first iteration finished after the re-plan."""
    log = work / "stopped.events.jsonl"
    log.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "scripts" / "launch_local.py"), f"--nproc-per-node={NPROC}",
           str(REPO / "pretrain_gpt_resilient.py"), *model, "--global-batch-size", str(GLOBAL_BATCH),
           "--train-iters", str(iters), "--resihp-event-log", str(log), "--resihp-enable"]
    code, output, stopped_at = run_and_signal(cmd, log, rank=rank, sig=signal.SIGSTOP, after_iteration=k - 1)
    adapted = events(log, "adapted")
    if code or not adapted or stopped_at is None:
        raise SystemExit(f"SIGSTOP run failed ({code}): {output[-3000:]}")
    after = [e for e in events(log, "iteration") if e["time"] > adapted[0]["time"]]
    hung = [v["time"] for v in events(log, "verdict") if v["kind"] == "hang"]
    return {
        "stop_to_first_hang_verdict_s": round(min(hung) - stopped_at, 3) if hung else None,
        "stop_to_adapted_s": round(adapted[0]["time"] - stopped_at, 3),
        "stop_to_first_iteration_after_s": round(after[0]["time"] - stopped_at, 3),
        "first_iteration_after": after[0]["iteration"],
        "world_size_after": adapted[0]["world_size"],
    }


def _restart(work: Path, model: list[str], name: str, kills: list[str], k: int, iters: int, save_interval: int
             ) -> dict:
    """Kill at iteration ``k`` under torchrun, relaunch with ``--load``: time from the kill until
    iteration ``k`` is done again, the iterations redone, and the per-iteration cost of saving."""
    ckpt = work / f"{name}_ckpt"
    log = work / f"{name}_killed.events.jsonl"
    log.unlink(missing_ok=True)
    common = [*model, "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(iters), "--save", str(ckpt),
              "--save-interval", str(save_interval)]
    proc, _, killed_end = launch([*common, "--resihp-event-log", str(log), *kills], check=False)
    inject = events(log, "inject")[0]["time"]
    last_saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    save_pre = [e["time"] for e in events(log, "iteration") if e["rank"] == NPROC - 1 and 2 < e["iteration"] < k]
    log2 = work / f"{name}_resumed.events.jsonl"
    log2.unlink(missing_ok=True)
    _, resume_start, _ = launch([*common, "--load", str(ckpt), "--resihp-event-log", str(log2)])
    resumed = events(log2, "iteration")
    first = min(resumed, key=lambda e: e["iteration"])
    again = min(e["time"] for e in resumed if e["iteration"] == k)
    teardown = killed_end - inject
    return {
        "save_interval": save_interval,
        "killed_job_exit_code": proc.returncode,
        "last_checkpoint": last_saved,
        "completed_iterations_lost": k - 1 - last_saved,
        "kill_to_teardown_s": round(teardown, 3),
        "relaunch_to_first_iteration_s": round(first["time"] - resume_start, 3),
        "first_iteration_after": first["iteration"],
        "kill_to_killed_iteration_done_s": round(teardown + again - resume_start, 3),
        "median_iteration_interval_s": round(statistics.median(
            b - a for a, b in zip(save_pre, save_pre[1:])), 4) if len(save_pre) > 1 else None,
        "assumptions": "relaunch starts immediately after teardown (no scheduler queue); detection = torchrun "
                       "noticing the worker's exit, included in teardown",
        "loadavg_after": os.getloadavg(),
    }


def _link_ends(text: str) -> tuple[int, int]:
    try:
        src, dst = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--link takes SRC:DST ranks, e.g. 0:4; got {text!r}") from None
    return src, dst


def _print_run(name: str, run: dict, fraction: str, of: str) -> None:
    seconds = (f"median {run['median_iteration_s']}" if "median_iteration_s" in run
               else f"mean {run['mean_iteration_s']}")
    print(f"  {name:<19} {run['samples_per_s']:>8} samples/s ({seconds} s/it, from it. "
          f"{run['from_iteration']}, n={run['measured_iterations']})  {run[fraction]:.3f} of {of}  "
          f"verdicts {run['verdicts']} adapted {run['adapted']}")


def _print_pair(runs: dict, names: tuple[str, str], of: str, ratio: str, label: str) -> None:
    """A baseline run, the run compared with it, and their ratio ``runs[ratio]``."""
    for name in names:
        _print_run(name, runs[name], f"fraction_of_{of}", of)
    print(f"  {label} = {runs[ratio]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iters", type=int, default=40, help="iterations per throughput run")
    parser.add_argument("--factor", type=float, default=2.0, help="slowdown of --slow-rank")
    parser.add_argument("--slow-rank", type=int, default=7,
                        help="rank slowed in the throughput runs (7: TP rank 1 of the last stage of replica 1)")
    parser.add_argument("--slow-at", type=int, default=10)
    parser.add_argument("--recover-at", type=int, default=22,
                        help="iteration at which --slow-rank is fast again in the recovery runs")
    parser.add_argument("--global-batch", type=int, default=32,
                        help="global batch of the throughput runs (8 micro-batches per replica)")
    parser.add_argument("--device-time-scale", type=float, default=16.0,
                        help="--cpu-device-time-scale of the throughput runs (one emulated device per rank; "
                             "0 runs on the shared cores as they are)")
    parser.add_argument("--standby-factor", type=float, default=8.0,
                        help="slowdown of --slow-rank in the standby runs (large enough to leave it out)")
    parser.add_argument("--link", type=_link_ends, default=(0, 4),
                        help="SRC:DST of the slowed pipeline link (0:4: replica 0's stage boundary, TP rank 0)")
    parser.add_argument("--link-factor", type=float, default=LINK_FACTOR, help="slowdown of --link")
    parser.add_argument("--bursts", type=_bursts_spec, default=(4, 4),
                        help="ON:OFF iterations of --slow-rank's bursts in the burst runs")
    parser.add_argument("--burst-iters", type=int, default=80, help="iterations per burst run")
    parser.add_argument("--kill-at", type=int, default=6)
    parser.add_argument("--restart-save-interval", type=int, default=4,
                        help="checkpoint interval of the second checkpoint-restart run (iterations; the first "
                             "saves every iteration)")
    parser.add_argument("--kill", type=int, action="append", default=None,
                        help="rank SIGKILLed in the fail-stop runs (repeatable; default 5)")
    parser.add_argument("--skip", choices=("throughput", "slow", "link", "bursts", "recover", "standby", "shrunk",
                                           "fail_stop"),
                        action="append", default=[],
                        help="leave out a part: throughput (every throughput run), slow (the slow-rank runs), link "
                             "(the slow-link runs), bursts (the runs with a rank slow in bursts), recover (the recovery runs), standby (the runs whose left-out ranks stand "
                             "by or exit), shrunk (the runs after a fail-stop, "
                             "with and without a smaller-TP replica), fail_stop (time to resume)")
    parser.add_argument("--packed-documents", action="store_true",
                        help="packed variable-length mock documents with attention within each (--mock-doc-lengths "
                             "lognormal:median=48,sigma=1.0,min=8,max=1024 --reset-attention-mask "
                             "--reset-position-ids --eod-mask-loss) instead of fixed-length samples")
    parser.add_argument("--interleaved", action="store_true",
                        help="Megatron-LM's interleaved schedule, two model chunks per stage "
                             "(--num-layers-per-virtual-pipeline-stage 1)")
    parser.add_argument("--workdir", help="keep logs here (default: a temporary folder)")
    args = parser.parse_args()
    args.kill = sorted(set(args.kill or KILL_RANKS))
    if not {"recover", "standby"} <= set(args.skip) and "throughput" not in args.skip and not (
            args.slow_at < args.recover_at <= args.iters - 12):
        parser.error(f"--recover-at must be after --slow-at ({args.slow_at}) and at least 12 iterations before "
                     f"the end (--iters {args.iters}); got {args.recover_at}, or pass --skip recover --skip standby")
    if "fail_stop" not in args.skip and not 1 <= args.restart_save_interval < args.kill_at:
        parser.error(f"--restart-save-interval must be at least 1 and below --kill-at ({args.kill_at}), so that a "
                     f"checkpoint exists when the kill strikes; got {args.restart_save_interval}")
    if any(not 0 <= r < NPROC for r in args.kill):
        parser.error(f"--kill takes ranks 0-{NPROC - 1}; got {args.kill}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="adaptation_"))
    work.mkdir(parents=True, exist_ok=True)
    out = {"shape": f"TP{TP} x PP{PP} x DP{NPROC // (TP * PP)} ({NPROC} processes, CPU, Megatron-LM's loop)"
                    + (", packed variable-length documents" if args.packed_documents else ", fixed-length samples")
                    + (", interleaved schedule, 2 chunks per stage" if args.interleaved else ""),
           "cpu_count": os.cpu_count(),
           "cpu_device_time_scale": args.device_time_scale,
           "loadavg_start": os.getloadavg(), "workdir": str(work)}
    if "throughput" not in args.skip:
        out["throughput"] = throughput(args, work)
    if "fail_stop" not in args.skip:
        out["fail_stop"] = fail_stop(args, work)
    out["loadavg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['shape']}, {out['cpu_count']} CPUs, load average at start {out['loadavg_start']}")
    if "throughput" in out:
        print(f"throughput runs: global batch {args.global_batch}, --cpu-device-time-scale {args.device_time_scale:g}")
        t = out["throughput"]
        r = t["healthy"]
        print(f"  healthy         {r['samples_per_s']:>8} samples/s ({r['median_iteration_s']} s/it, from it. "
              f"{r['from_iteration']}, n={r['measured_iterations']})  verdicts {r['verdicts']}")
        if "slow_adapted" in t:
            print(f"rank {args.slow_rank} slowed {args.factor:g}x at iteration {args.slow_at}")
            print(f"capacity bound {t['capacity_bound']['samples_per_s']} samples/s = "
                  f"{t['capacity_bound']['definition']}")
            _print_pair(t, ("slow_unadapted", "slow_adapted"), "bound", "slow_adapted_over_unadapted",
                        "adapted / unadapted")
        if "link_adapted" in t:
            src, dst = args.link
            print(f"link {src}->{dst} slowed {args.link_factor:g}x at iteration {args.slow_at} (bound: healthy)")
            _print_pair(t, ("link_unadapted", "link_adapted"), "healthy", "link_adapted_over_unadapted",
                        "adapted / unadapted")
        if "bursts_adapted" in t:
            on, off = args.bursts
            print(f"rank {args.slow_rank} slowed {args.factor:g}x in bursts ({on} iterations on, {off} off) from "
                  f"iteration {args.slow_at}; capacity bound {t['bursts_capacity_bound']['samples_per_s']} samples/s = "
                  f"{t['bursts_capacity_bound']['definition']}")
            _print_pair(t, ("bursts_unadapted", "bursts_adapted"), "bound", "bursts_adapted_over_unadapted",
                        "adapted / unadapted")
        if "recover_given_back" in t:
            print(f"rank {args.slow_rank} slowed {args.factor:g}x from iteration {args.slow_at} until {args.recover_at}, "
                  f"adapted in both runs")
            _print_pair(t, ("recover_kept_skewed", "recover_given_back"), "healthy",
                        "recover_given_back_over_kept_skewed", "given back / kept skewed")
        if "standby_rejoined" in t:
            r = t["standby_shape_healthy"]
            print(f"TP2 x DP4: rank {args.slow_rank} slowed {args.standby_factor:g}x from iteration {args.slow_at} "
                  f"until {args.recover_at}, adapted in both runs; healthy TP2 x DP4 {r['samples_per_s']} samples/s "
                  f"({r['median_iteration_s']} s/it)")
            _print_pair(t, ("standby_off_exited", "standby_rejoined"), "healthy", "standby_rejoined_over_exited",
                        "stood by and rejoined / left")
        if "killed_smaller_tp" in t:
            print(f"ranks {args.kill} SIGKILLed at iteration {args.slow_at}, adapted in place in both runs")
            _print_pair(t, ("killed_whole_replicas_only", "killed_smaller_tp"), "healthy",
                        "killed_smaller_tp_over_whole_replicas_only", "smaller-TP replica kept / whole replicas only")
    if "fail_stop" in out:
        f = out["fail_stop"]
        print(f"fail-stop (ranks {f['killed_ranks']} SIGKILLed at iteration {f['kill_at']}):")
        print(f"  in place:           {f['in_place']}")
        print(f"  SIGSTOP of rank {f['killed_ranks'][0]} from outside, in place: {f['stopped_in_place']}")
        print(f"  checkpoint-restart, saving every iteration: {f['checkpoint_restart']}")
        interval = f["checkpoint_restart_interval"]
        print(f"  checkpoint-restart, saving every {interval['save_interval']}: {interval}")
        print(f"  kill to the killed iteration done again, restart / in place = {f['restart_over_in_place']} "
              f"(saving every iteration), {f['restart_interval_over_in_place']} (saving every "
              f"{interval['save_interval']}, {interval['completed_iterations_lost']} completed iterations lost)")
    print(f"load average at end {out['loadavg_end']}")


if __name__ == "__main__":
    main()
