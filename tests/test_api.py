"""The public surface: what ``tensorhooks`` exports, that it is documented, and its errors.

Also the surface the package shows torch: the names of `_torch_compat`, the one module that
touches torch's private API, and the module docstrings ``help()`` renders.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

import tensorhooks
import tensorhooks.testing
from tensorhooks._core import errors as _errors
from tensorhooks._core import torch_compat as _torch_compat

ROOT = Path(__file__).resolve().parent.parent
DOCS = "\n".join(page.read_text() for page in sorted((ROOT / "docs").glob("*.md")))

# ``tensorhooks.__all__``, pinned: adding or removing a public name is a decision made here too.
ALL = [
    "ActivationPlan",
    "ActivationPlanHandle",
    "BlockPlan",
    "CheckpointArgumentTypeError",
    "CheckpointArgumentValueError",
    "CheckpointError",
    "CheckpointPolicy",
    "CudaTransfer",
    "Explanation",
    "GradientEdge",
    "GradientSyncError",
    "GraphTaskError",
    "HeldTensor",
    "HookArgumentTypeError",
    "HookArgumentValueError",
    "InvalidHookArgumentError",
    "InvalidHookModeError",
    "InvalidOffloadOptionError",
    "InvalidSyncArgumentError",
    "Lint",
    "MutationContext",
    "MutationContextExitedError",
    "Node",
    "OffloadArgumentValueError",
    "OffloadCaptureError",
    "OffloadStats",
    "ParameterOffloadDeviceError",
    "ParameterOffloadHandle",
    "ParameterOffloadStateError",
    "ParameterOffloadTypeError",
    "ParameterOffloadValueError",
    "ParameterTransfer",
    "PlanArgumentTypeError",
    "PlanArgumentValueError",
    "PlanBudgetError",
    "PlanBudgetWarning",
    "PlanReport",
    "PlanStateError",
    "SavedTensorModifiedError",
    "StepProfile",
    "SyncArgumentTypeError",
    "SyncArgumentValueError",
    "TensorHooksError",
    "UnguardedHooksError",
    "allow_mutation_on_saved_tensors",
    "checkpoint",
    "create_selective_checkpoint_contexts",
    "disable_saved_tensors_hooks",
    "distributed",
    "explain",
    "get_gradient_edge",
    "increment_version",
    "is_recomputing",
    "live_graph_tasks",
    "offload_parameters",
    "plan_activations",
    "profile_step",
    "register_multi_grad_hook",
    "save_on_cpu",
    "saved_tensors_hooks",
]

# torch's own objects, re-exported unchanged (``import tensorhooks as graph`` works): torch
# documents them, and tensorhooks' pages only mention them.
FROM_TORCH = {
    "CheckpointError": torch.utils.checkpoint.CheckpointError,
    "CheckpointPolicy": torch.utils.checkpoint.CheckpointPolicy,
    "GradientEdge": torch.autograd.graph.GradientEdge,
    "Node": torch.autograd.graph.Node,
    "get_gradient_edge": torch.autograd.graph.get_gradient_edge,
    "increment_version": torch.autograd.graph.increment_version,
}

# The builtin each error also inherits: the one torch raises in the same situation. Every error
# class of ``tensorhooks.__all__`` and of ``tensorhooks.testing.__all__`` is listed under its
# class name (checked below, so a new class cannot be forgotten).
BUILTINS: dict[str, tuple[type[BaseException], ...]] = {
    "CheckArgumentValueError": (ValueError,),
    "CheckpointArgumentTypeError": (TypeError,),
    "CheckpointArgumentValueError": (ValueError,),
    "GradientMismatchError": (AssertionError,),
    "GradientSyncError": (RuntimeError,),
    "GraphTaskError": (RuntimeError,),
    "HookArgumentTypeError": (TypeError,),
    "HookArgumentValueError": (ValueError,),
    "MutationContextExitedError": (RuntimeError, AssertionError),
    "OffloadArgumentValueError": (ValueError,),
    "OffloadCaptureError": (RuntimeError,),
    "ParameterOffloadDeviceError": (RuntimeError,),
    "ParameterOffloadStateError": (RuntimeError,),
    "ParameterOffloadTypeError": (TypeError,),
    "ParameterOffloadValueError": (ValueError,),
    "PlanArgumentTypeError": (TypeError,),
    "PlanArgumentValueError": (ValueError,),
    "PlanBudgetError": (ValueError,),
    "PlanBudgetWarning": (UserWarning,),
    "PlanStateError": (RuntimeError,),
    "SavedTensorModifiedError": (RuntimeError,),
    "SyncArgumentTypeError": (TypeError,),
    "SyncArgumentValueError": (ValueError,),
    "TensorHooksError": (),
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


def exported_errors() -> dict[str, type[BaseException]]:
    """Every exception class tensorhooks exports (``__all__`` of the package and of testing)."""
    found: dict[str, type[BaseException]] = {}
    for module in (tensorhooks, tensorhooks.testing):
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) and issubclass(value, BaseException):
                found[name] = value
    return found


def directives(module: str) -> set[str]:
    """The names ``X`` of the ``::: module.X`` reference blocks on the pages of docs/."""
    return set(re.findall(rf"^::: {re.escape(module)}\.(\w+)$", DOCS, re.M))


def test_all_is_pinned() -> None:
    """``__all__`` is exactly the names listed here, sorted, each once."""
    assert tensorhooks.__all__ == ALL
    assert sorted(set(ALL)) == ALL


def test_all_names_resolve() -> None:
    """Every name of ``__all__`` is an attribute of the package."""
    missing = [name for name in tensorhooks.__all__ if not hasattr(tensorhooks, name)]
    assert missing == []


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


def test_torch_names_are_torch_objects() -> None:
    """The names re-exported from torch are torch's own objects, not copies."""
    for name, value in FROM_TORCH.items():
        assert getattr(tensorhooks, name) is value, name


@pytest.mark.parametrize("name", tensorhooks.__all__)
def test_public_name_is_documented(name: str) -> None:
    """Each public name of tensorhooks has a ``::: tensorhooks.Name`` reference block.

    torch's re-exported objects are torch's to document: a page mentions them. The distributed
    module is documented by its names (``::: tensorhooks.distributed.sync_gradients``).
    """
    if name in FROM_TORCH:
        assert re.search(rf"`{re.escape(name)}`", DOCS), f"no page of docs/ mentions {name}"
    elif name == "distributed":
        assert set(tensorhooks.distributed.__all__) <= directives("tensorhooks.distributed")
    else:
        assert name in directives("tensorhooks"), f"no `::: tensorhooks.{name}` in docs/*.md"


def test_testing_errors_are_documented() -> None:
    """The errors of tensorhooks.testing have their reference block too."""
    for name, cls in exported_errors().items():
        if cls.__module__ == "tensorhooks.testing":
            assert name in directives("tensorhooks.testing"), name


def test_every_exported_error_is_in_the_builtin_table() -> None:
    """Each exported error class (aliases under their class name) has its builtins listed here.

    torch's own ``CheckpointError`` is the one exported error that is not tensorhooks'.
    """
    ours = {cls.__name__ for name, cls in exported_errors().items() if name not in FROM_TORCH}
    assert ours == set(BUILTINS)


@pytest.mark.parametrize("name", sorted(exported_errors()))
def test_error_is_a_tensorhooks_error_and_its_builtin(name: str) -> None:
    """Each exported error is a TensorHooksError and an instance of the builtin torch raises."""
    cls = exported_errors()[name]
    if name in FROM_TORCH:
        assert not issubclass(cls, _errors.TensorHooksError)
        return
    if cls is _errors.TensorHooksError:
        assert cls.__bases__ == (Exception,)
        return
    error = cls("message")
    assert isinstance(error, _errors.TensorHooksError)
    assert str(error) == "message"
    assert cls.__name__ == ALIASES.get(name, name)
    builtins = BUILTINS[cls.__name__]
    assert builtins, f"{name} inherits no builtin"
    for builtin in builtins:
        assert isinstance(error, builtin), (name, builtin)


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_earlier_names_are_aliases(alias: str) -> None:
    """An earlier name is the same class as its new one, whose docstring says so."""
    canonical = ALIASES[alias]
    assert getattr(tensorhooks, alias) is getattr(tensorhooks, canonical)
    assert alias in (inspect.getdoc(getattr(_errors, canonical)) or "")


def test_errors_module_docstring_lists_every_class() -> None:
    """The docstring of ``_errors`` (the hierarchy at a glance) names every error class."""
    doc = _errors.__doc__ or ""
    for name in BUILTINS:
        assert re.search(rf"\b{name}\b", doc), f"{name} is not in the _errors docstring"


def test_sync_gradients_errors_are_not_named_after_hooks() -> None:
    """sync_gradients' argument errors are its own classes, not the hook APIs' ones."""
    for name in ("SyncArgumentTypeError", "SyncArgumentValueError"):
        cls = getattr(tensorhooks, name)
        assert not issubclass(cls, (tensorhooks.HookArgumentTypeError,))
        assert not issubclass(cls, (tensorhooks.HookArgumentValueError,))


def test_offload_parameters_errors_are_not_named_after_hooks() -> None:
    """offload_parameters' type error is its own class, and it raises it for a non-module."""
    assert not issubclass(tensorhooks.ParameterOffloadTypeError, tensorhooks.HookArgumentTypeError)
    with pytest.raises(
        tensorhooks.ParameterOffloadTypeError, match=r"module must be an nn\.Module, got 3"
    ):
        tensorhooks.offload_parameters(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"blocks\[0\] is 'block' of type str"):
        tensorhooks.offload_parameters(torch.nn.Linear(2, 2), blocks=["block"])  # type: ignore[list-item]


# --- The torch-compat module ---------------------------------------------------------------


def _bound_names(module: object) -> set[str]:
    """Public names a module binds itself (assignments, functions, classes), not its imports."""
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return {name for name in names if not name.startswith("_")}


def test_torch_compat_all_is_complete() -> None:
    """``_torch_compat.__all__`` lists every public name it binds, each once, sorted, resolvable."""
    exported = _torch_compat.__all__
    assert exported == sorted(set(exported), key=lambda name: (not name.isupper(), name))
    assert _bound_names(_torch_compat) - {"__all__"} <= set(exported)
    assert [name for name in exported if not hasattr(_torch_compat, name)] == []


def test_missing_torch_entry_names_the_release() -> None:
    """A missing entry fails the import naming itself and the release, not with AttributeError."""
    with pytest.raises(ImportError, match=r"torch\._C\._no_such_entry.*known on torch 9\.9"):
        _torch_compat._required(torch, "_C._no_such_entry", "9.9")
    assert _torch_compat._required(torch, "_C._current_graph_task_id", "2.4") is (
        _torch_compat.current_graph_task_id
    )


def test_supported_floor_is_pyprojects() -> None:
    """The floor named in compat errors is the one ``pyproject.toml`` declares."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.findall(r'^dependencies = \[.*"torch>=([\d.]+)"', pyproject, re.M)
    assert declared == [_torch_compat.SUPPORTED_FLOOR]


def test_node_and_storage_accessors() -> None:
    """Sequence numbers order nodes; the newest node is known; aliases share a storage key."""
    a = torch.ones(3, requires_grad=True)
    b = a * 2
    assert _torch_compat.is_newest_node(b.grad_fn)  # type: ignore[arg-type]
    c = b.exp()
    assert _torch_compat.sequence_nr(c.grad_fn) > _torch_compat.sequence_nr(b.grad_fn)  # type: ignore[arg-type]
    assert not _torch_compat.is_newest_node(b.grad_fn)  # type: ignore[arg-type]
    assert _torch_compat.storage_key(b[1:]) == _torch_compat.storage_key(b)
    assert _torch_compat.storage_key(b.clone()) != _torch_compat.storage_key(b)
    assert _torch_compat.storage_key(torch.eye(2).to_sparse()) is None


def test_operator_accessors() -> None:
    """An operator's schema says what it writes; its direct call gives what calling it gives."""
    add_ = torch.ops.aten.add_.Tensor
    schema = _torch_compat.op_schema(add_)
    assert schema.name == "aten::add_"
    assert schema.arguments[0].alias_info.is_write
    call = _torch_compat.op_call(torch.ops.aten.mul.Tensor)
    assert call is not torch.ops.aten.mul.Tensor  # OpOverload.__call__ skipped
    torch.testing.assert_close(call(torch.ones(2), torch.full((2,), 3.0)), torch.full((2,), 3.0))


# --- Module docstrings ----------------------------------------------------------------------


def test_no_note_block_in_a_module_docstring() -> None:
    """``# NOTE [...]`` blocks are comments, not docstring text (help() renders them as titles)."""
    package = ROOT / "tensorhooks"
    found = set()
    for path in package.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if re.search(r"^# NOTE \[", doc, re.M):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.add(".".join(parts))
    assert found == set()


def test_note_references_have_a_block() -> None:
    """Each ``NOTE [Title]`` a module docstring refers to is a ``# NOTE [Title]`` comment."""
    sources = {path: path.read_text() for path in (ROOT / "tensorhooks").rglob("*.py")}
    blocks = set()
    for text in sources.values():
        blocks |= set(re.findall(r"^# NOTE \[([^\]]+)\]", text, re.M))
    for path, text in sources.items():
        doc = ast.get_docstring(ast.parse(text)) or ""
        for title in re.findall(r"NOTE \[([^\]]+)\]", doc):
            assert title in blocks, (path.name, title)
