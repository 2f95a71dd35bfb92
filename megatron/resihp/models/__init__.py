"""Model building blocks the fork adds to megatron-core's GPT (document attention)."""
