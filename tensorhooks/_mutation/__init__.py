"""allow_mutation_on_saved_tensors: saved tensors cloned just before a write reaches them."""

from .context import MutationContext, allow_mutation_on_saved_tensors

__all__ = ["MutationContext", "allow_mutation_on_saved_tensors"]
