"""Resilient GPT pretraining: a drop-in for Megatron-LM's ``pretrain_gpt.py``.

Launch it as you launch Megatron (``torchrun ... pretrain_gpt_resilient.py $ARGS``) and add
``--resihp-*`` flags for detection and in-place adaptation. Megatron-LM's own training loop runs
the job (``megatron.training.pretrain``); ``megatron/resihp/gpt_pretrain.py`` supplies the GPT
model, forward step and datasets, and ``megatron/resihp/megatron_loop_resilience.py`` the
resilience around Megatron's step.
"""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

if __name__ == "__main__":
    # Here, not at the top: a process that multiprocessing's spawn starts (megatron-core's
    # checkpoint writer starts one per rank) runs this file's top level again, and this import
    # costs seconds of CPU. A launcher's fork server imports it all the same (it reads this block).
    from megatron.resihp.gpt_pretrain import main

    main()
