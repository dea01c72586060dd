"""Tooling around the runtime, never imported by it: the process launcher (``launcher``), the router in front of
several servers (``router``), the load generator (``bench_load``), and the model builders (real checkpoints
dequantized from their GGUF files: ``pretrained``; tiny random models per family: ``tiny_model``,
``tiny_families``; the recall model trained here: ``recall_model``) with the real-text tasks (``text_tasks``)."""
