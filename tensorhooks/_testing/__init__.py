"""tensorhooks.testing's insides: the random program generator and the checkers.

- `programs`: hypothesis strategies of random autograd programs, printable as Python.
- `drawing`: what a program's steps are drawn from (values, views, ops, writes).
- `regions`: the checkpoint regions of a program, of the kinds recomputation gets wrong.
- `hooked`: checkpoint regions drawn as modules, with hooks around ``checkpoint_module``.
- `reached`: values regions read through holders, changed between forward and backward.
- `stateful`: region steps over state kept in Python objects (masks, caches, ``.data``, lazy
  modules, rebound attributes, swapped layers, a parent module, BatchNorm).
- `compiled`: programs run inside ``torch.compile`` with a context entered inside.
- `checkers`: run a program with and without hooks, a context or a checkpoint; judge.
- `explained`: regions run as plain calls, noting what the program changed that they read.
- `rounding`: how far rounding may move a correct run's gradients, measured on the run.
- `modules`: the same check on a real model's forward and backward.
- `errors`: the errors of tensorhooks.testing.
"""
