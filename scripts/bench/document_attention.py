"""Document attention: one row plan per micro-batch against one per layer, in the same run.

Every layer of a micro-batch attends over the same documents. With megatron-core's plain
``PackedSeqParams`` each ``DocumentCausalAttention`` call reads the boundaries back from
``cu_seqlens_q`` and builds its row index per distinct document length; on CUDA each of those
index copies comes from pageable host memory and waits for the stream. ``packed_seq_params_for``
returns ``DocumentBounds``, whose row plan the first layer builds and the others reuse (one
asynchronous copy per micro-batch on CUDA).

Measured here: forward and backward of ``--layers`` attention modules (one rank, no projections,
so the attention itself is all there is) over micro-batches of packed lognormal documents, each
variant timed in alternating rounds; printed as median milliseconds per micro-batch and the ratio
per-layer / shared. Runs on CUDA when present (``--device``), else on CPU, where no copy waits
and only the host work of building the plans is saved.

    python scripts/bench/document_attention.py [--json] [--layers 24] [--seq-length 2048]
        [--micro-batch-size 2] [--rounds 15] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron.resihp.models.document_attention import DocumentCausalAttention, packed_seq_params_for  # noqa: E402
from resihp_ext.workload import LengthDistribution, sample_document_lengths  # noqa: E402
from tests.one_rank_world import one_rank_world  # noqa: E402

EOD = 0


def packed_tokens(batch: int, seq_length: int, rng: np.random.Generator) -> torch.Tensor:
    """``batch`` samples of packed documents with lognormal lengths (median 256), each ended by
    an EOD (a sample's last document is cut at its end)."""
    lengths = LengthDistribution.parse(f"lognormal:median=256,sigma=1.0,min=8,max={seq_length}")
    tokens = torch.from_numpy(rng.integers(1, 1000, (batch, seq_length)))
    for row in range(batch):
        position = -1
        while position < seq_length - 1:
            position = min(position + int(sample_document_lengths(rng, lengths, 1)[0]), seq_length - 1)
            tokens[row, position] = EOD
    return tokens


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The packed micro-batches and attention shape the attention benchmarks time, and --json."""
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def parse_shape_arguments(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Parse; exit with code 2 naming the flag when a size is below 1."""
    args = parser.parse_args(argv)
    for name in ("layers", "seq_length", "micro_batch_size", "heads", "head_dim", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def report(args: argparse.Namespace, result: dict, what: str, rows: list[tuple[str, str]]) -> None:
    """Print ``result`` as one JSON object (--json), or as a line saying what ran and ``rows``."""
    if args.json:
        print(json.dumps(result))
        return
    print(f"{what}, {args.layers} layers, {args.micro_batch_size} x {args.seq_length} tokens, "
          f"{result['distinct_lengths_median']} distinct document lengths per micro-batch (median), "
          f"{result['device']}, forward + backward:")
    for label, value in rows:
        print(f"  {label:<26}{value}")


def time_micro_batch(layers, x, params, device) -> float:
    """Seconds for a forward through ``layers`` (query, key and value all the last output) and the
    backward of a loss over the result. The mask type goes in by position: ours ignores it,
    Transformer Engine's attention needs it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = x
    for layer in layers:
        out = layer(out, out, out, None, AttnMaskType.causal, packed_seq_params=params).view_as(x)
    out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parse_shape_arguments(parser, argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; pass --device cpu")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as each CPU rank runs
    hidden = args.heads * args.head_dim
    config = TransformerConfig(num_layers=args.layers, hidden_size=hidden, num_attention_heads=args.heads,
                               attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True)
    rng = np.random.default_rng(0)
    with one_rank_world("nccl" if device.type == "cuda" else "gloo"):
        layers = [DocumentCausalAttention(config, n, AttnMaskType.causal, "self").to(device)
                  for n in range(1, args.layers + 1)]
        times = {"per_layer": [], "shared": []}
        distinct_lengths = []
        for round_ in range(args.rounds + 1):  # round 0 warms up
            tokens = packed_tokens(args.micro_batch_size, args.seq_length, rng)
            x = torch.randn(args.seq_length, args.micro_batch_size, args.heads, args.head_dim, device=device,
                            requires_grad=True)
            for name in (("shared", "per_layer") if round_ % 2 else ("per_layer", "shared")):
                params = packed_seq_params_for(tokens, EOD, device=device)  # from host tokens, as training does
                if name == "per_layer":  # megatron-core's own type: nowhere to keep a plan
                    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=params.cu_seqlens_q,
                                             cu_seqlens_kv=params.cu_seqlens_kv, max_seqlen_q=params.max_seqlen_q,
                                             max_seqlen_kv=params.max_seqlen_kv)
                seconds = time_micro_batch(layers, x, params, device)
                if round_:
                    times[name].append(seconds)
            distinct_lengths.append(layers[0].last_num_attention_calls)  # one call per distinct length
    per_layer, shared = statistics.median(times["per_layer"]), statistics.median(times["shared"])
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "layers": args.layers, "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
        "distinct_lengths_median": statistics.median(distinct_lengths),
        "per_layer_ms": round(1e3 * per_layer, 3), "shared_ms": round(1e3 * shared, 3),
        "ratio_per_layer_over_shared": round(per_layer / shared, 4),
    }
    report(args, result, "document attention", [
        ("row plan per layer", f"{result['per_layer_ms']:10.3f} ms per micro-batch"),
        ("one plan, shared", f"{result['shared_ms']:10.3f} ms per micro-batch"),
        ("ratio per-layer/shared", f"{result['ratio_per_layer_over_shared']:10.4f}"),
    ])
    return result


if __name__ == "__main__":
    main()
