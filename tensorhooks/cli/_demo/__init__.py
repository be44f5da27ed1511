"""``python -m tensorhooks demo``: torch's contexts and tensorhooks', side by side.

A case is data (`case.Case`): the feature, the peer it is compared against, the situation in
words, and the function that runs the peer's side and tensorhooks' side. `cases.CASES` lists
them; `run.run_demo` runs them and `render.show_demo` walks the rows.

- `command`: the ``demo`` subcommand's arguments.
- `case`: what a case is, what it returns, and what every case shares (`Demo`).
- `hooks`: saved_tensors_hooks, disable_saved_tensors_hooks, register_multi_grad_hook.
- `activation_offload`: save_on_cpu.
- `mutation`: allow_mutation_on_saved_tensors.
- `distributed`: sync_gradients against DDP, on two processes.
- `checkpoint`: checkpoint against torch.utils.checkpoint.
- `parameter_offload`: offload_parameters.
- `cases`: the list of cases, in the order the demo shows them.
- `render`: the tables the demo prints.
- `run`: the demo from start to end.
"""
