"""Resilient GPT pretraining: a drop-in for Megatron-LM's ``pretrain_gpt.py``.

Launch it as you launch Megatron (``torchrun ... pretrain_gpt_resilient.py $ARGS``) and add
``--resihp-*`` flags for detection and in-place adaptation. This file holds what is GPT-specific:
the datasets and the forward step with its per-token loss.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from functools import partial

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

import torch  # noqa: E402

from megatron.resihp.arguments import parse_args  # noqa: E402
from megatron.resihp.data.batch import microbatch_features  # noqa: E402
from megatron.resihp.data.datasets import build_pretraining_datasets  # noqa: E402
from megatron.resihp.schedules import RECORDER  # noqa: E402
from megatron.resihp.training import pretrain  # noqa: E402

ARGS: argparse.Namespace | None = None


def datasets_provider(args: argparse.Namespace, num_samples: tuple[int, int, int]):
    return build_pretraining_datasets(
        data_path=args.data_path,
        split=args.split,
        mock_data=args.mock_data,
        seq_length=args.seq_length,
        seed=args.seed,
        tokenizer=args.tokenizer,
        num_samples=num_samples,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
        path_to_cache=args.data_cache_path,
        mock_doc_lengths=args.mock_doc_lengths,
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss: (sum of masked token losses, token count, report) so that replicas may run
    unequal micro-batch counts and the global gradient is still exact."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """Every stage draws the micro-batch: stages need its shape to time and predict it."""
    args = ARGS
    batch = next(data_iterator)
    tokens = batch["tokens"]
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    extra = {}
    if args.reset_attention_mask:
        from megatron.resihp.models.document_attention import packed_seq_params_for

        # From the host's tokens: finding the documents waits for nothing on the device.
        extra["packed_seq_params"] = params = packed_seq_params_for(tokens, args.tokenizer.eod,
                                                                    args.packed_seq_layout, device=device)
        RECORDER.features.append(microbatch_features(params.bounds))
    else:  # attention spans the whole sample: one "document" of seq_length per sample
        RECORDER.features.append((tokens.numel(), tokens.shape[0] * tokens.shape[1] ** 2, tokens.shape[0]))
    tokens = tokens.to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    attention_mask = batch.get("attention_mask")
    if args.reset_attention_mask and args.packed_seq_layout == "thd":
        from megatron.resihp.models.document_attention import flatten_for_thd

        tokens, labels, loss_mask, position_ids = flatten_for_thd(tokens, labels, loss_mask, position_ids)
    output = model(tokens, position_ids, attention_mask, labels=labels, **extra)
    return output, partial(loss_func, loss_mask)


def main(argv: list[str] | None = None) -> dict | None:
    global ARGS
    # Megatron-LM's own training loop (megatron-core >= 0.19, every Megatron flag stock) runs every job
    # unless it names --resihp-loop resihp: the project's own front end below, with its own flag list,
    # for what Megatron's loop does not carry yet (stage takeovers, TP shrinks, spares, standbys).
    from megatron.resihp.gpt_pretrain import main as megatron_loop_main, selects_megatron_loop

    if selects_megatron_loop(sys.argv[1:] if argv is None else argv):
        return megatron_loop_main(argv)
    ARGS = parse_args(argv)
    from megatron.resihp.resilience import build_resilience

    return pretrain(ARGS, datasets_provider, forward_step, resilience_factory=build_resilience)


if __name__ == "__main__":
    main()
