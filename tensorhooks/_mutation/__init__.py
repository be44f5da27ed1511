"""allow_mutation_on_saved_tensors: saved tensors cloned just before a write reaches them.

- `context`: the context manager (NOTE [Clone before write], the design as a whole).
- `context_state`: one context's state, its saved tensors indexed by storage (`MutationContext`).
- `saved_tensor`: what autograd stores for a saved tensor, and the check for unseen writes.
- `aliasing`: which saved tensors a write can reach (byte spans) and which share a clone.
- `dispatch_mode`: the dispatch mode that protects what an operator is about to write.
- `op_writes`: which arguments an operator writes, read once from its schema.
- `guarded_pairs`: user hooks pushed inside the context, wrapped to keep the protection.
- `foreign_hooks`: the takeover of torch's own saved-tensor hooks, and what they saved before.
"""

from .context import MutationContext, allow_mutation_on_saved_tensors

__all__ = ["MutationContext", "allow_mutation_on_saved_tensors"]
