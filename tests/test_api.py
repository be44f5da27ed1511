"""The public surface: what ``tensorhooks`` exports, that it is documented, and its errors."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import tensorhooks
from tensorhooks import _errors

ROOT = Path(__file__).resolve().parent.parent
DOCS = "\n".join(page.read_text() for page in sorted((ROOT / "docs").glob("*.md")))

# Names that must be public today. Names added later need not be listed here: every name of
# ``tensorhooks.__all__`` is checked by the tests below.
REQUIRED = {
    "GradientSyncError",
    "GraphTaskError",
    "HookArgumentTypeError",
    "HookArgumentValueError",
    "InvalidHookArgumentError",
    "InvalidHookModeError",
    "InvalidOffloadOptionError",
    "InvalidSyncArgumentError",
    "MutationContext",
    "MutationContextExitedError",
    "OffloadArgumentValueError",
    "SavedTensorModifiedError",
    "SyncArgumentTypeError",
    "SyncArgumentValueError",
    "TensorHooksError",
    "UnguardedHooksError",
    "allow_mutation_on_saved_tensors",
    "disable_saved_tensors_hooks",
    "distributed",
    "live_graph_tasks",
    "register_multi_grad_hook",
    "save_on_cpu",
    "saved_tensors_hooks",
}

# The builtin each error also inherits: the one torch raises in the same situation.
BUILTINS: dict[str, tuple[type[BaseException], ...]] = {
    "GradientSyncError": (RuntimeError,),
    "GraphTaskError": (RuntimeError,),
    "HookArgumentTypeError": (TypeError,),
    "HookArgumentValueError": (ValueError,),
    "MutationContextExitedError": (RuntimeError, AssertionError),
    "OffloadArgumentValueError": (ValueError,),
    "SavedTensorModifiedError": (RuntimeError,),
    "SyncArgumentTypeError": (TypeError,),
    "SyncArgumentValueError": (ValueError,),
    "UnguardedHooksError": (RuntimeError,),
}
# Earlier public names, kept as aliases of the same classes.
ALIASES = {
    "InvalidHookArgumentError": "HookArgumentTypeError",
    "InvalidHookModeError": "HookArgumentValueError",
    "InvalidOffloadOptionError": "OffloadArgumentValueError",
    "InvalidSyncArgumentError": "SyncArgumentValueError",
}


def error_classes() -> dict[str, type[BaseException]]:
    """Every exception class ``_errors`` exports, by the name it is exported under."""
    return {
        name: value
        for name, value in vars(_errors).items()
        if name in _errors.__all__ and inspect.isclass(value)
    }


def test_all_is_sorted_and_unique() -> None:
    """``__all__`` is sorted and lists each name once."""
    assert tensorhooks.__all__ == sorted(set(tensorhooks.__all__))


def test_all_names_resolve() -> None:
    """Every name of ``__all__`` is an attribute of the package."""
    missing = [name for name in tensorhooks.__all__ if not hasattr(tensorhooks, name)]
    assert missing == []


def test_required_names_are_public() -> None:
    """The names public today stay in ``__all__``."""
    assert REQUIRED - set(tensorhooks.__all__) == set()


def test_every_public_error_is_exported() -> None:
    """Each class of ``_errors`` is public, under the same name."""
    for name, cls in error_classes().items():
        assert name in tensorhooks.__all__, name
        assert getattr(tensorhooks, name) is cls


def test_star_import_gives_all() -> None:
    """``from tensorhooks import *`` binds exactly ``__all__``."""
    namespace: dict[str, object] = {}
    exec("from tensorhooks import *", namespace)  # what a user's star import binds
    assert sorted(name for name in namespace if name != "__builtins__") == tensorhooks.__all__


@pytest.mark.parametrize("name", tensorhooks.__all__)
def test_public_name_is_documented(name: str) -> None:
    """Each public name appears, as a word, on a page of docs/."""
    assert re.search(rf"\b{re.escape(name)}\b", DOCS), f"{name} is not in docs/*.md"


@pytest.mark.parametrize("name", sorted(error_classes()))
def test_error_is_a_tensorhooks_error_and_its_builtin(name: str) -> None:
    """Each error is a TensorHooksError and an instance of the builtin torch raises there."""
    cls = error_classes()[name]
    if cls is _errors.TensorHooksError:
        assert cls.__bases__ == (Exception,)
        return
    error = cls("message")
    assert isinstance(error, _errors.TensorHooksError)
    assert isinstance(error, (RuntimeError, ValueError, TypeError, AssertionError))
    assert str(error) == "message"
    canonical = ALIASES.get(name, name)
    assert cls.__name__ == canonical
    for builtin in BUILTINS.get(canonical, ()):
        assert isinstance(error, builtin), (name, builtin)


def test_known_errors_keep_their_builtins() -> None:
    """The errors public today exist, with the builtins pinned above."""
    assert set(BUILTINS) | set(ALIASES) <= set(error_classes())


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_earlier_names_are_aliases(alias: str) -> None:
    """An earlier name is the same class as its new one, whose docstring says so."""
    canonical = ALIASES[alias]
    assert getattr(tensorhooks, alias) is getattr(tensorhooks, canonical)
    assert alias in (inspect.getdoc(getattr(_errors, canonical)) or "")


def test_sync_gradients_errors_are_not_named_after_hooks() -> None:
    """sync_gradients' argument errors are its own classes, not the hook APIs' ones."""
    for name in ("SyncArgumentTypeError", "SyncArgumentValueError"):
        cls = getattr(tensorhooks, name)
        assert not issubclass(cls, (tensorhooks.HookArgumentTypeError,))
        assert not issubclass(cls, (tensorhooks.HookArgumentValueError,))
