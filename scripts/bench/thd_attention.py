"""Transformer Engine's THD attention against our document attention, on the same packed documents.

With Transformer Engine installed, ``--packed-seq-layout auto`` trains packed documents through
TE's own attention in the THD layout; without it, through ``DocumentCausalAttention``, which calls
one attention kernel per distinct document length. Both attend within each document. This script
times them on the same micro-batches: forward and backward of ``--layers`` attention modules (no
projections, so attention is all there is), bf16, each variant timed in alternating rounds, printed
as median milliseconds per micro-batch and the ratio ours / TE. It also prints the largest
difference between the two outputs of one layer, which should be at bf16's rounding.

Needs a CUDA GPU and Transformer Engine (exit code 2 without them).

    python scripts/bench/thd_attention.py [--json] [--layers 24] [--seq-length 2048]
        [--micro-batch-size 2] [--heads 8] [--head-dim 64] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron.resihp.models.document_attention import DocumentCausalAttention, packed_seq_params_for  # noqa: E402
from scripts.bench.document_attention import (  # noqa: E402
    EOD,
    add_shape_arguments,
    packed_tokens,
    parse_shape_arguments,
    report,
    time_micro_batch,
)
from tests.one_rank_world import one_rank_world  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    args = parse_shape_arguments(parser, argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (Transformer Engine's attention runs only there)")
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
        import transformer_engine
    except ImportError as error:
        parser.error(f"needs Transformer Engine ({error}); install transformer_engine[pytorch]")
    hidden = args.heads * args.head_dim
    config = TransformerConfig(num_layers=args.layers, hidden_size=hidden, num_attention_heads=args.heads,
                               attention_dropout=0.0, hidden_dropout=0.0, bf16=True,
                               params_dtype=torch.bfloat16)
    rng = np.random.default_rng(0)
    with one_rank_world("nccl"):
        variants = {
            "te": [TEDotProductAttention(config, n, AttnMaskType.causal, "self")
                   for n in range(1, args.layers + 1)],
            "ours": [DocumentCausalAttention(config, n, AttnMaskType.causal, "self").cuda()
                     for n in range(1, args.layers + 1)],
        }
        times = {name: [] for name in variants}
        distinct_lengths, max_abs_diff = [], 0.0
        for round_ in range(args.rounds + 1):  # round 0 warms up
            tokens = packed_tokens(args.micro_batch_size, args.seq_length, rng)
            x = torch.randn(args.micro_batch_size * args.seq_length, args.heads, args.head_dim, device="cuda",
                            dtype=torch.bfloat16, requires_grad=True)
            params = packed_seq_params_for(tokens, EOD, "thd", device=torch.device("cuda"))
            with torch.no_grad():
                outputs = [variants[name][0](x, x, x, None, AttnMaskType.causal, packed_seq_params=params)
                           for name in ("te", "ours")]
                max_abs_diff = max(max_abs_diff, (outputs[0].float() - outputs[1].float()).abs().max().item())
            for name in (("te", "ours") if round_ % 2 else ("ours", "te")):
                seconds = time_micro_batch(variants[name], x, params, x.device)
                if round_:
                    times[name].append(seconds)
            distinct_lengths.append(variants["ours"][0].last_num_attention_calls)
    te, ours = statistics.median(times["te"]), statistics.median(times["ours"])
    result = {
        "device": torch.cuda.get_device_name(), "transformer_engine": transformer_engine.__version__,
        "layers": args.layers, "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
        "distinct_lengths_median": statistics.median(distinct_lengths),
        "te_thd_ms": round(1e3 * te, 3), "ours_ms": round(1e3 * ours, 3),
        "ratio_ours_over_te": round(ours / te, 4), "max_abs_diff": round(max_abs_diff, 5),
    }
    report(args, result, f"packed-document attention, Transformer Engine {result['transformer_engine']}, bf16", [
        ("Transformer Engine, THD", f"{result['te_thd_ms']:10.3f} ms per micro-batch"),
        ("document attention", f"{result['ours_ms']:10.3f} ms per micro-batch"),
        ("ratio ours/TE", f"{result['ratio_ours_over_te']:10.4f}"),
        ("largest output difference", f"{result['max_abs_diff']:10.5f}"),
    ])
    return result


if __name__ == "__main__":
    main()
