"""The parts of the GPU runner, ``benchmarks/gpu.py``: one module per part, and the machinery.

Machinery (imports no torch, so the runner's own process stays light and cannot hang in CUDA):
``record`` (what a part writes: tables, targets, numbers), ``process`` (a command under a time
limit), ``report`` (the Markdown report), ``runner`` (the schedule and the command line).
Parts (each runs in a process of its own, started by the runner): ``environment``,
``cuda_tests``, ``activation_offload``, ``checkpointing``, ``parameter_offload``,
``gradient_sync``, ``planner``; ``common`` holds what several parts measure with.
"""
