"""The one dataclass behind every ``--resihp-*`` flag.

The ``--resihp-*`` argparse group (``megatron/resihp/resihp_flags.py``) is generated from the fields below (field ``foo_bar``
becomes ``--resihp-foo-bar``; the first paragraph of the docstring after a field is its help
text). All validation happens in ``__post_init__`` and raises ``ValueError`` naming the flag and
the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from resihp_ext.faults import Fault, parse_fault


@dataclass(kw_only=True)
class ResiHPConfig:
    enable: bool = False
    """Turn on in-place adaptation: detected failures are re-planned and applied without restart."""

    detect_only: bool = False
    """Run detection (and log verdicts) but never adapt, so an injected slowdown stays in place."""

    event_log: str | None = None
    """Path of a JSONL event log (one object per event: event, iteration, time, ...)."""

    trace: str | None = None
    """Path of a JSONL trace of every rank's op timings per iteration (input to scripts/bench/detection.py --trace)."""

    inject: list[str] = field(default_factory=list)
    """Inject a fault (repeatable): slow:rank=R,factor=F,at=I[,until=J][,on=A,off=B][,during=replan] | link:src=S,dst=D,factor=F,at=I | kill:rank=R,at=I | hang:rank=R,at=I."""

    slowdown_threshold: float = 1.25
    """Observed/predicted iteration-time ratio above which a stage or rank becomes suspect."""

    persistence_iters: int = 2
    """Suspect iterations a run needs before validation probes run (a run: see --resihp-persistence-gap-iters)."""

    shared_host_persistence_iters: int = 3
    """Suspect iterations a run needs instead, while ranks share devices (CPU cores: their ops take 1.5x
    their busy time or more in wall time), where a host's slow spells last longer; the larger of the two counts."""

    persistence_gap_iters: int = 1
    """Quiet iterations in a row a run of suspect ones survives (adding nothing to its count): a slowdown near the
    threshold that reads below it once, in an iteration where the others ran slow, is not forgotten. 0: consecutive only."""

    warmup_iters: int = 5
    """Iterations used only to fit the time predictor before the detector starts judging."""

    probe_threshold: float = 1.2
    """A validation probe this many times the healthy median names its rank or link slow."""

    speed_level_halflife_iters: float = 2.0
    """Half-life in healthy iterations of each stage group's speed level (its recent drift from the cost model); 0 turns levels off.
    The prediction a group is judged by is the cost model times its level (resihp_ext/detection/speed_level.py)."""

    max_speed_drift: float = 0.05
    """Largest drift from the cost model a speed level may follow (0.05 = 5%); below --resihp-slowdown-threshold - 1.
    The bound keeps a fail-slow from becoming the norm: a slowdown f is judged at f / (1 + drift) at worst."""

    cleared_cooldown_iters: int = 3
    """Iterations a group stays unsuspected after its probes cleared it (avoids probe storms)."""

    confirm_after_iters: int = 2
    """Live runs: a verdict from probes is probed again this many iterations later and acted on
    only if the same ranks (or link) are slow again; otherwise it is cleared. A device that is
    slow for a moment (a busy neighbour on a shared host) is not re-planned around. 0: act on the
    first probe round."""

    intermittent_episodes: int = 3
    """A rank the second probe round clears this many times, each time after a first round named it slow, all
    within --resihp-intermittent-window-iters, is slow in bursts and gets a compute verdict (resihp_ext/detection/recurrence.py).
    0: never."""

    intermittent_window_iters: int = 100
    """Iterations within which --resihp-intermittent-episodes cleared verdicts of one rank must fall. A rank
    named slow in bursts that then has none for this many iterations is suspected of recovery."""

    no_recovery: bool = False
    """Never raise recovery suspicions: a slow rank that is fast again keeps the smaller share it
    was given (the behaviour to compare recovery against)."""

    no_standby: bool = False
    """A rank a fail-slow plan leaves out exits, rather than standing by (probing its own device)
    to rejoin once healthy."""

    standby_probe_interval_s: float = 1.0
    """Seconds between a standby rank's probes of its own device speed."""

    verify_iters: int = 3
    """Iterations measured after a fail-slow re-plan (after one that settles) to judge whether it paid: one after
    which the job runs no faster than before (by --resihp-verify-margin) is rolled back and not tried again
    (resihp_ext/planner/adaptation_check.py). 0: re-plans are kept unverified."""

    verify_margin: float = 0.05
    """Share by which iterations after a re-plan must be faster than before it for the re-plan to be kept."""

    heartbeat_interval_s: float = 0.2
    """Seconds between heartbeats each rank writes to the job's store."""

    heartbeat_timeout_s: float = 1.5
    """A rank whose heartbeat is older than this is declared dead (or hung)."""

    collective_timeout_s: float = 30.0
    """Upper bound on any collective, so a dead peer cannot block survivors forever."""

    rendezvous_timeout_s: float = 10.0
    """Upper bound on connecting a re-formed world's gloo groups once every member has arrived; a member that dies
    while they connect costs this rather than the collective timeout (at most that). Raise it for worlds whose gloo
    groups take longer to connect."""

    hang_timeout_s: float | None = None
    """A rank alive but without progress this long while others reach recovery is hung (default: twice the collective timeout)."""

    compile_timeout_s: float = 600.0
    """A rank compiling a torch.compile graph (a first iteration's fusions, a lazy backward) is not hung while its
    compile lasts up to this long, however long its progress stood still; its hang clock starts again when the
    compile ends."""

    hang_iters: float = 10.0
    """A rank working outside any collective without progress for this many of its median iterations (at least
    5 heartbeat timeouts), while another rank waits in a collective as long, is hung: named in seconds instead of
    after --resihp-hang-timeout-s (megatron/resihp/hang_rules.py). 0: only the hang timeout names such a rank."""

    device_memory_gb: float | None = None
    """GiB of one device a stage may use; a fail-stop plan runs a stage at a smaller TP degree only if it fits (default: the CUDA device's total memory; 80e9 bytes without CUDA)."""

    def __post_init__(self) -> None:
        if self.device_memory_gb is not None and not self.device_memory_gb > 0:
            raise ValueError(f"--resihp-device-memory-gb must be > 0 (GiB per device), got {self.device_memory_gb}")
        if self.slowdown_threshold <= 1.0:
            raise ValueError(
                f"--resihp-slowdown-threshold must be > 1.0 (a ratio of observed to predicted time), "
                f"got {self.slowdown_threshold}"
            )
        if self.probe_threshold <= 1.0:
            raise ValueError(
                f"--resihp-probe-threshold must be > 1.0 (probe time over healthy median), got {self.probe_threshold}"
            )
        if self.speed_level_halflife_iters < 0:
            raise ValueError(f"--resihp-speed-level-halflife-iters must be >= 0 (0 turns speed levels off), "
                             f"got {self.speed_level_halflife_iters}")
        # A level may absorb up to max_speed_drift of a slowdown; past the threshold it could hide one.
        if not 0.0 <= self.max_speed_drift < self.slowdown_threshold - 1.0:
            raise ValueError(
                f"--resihp-max-speed-drift must be >= 0 and below --resihp-slowdown-threshold - 1 "
                f"({self.slowdown_threshold - 1.0:g}), got {self.max_speed_drift}"
            )
        if self.confirm_after_iters < 0:
            raise ValueError(f"--resihp-confirm-after-iters must be >= 0, got {self.confirm_after_iters}")
        if self.verify_iters < 0:
            raise ValueError(f"--resihp-verify-iters must be >= 0 (0: re-plans are not verified), got {self.verify_iters}")
        if not 0.0 <= self.verify_margin < 1.0:
            raise ValueError(f"--resihp-verify-margin must be in [0, 1) (0.05 = 5% faster), got {self.verify_margin}")
        if self.cleared_cooldown_iters < 0:
            raise ValueError(f"--resihp-cleared-cooldown-iters must be >= 0, got {self.cleared_cooldown_iters}")
        if self.intermittent_episodes < 0 or self.intermittent_episodes == 1:
            raise ValueError(f"--resihp-intermittent-episodes must be 0 (off) or >= 2 (one cleared verdict is "
                             f"what confirmation is for), got {self.intermittent_episodes}")
        if self.intermittent_window_iters < 1:
            raise ValueError(f"--resihp-intermittent-window-iters must be >= 1, got {self.intermittent_window_iters}")
        if self.persistence_gap_iters < 0:
            raise ValueError(f"--resihp-persistence-gap-iters must be >= 0 (0: consecutive iterations only), "
                             f"got {self.persistence_gap_iters}")
        for name in ("persistence_iters", "shared_host_persistence_iters", "warmup_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"--resihp-{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "collective_timeout_s", "rendezvous_timeout_s",
                     "standby_probe_interval_s", "compile_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--resihp-{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                "--resihp-heartbeat-timeout-s must exceed --resihp-heartbeat-interval-s "
                f"({self.heartbeat_timeout_s} <= {self.heartbeat_interval_s})"
            )
        if self.hang_timeout_s is not None and self.hang_timeout_s <= self.collective_timeout_s:
            raise ValueError(
                f"--resihp-hang-timeout-s must exceed --resihp-collective-timeout-s ({self.collective_timeout_s}), "
                f"got {self.hang_timeout_s}: ranks blocked on a hung peer must reach recovery before it is judged"
            )
        if self.hang_iters < 0:
            raise ValueError(f"--resihp-hang-iters must be >= 0 (0: off), got {self.hang_iters}")
        if self.enable and self.detect_only:
            raise ValueError("--resihp-enable and --resihp-detect-only exclude each other; pass one")
        self.faults  # parse now so a bad --resihp-inject fails at start-up, not at iteration 30

    @property
    def faults(self) -> tuple[Fault, ...]:
        return tuple(parse_fault(spec) for spec in self.inject)

    @property
    def effective_hang_timeout_s(self) -> float:
        return self.hang_timeout_s if self.hang_timeout_s is not None else 2 * self.collective_timeout_s

    @property
    def detection_on(self) -> bool:
        return self.enable or self.detect_only
