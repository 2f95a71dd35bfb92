"""The layout a checkpoint-restart would run: same TP/PP, nodes with bad devices left out.

Responsible for the fallback's placement only: which nodes to exclude and how many uniform
replicas the remaining nodes hold, ranks renumbered onto the survivors in megatron-core's order.
Deciding whether to restart belongs to the policies.
"""

from __future__ import annotations

from resihp_ext.layout import Layout, ReplicaSpec, StageSpec
from resihp_ext.planner.health import Health

GPUS_PER_NODE = 8


def excluded_nodes(health: Health, gpus_per_node: int = GPUS_PER_NODE) -> tuple[int, ...]:
    """Nodes (rank // gpus_per_node) holding a dead or slow device or an end of a slow link."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    return tuple(sorted({r // gpus_per_node for r in health.affected_ranks}))


def restart_layout(layout: Layout, health: Health, gpus_per_node: int = GPUS_PER_NODE) -> Layout | None:
    """The uniform layout on the nodes without bad devices, or None if not one replica fits.

    Args:
        layout: the running layout; its first replica's TP degree, depth and split are reused.
        health: the failure (its nodes are excluded).
        gpus_per_node: devices per node.

    Returns:
        The restart layout, or None.
    """
    first = layout.replicas[0]
    tp_degree, pp_degree = first.stages[0].tp_degree, first.num_stages
    bad = set(excluded_nodes(health, gpus_per_node))
    healthy = [r for r in layout.world_ranks if r // gpus_per_node not in bad]
    dp_degree = len(healthy) // (tp_degree * pp_degree)
    if dp_degree < 1:
        return None
    fresh = Layout.uniform(layout.model, tp_degree, pp_degree, dp_degree, first.layers_per_stage)
    # renumber onto the surviving ranks, keeping megatron-core's relative order
    return fresh.with_replicas(
        ReplicaSpec(tuple(StageSpec(st.first_layer, st.num_layers, tuple(healthy[r] for r in st.ranks))
                          for st in rep.stages))
        for rep in fresh.replicas
    )
