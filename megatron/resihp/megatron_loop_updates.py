"""Whether this rank's optimizer has updated its parameters in the step running, on Megatron-LM's loop.

Responsible for the one fact a recovery inside the step needs: a failure after this rank's update
must not run the iteration again. Megatron's optimizer is wrapped at its step (a ``raise:`` fault
strikes as it begins, an ``optimizer`` kill as it returns), and under the distributed optimizer each
inner torch optimizer at its update: the parameters are gathered after it, so the step counts as
done there, and the update's copies go out from there (``optimizer_parts.PartCopies``).
"""

from __future__ import annotations

from megatron.resihp.optimizer_parts import distributed_optimizers


class UpdateWatch:
    """``stepped``: whether the optimizer watched has updated this rank's parameters since the loop
    last cleared it; ``loop`` is the ``ResilientMegatronLoop`` (its executor, phases and faults)."""

    def __init__(self, loop):
        self.loop = loop
        self.stepped = False

    def watch(self, optimizer) -> None:
        """Wrap ``optimizer``'s step (the loop's handle, made anew at every take-over)."""
        loop = self.loop
        inner = type(optimizer).step

        def step(*args, **kwargs):
            loop.raised.strike("optimizer", loop.phases.position.iteration)
            copies = loop.hooks.run.part_copies
            if copies is not None:
                copies.step_begins()
            result = inner(optimizer, *args, **kwargs)
            self.stepped = True
            if copies is not None:
                copies.step_returned()
            loop.hooks.inject(loop.phases.position.iteration, "optimizer")
            return result

        optimizer.step = step
        if loop.hooks.run.part_copies is None:
            return
        loop.hooks.run.part_copies.optimizer = optimizer
        for sub in distributed_optimizers(optimizer):
            self._watch_update(sub.optimizer)

    def _watch_update(self, torch_optimizer) -> None:
        loop = self.loop
        update = type(torch_optimizer).step

        def counted_update(*args, **kwargs):
            result = update(torch_optimizer, *args, **kwargs)
            self.stepped = True
            if loop.hooks.run.part_copies.updating():
                loop.hooks.inject(loop.phases.position.iteration, "update")
            return result

        torch_optimizer.step = counted_update
