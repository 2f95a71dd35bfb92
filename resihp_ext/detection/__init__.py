"""Detection: from per-rank op timings to verdicts about slow or dead devices and links.

Responsible for the micro-batch cost model and iteration predictor, the simulator of a schedule's
dependency DAG, the signals the fail-slow detector judges, suspicions, probe rounds and their
verdicts, and the trace format live runs record. Pure like the rest of ``resihp_ext``: it never
imports ``megatron``, ``torch.distributed`` or anything that needs a process group.
"""
