"""Per-device and per-link health, the planner's view of a failure.

Responsible for one value type, ``Health``: relative compute speed per rank (1.0 healthy, 0.5
half speed), the set of dead ranks, and relative bandwidth of slow links. Producing it from
observations is the detector's job; this module only describes and validates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class Health:
    """What is known to be wrong with the cluster.

    Attributes:
        speed: rank -> relative compute speed in (0, 1]; ranks not listed run at 1.0.
        dead: ranks that failed stop (dead or hung); their state is lost.
        slow_links: (src rank, dst rank) -> relative bandwidth in (0, 1] of transfers from src
            to dst. Pipeline transfers are priced per direction; TP and gradient collectives use
            both directions, so they run at the slower one (``link_speed``).
        bursts: slow ranks whose ``speed`` is what they run at in bursts, being at full speed
            between them (``resihp_ext.detection.recurrence``).
    """

    speed: Mapping[int, float] = field(default_factory=dict)
    dead: frozenset[int] = frozenset()
    slow_links: Mapping[tuple[int, int], float] = field(default_factory=dict)
    bursts: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "speed", MappingProxyType({int(r): float(v) for r, v in self.speed.items()}))
        object.__setattr__(self, "dead", frozenset(int(r) for r in self.dead))
        object.__setattr__(self, "bursts", frozenset(int(r) for r in self.bursts))
        if not self.bursts <= set(self.speed):
            raise ValueError(f"ranks slow in bursts {sorted(self.bursts - set(self.speed))} need a speed (their burst speed)")
        object.__setattr__(
            self, "slow_links",
            MappingProxyType({(int(a), int(b)): float(v) for (a, b), v in self.slow_links.items()}),
        )
        for rank, value in self.speed.items():
            if not 0.0 < value <= 1.0:
                raise ValueError(
                    f"speed of rank {rank} must be in (0, 1] (1.0 healthy, 0.5 half speed), got {value}; "
                    "mark a stopped rank dead instead of speed 0"
                )
        for (src, dst), value in self.slow_links.items():
            if src == dst:
                raise ValueError(f"slow link {src}:{dst} joins a rank to itself; give two different ranks")
            if not 0.0 < value <= 1.0:
                raise ValueError(f"slow link {src}:{dst} speed must be in (0, 1], got {value}")

    def speed_of(self, rank: int) -> float:
        """Relative compute speed, 0.0 for a dead rank."""
        if rank in self.dead:
            return 0.0
        return self.speed.get(rank, 1.0)

    def link_speed(self, a: int, b: int) -> float:
        """Relative bandwidth between ``a`` and ``b`` (the slower direction)."""
        return min(self.slow_links.get((a, b), 1.0), self.slow_links.get((b, a), 1.0))

    @property
    def is_healthy(self) -> bool:
        return not self.dead and all(v >= 1.0 for v in self.speed.values()) and all(
            v >= 1.0 for v in self.slow_links.values())

    @property
    def affected_ranks(self) -> frozenset[int]:
        """Ranks that are dead, slow, or an end of a slow link."""
        ranks = set(self.dead) | {r for r, v in self.speed.items() if v < 1.0}
        for (a, b), v in self.slow_links.items():
            if v < 1.0:
                ranks.update((a, b))
        return frozenset(ranks)

    @property
    def slow_factors(self) -> dict[int, float]:
        """rank -> slowdown factor (1 / speed) of each slow rank that is not dead."""
        return {r: 1.0 / v for r, v in self.speed.items() if v < 1.0 and r not in self.dead}

    def updated(self, newer: "Health") -> "Health":
        """This health with what ``newer`` says on top: its speeds and links replace these (and whether
        a rank is slow in bursts with them), its dead join these."""
        return Health(speed={**self.speed, **newer.speed}, dead=self.dead | newer.dead,
                      slow_links={**self.slow_links, **newer.slow_links},
                      bursts=(self.bursts - set(newer.speed)) | newer.bursts)

    def relabel(self, new_rank: Mapping[int, int]) -> "Health":
        """The same facts in another world's ranks (old -> new); ranks that world lacks are dropped."""
        return Health(speed={new_rank[r]: v for r, v in self.speed.items() if r in new_rank},
                      dead=frozenset(new_rank[r] for r in self.dead if r in new_rank),
                      slow_links={(new_rank[a], new_rank[b]): v for (a, b), v in self.slow_links.items()
                                  if a in new_rank and b in new_rank},
                      bursts=frozenset(new_rank[r] for r in self.bursts if r in new_rank))
