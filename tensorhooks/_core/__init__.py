"""The core every feature stands on; it imports no feature.

- `torch_compat`: every private torch entry point, with the release it is known on.
- `errors`: the one hierarchy of errors (one class per feature and failure).
- `store`: the graph-task store, per-backward state keyed by the autograd graph task.
- `guards`: save guards (what pack recorded, checked at unpack) and saved copies.
- `graph`: the names of ``torch.autograd.graph`` that tensorhooks re-exports as they are.
- `compile`: how contexts behave under ``torch.compile``.
- `late_grads`: parameters whose ``.grad`` lands at the end of backward.
- `blocks`: the blocks of a model (its repeated children) and the checks of a block list.
- `moves`: a tensor's data swapped for an equal copy, counted for the checks of storages.
"""
