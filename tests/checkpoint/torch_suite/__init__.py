"""PyTorch's own checkpoint tests, run against torch.utils.checkpoint and tensorhooks.checkpointing.

One module per source file of PyTorch's test suite. Every test takes the checkpoint module as
``ckpt`` and runs once with each implementation, so a test that passes with torch and fails with
tensorhooks is a broken promise of "change one import line": a bug, or a difference listed on
docs/differences.md, which the test then asserts by name.
"""
