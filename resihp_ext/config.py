"""The one dataclass behind every ``--resihp-*`` flag.

The training front end generates its argparse group from the fields below (field ``foo_bar``
becomes ``--resihp-foo-bar``; the first docstring line after a field is its help text). All
validation happens in ``__post_init__`` and raises ``ValueError`` naming the flag and the fix.
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

    inject: list[str] = field(default_factory=list)
    """Inject a fault (repeatable): slow:rank=R,factor=F,at=I | link:src=S,dst=D,factor=F,at=I | kill:rank=R,at=I | hang:rank=R,at=I."""

    slowdown_threshold: float = 1.25
    """Observed/predicted iteration-time ratio above which a stage or rank becomes suspect."""

    persistence_iters: int = 2
    """Consecutive suspect iterations required before validation probes run."""

    warmup_iters: int = 5
    """Iterations used only to fit the time predictor before the detector starts judging."""

    heartbeat_interval_s: float = 0.2
    """Seconds between heartbeats each rank writes to the job's store."""

    heartbeat_timeout_s: float = 1.5
    """A rank whose heartbeat is older than this is declared dead (or hung)."""

    collective_timeout_s: float = 30.0
    """Upper bound on any collective, so a dead peer cannot block survivors forever."""

    def __post_init__(self) -> None:
        if self.slowdown_threshold <= 1.0:
            raise ValueError(
                f"--resihp-slowdown-threshold must be > 1.0 (a ratio of observed to predicted time), "
                f"got {self.slowdown_threshold}"
            )
        for name in ("persistence_iters", "warmup_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"--resihp-{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "collective_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--resihp-{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                "--resihp-heartbeat-timeout-s must exceed --resihp-heartbeat-interval-s "
                f"({self.heartbeat_timeout_s} <= {self.heartbeat_interval_s})"
            )
        if self.enable and self.detect_only:
            raise ValueError("--resihp-enable and --resihp-detect-only exclude each other; pass one")
        self.faults  # parse now so a bad --resihp-inject fails at start-up, not at iteration 30

    @property
    def faults(self) -> tuple[Fault, ...]:
        return tuple(parse_fault(spec) for spec in self.inject)

    @property
    def detection_on(self) -> bool:
        return self.enable or self.detect_only
