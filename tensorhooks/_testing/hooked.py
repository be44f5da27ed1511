"""Module regions: a region's body as a module's forward, checkpointed per module, with hooks.

See NOTE [Checkpointed modules and their hooks].
"""

from __future__ import annotations

from hypothesis import strategies as st

__all__ = ["FORWARD_HOOKS", "PRE_HOOKS", "REGISTRATIONS", "module_region"]

# NOTE [Checkpointed modules and their hooks]
#
# With the region kind "module", a region is drawn half the time as a module: its body is the
# ``forward`` of a class defined in the program, its arguments are passed positionally or (all
# but the first) by keyword, and ``checkpoint_module(module)`` checkpoints it from its hooks, as
# torch's composable ``checkpoint(module)`` does (``checkpoint_module`` is
# ``tensorhooks.checkpointing.checkpoint_module`` as printed; a checker may bind torch's, or
# leave the module plain for the reference). Zero to three hooks are registered on it, each
# drawn from PRE_HOOKS or FORWARD_HOOKS (changing the arguments, the keyword arguments or the
# output, or returning them as they are, or nothing) and registered in one of REGISTRATIONS:
# before ``checkpoint_module`` (the hook then runs inside the region), after it, after it with
# ``prepend=True`` (it runs before the region begins), or as a global module hook
# (``torch.nn.modules.module.register_module_forward_pre_hook``, acting on this module only and
# removed when the program ends, in a ``finally``). A pre-hook that changes the arguments runs
# again in recomputation: run inside the region, that is right; run before it, the region is
# recomputed on arguments changed twice. The right results are plain autograd's, or a raised
# tensorhooks error.

# (the hook's lambda, its registration's keyword) by what the hook does
PRE_HOOKS = {
    "args": ("lambda m, args: tuple(a * 2.0 for a in args)", ""),
    "same": ("lambda m, args: args", ""),
    "none": ("lambda m, args: None", ""),
    "kwargs": (
        "lambda m, args, kwargs: (args, {k: v * 1.5 for k, v in kwargs.items()})",
        "with_kwargs=True",
    ),
    "both": (
        "lambda m, args, kwargs: (tuple(a + 0.5 for a in args), kwargs)",
        "with_kwargs=True",
    ),
}
FORWARD_HOOKS = {
    "output": ("lambda m, args, out: out * 1.5", ""),
    "reads": ("lambda m, args, out: out + args[0].sum()", ""),
    "none": ("lambda m, args, out: None", ""),
    "kwargs": ("lambda m, args, kwargs, out: out - 0.25", "with_kwargs=True"),
}
REGISTRATIONS = ("before", "after", "prepend", "global")


def module_region(
    draw: st.DrawFn, name: str, parameters: list[str], arguments: list[str], body: list[str]
) -> tuple[list[str], str, bool]:
    """The lines defining, hooking and checkpointing region ``name`` as a module; its call.

    Returns the lines, the call's expression, and whether a global hook was registered (the
    program then removes it in a ``finally``).
    """
    number = name.removeprefix("region")
    cls, module = f"Region{number}", f"module{number}"
    lines = [
        f"class {cls}(torch.nn.Module):",
        f"    def forward(self, {', '.join(parameters)}):",
        *(f"        {line}" for line in body),
        "",
        f"{module} = {cls}()",
    ]
    before: list[str] = []
    after: list[str] = []
    global_hooks = False
    for _ in range(draw(st.integers(0, 3))):
        pre = draw(st.booleans())
        hooks = PRE_HOOKS if pre else FORWARD_HOOKS
        hook, keyword = hooks[draw(st.sampled_from(sorted(hooks)))]
        where = draw(st.sampled_from(REGISTRATIONS))
        if where == "global" and pre and keyword:
            where = "after"  # a global pre-hook takes no keyword arguments
        if where == "global":
            global_hooks = True
            kind = "pre_hook" if pre else "hook"
            condition = hook.replace(": ", f": None if m is not {module} else (", 1) + ")"
            extra = f", {keyword}" if keyword else ""
            after.append(
                "handles.append(torch.nn.modules.module."
                f"register_module_forward_{kind}({condition}{extra}))"
            )
            continue
        options = [keyword] if keyword else []
        if where == "prepend":
            options.append("prepend=True")
        method = "register_forward_pre_hook" if pre else "register_forward_hook"
        line = f"{module}.{method}({', '.join([hook, *options])})"
        (before if where == "before" else after).append(line)
    lines += [*before, f"checkpoint_module({module})", *after]
    n_keywords = draw(st.integers(0, len(arguments) - 1))
    positional = arguments[: len(arguments) - n_keywords]
    keywords = [
        f"{parameter}={argument}"
        for parameter, argument in zip(
            parameters[len(positional) :], arguments[len(positional) :], strict=True
        )
    ]
    return lines, f"{module}({', '.join([*positional, *keywords])})", global_hooks
