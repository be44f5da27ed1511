"""tensorhooks.testing's insides: the random program generator and the checkers.

- `programs`: hypothesis strategies of random autograd programs, printable as Python.
- `checkers`: run a program with and without hooks (or a context) and compare gradients.
"""
