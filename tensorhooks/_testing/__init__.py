"""tensorhooks.testing's insides: the random program generator and the checkers.

- `programs`: hypothesis strategies of random autograd programs, printable as Python.
- `drawing`: what a program's steps are drawn from (values, views, ops, writes).
- `regions`: the checkpoint regions of a program, of the kinds recomputation gets wrong.
- `hooked`: checkpoint regions drawn as modules, with hooks around ``checkpoint_module``.
- `compiled`: programs run inside ``torch.compile`` with a context entered inside.
- `checkers`: run a program with and without hooks, a context or a checkpoint; judge.
- `rounding`: how far rounding may move a correct run's gradients, measured on the run.
- `modules`: the same check on a real model's forward and backward.
- `errors`: the errors of tensorhooks.testing.
"""
