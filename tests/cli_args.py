"""Command lines the tests share."""

# The smallest CPU job ``megatron.resihp.arguments.parse_args`` accepts: tests add the flags they
# are about to it.
TINY_CPU_ARGS = ("--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                 "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "64",
                 "--device", "cpu")
