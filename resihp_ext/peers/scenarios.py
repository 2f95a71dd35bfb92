"""The evaluation's failure scenarios: GPT models with realistic layouts, and failures drawn at random.

Responsible for the scenario families of the comparison (fail-slow of 1 to 8 GPUs at 0.2-0.8 of
their speed, slow links, 1 to 16 dead GPUs, and mixes of them), the GPT sizes with the TP x PP
layouts they are trained with, and drawing one ``Health`` of a family from a seeded generator.
It decides and scores nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner.health import Health

FAMILIES = ("fail-slow", "slow-link", "fail-stop", "mixed")
MICROBATCHES_PER_REPLICA = 16


@dataclass(frozen=True)
class GptSize:
    """A GPT model and the TP x PP it is trained with (DP fills the cluster)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    tp_degree: int
    pp_degree: int

    def layout(self, num_gpus: int, microbatches_per_replica: int = MICROBATCHES_PER_REPLICA) -> Layout:
        """Megatron's uniform layout on ``num_gpus`` GPUs, ``microbatches_per_replica`` each."""
        per_replica = self.tp_degree * self.pp_degree
        if num_gpus % per_replica:
            raise ValueError(f"{num_gpus} GPUs do not divide into {self.name}'s TP x PP = {per_replica}")
        dp = num_gpus // per_replica
        model = ModelSpec(num_layers=self.num_layers, hidden_size=self.hidden_size,
                          num_attention_heads=self.num_attention_heads, ffn_hidden_size=4 * self.hidden_size,
                          vocab_size=50304, seq_length=2048, micro_batch_size=1,
                          global_batch_size=microbatches_per_replica * dp)
        return Layout.uniform(model, self.tp_degree, self.pp_degree, dp)


# Layouts of the kind Megatron-LM's published GPT configurations use: TP within a node, PP across.
GPT_SIZES = {
    "gpt-7b": GptSize("gpt-7b", 32, 4096, 32, tp_degree=4, pp_degree=2),
    "gpt-13b": GptSize("gpt-13b", 40, 5120, 40, tp_degree=8, pp_degree=4),
    "gpt-70b": GptSize("gpt-70b", 80, 8192, 64, tp_degree=8, pp_degree=8),
}


def _slow_devices(layout: Layout, rng: random.Random, low: int, high: int, taken: set[int]) -> dict[int, float]:
    ranks = rng.sample([r for r in layout.world_ranks if r not in taken], rng.randint(low, high))
    return {r: round(rng.uniform(0.2, 0.8), 2) for r in ranks}


def _slow_links(layout: Layout, rng: random.Random, low: int, high: int) -> dict[tuple[int, int], float]:
    """Links inside a TP group or between neighbouring pipeline stages, at 0.1-0.5 of their bandwidth."""
    out = {}
    for _ in range(rng.randint(low, high)):
        rep = layout.replicas[rng.randrange(layout.num_replicas)]
        p = rng.randrange(rep.num_stages)
        st = rep.stages[p]
        t = rng.randrange(st.tp_degree)
        if (rng.random() < 0.5 or rep.num_stages == 1) and st.tp_degree > 1:
            pair = (st.ranks[t], st.ranks[(t + 1) % st.tp_degree])
        elif rep.num_stages > 1:
            q = p + 1 if p + 1 < rep.num_stages else p - 1
            pair = (st.ranks[t], rep.stages[q].ranks[t])
        else:
            continue
        out[pair] = round(rng.uniform(0.1, 0.5), 2)
    return out


def draw(family: str, layout: Layout, rng: random.Random) -> Health:
    """One failure of ``family`` on ``layout``.

    Args:
        family: one of ``FAMILIES``.
        layout: the running layout (ranks are drawn from it).
        rng: the seeded generator.

    Returns:
        The Health: fail-slow, 1-8 GPUs at 0.2-0.8; slow-link, 1-4 links at 0.1-0.5; fail-stop,
        1-16 dead GPUs; mixed, 1-4 slow GPUs, 1-8 dead GPUs and 0-2 slow links.
    """
    if family == "fail-slow":
        return Health(speed=_slow_devices(layout, rng, 1, 8, set()))
    if family == "slow-link":
        return Health(slow_links=_slow_links(layout, rng, 1, 4))
    if family == "fail-stop":
        return Health(dead=frozenset(rng.sample(layout.world_ranks, rng.randint(1, 16))))
    if family == "mixed":
        dead = set(rng.sample(layout.world_ranks, rng.randint(1, 8)))
        return Health(speed=_slow_devices(layout, rng, 1, 4, dead), dead=frozenset(dead),
                      slow_links={k: v for k, v in _slow_links(layout, rng, 0, 2).items() if not set(k) & dead})
    raise ValueError(f"unknown scenario family {family!r}; choose one of {FAMILIES}")
