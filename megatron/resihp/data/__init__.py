"""Data for GPT pretraining: tokenizers, dataset building, batch helpers.

Responsible for everything between a corpus on disk (or a mock workload description) and the
token batches the forward step consumes. It decides nothing about parallel layouts.
"""
