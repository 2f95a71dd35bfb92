"""The objects Megatron-LM's ``train()`` holds, made a re-formed world's.

Responsible for one step of taking over a rebuilt model and optimizer on Megatron's loop.
``train()`` and ``pretrain()`` bind the model list, the optimizer and the LR scheduler once, so the
rebuilt objects take over those handles rather than being handed in: the list's chunks are
replaced; the optimizer object takes on the rebuilt optimizer's class and attributes (so every
reference to it, the scheduler's and ``config.grad_scale_func`` included, sees the new state); the
rebuilt model's config gets what ``train()`` set on the launch one (its timers, the gradient
finalizer, the loss scaling and, under overlapped gradient reduction or parameter gathering, the
chunks' sync functions).

What the take-over drops must go too: ``train()`` keeps the last chunk of its first list in a local
for as long as it runs (the variable of a loop over the chunks), so a dropped chunk is emptied;
otherwise its parameters, gradient buffers and, through them, the old world's groups and their
threads stay alive to the job's end. Emptied, nothing of it is left in a reference cycle that
only a full garbage collection would free (measured: the old world's gloo threads are gone by the
next step without one; a full collection then costs 0.7-1.0 s per rank on a 2-core host).
"""

from __future__ import annotations


def adopt(model: list, optimizer, new, old_config, args) -> None:
    """Make ``model`` (``train()``'s list) hold ``new.chunks``, ``optimizer`` (its optimizer object)
    be ``new.optimizer``, and ``new.config`` carry what ``train()`` set on ``old_config``.
    ``args``: Megatron's arguments (the overlap flags)."""
    optimizer.__class__ = type(new.optimizer)
    optimizer.__dict__ = dict(new.optimizer.__dict__)
    dropped = [chunk for chunk in model if not any(chunk is kept for kept in new.chunks)]
    model[:] = new.chunks
    for chunk in dropped:
        vars(chunk).clear()
    config = new.config
    config.timers = old_config.timers
    if config.finalize_model_grads_func is None:  # as train() sets it; a layout's own sync stays
        from megatron.core.distributed import finalize_model_grads

        config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    def per_chunk(method: str):  # as train() sets them: one for one chunk, a list for several
        found = [getattr(chunk, method) for chunk in model]
        return found[0] if len(found) == 1 else found

    if model[0].ddp_config.overlap_grad_reduce:  # off in chunks whose gradients a layout's own sync sums
        config.no_sync_func = per_chunk("no_sync")
        if args.align_grad_reduce:
            config.grad_sync_func = per_chunk("start_grad_sync")
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = per_chunk("start_param_sync")
