"""Synthetic data: ask the target every training prompt and keep exactly what it emitted.

Each finished sample is appended and flushed to ``<out>.partial.jsonl`` as soon as it
arrives, so an interrupted run resumes by prompt id: no finished sample is regenerated, lost
or duplicated. The final file appears atomically once every prompt has an answer or has
failed for good.
"""
