"""``python -m tensorhooks bench``: every feature against its torch counterpart, in one run.

Timed with the one harness (see NOTE [How tensorhooks times things]): every variant of the CPU
reference workload (fwd+bwd of 50 x Linear(64, 64) + ReLU, batch 8, one intra-op thread; also
under tensorhooks' and torch's non-reentrant checkpoint, one region per layer) and of a tiny
Llama/Mixtral-style transformer (`TinyLlama`) in interleaved rounds, ratios per round, medians
shown with their range; sync_gradients against DDP on two local gloo processes (unless
``--no-processes``); on CUDA a transformer stack under save_on_cpu (step time and peak activation
memory) and under offload_parameters (step time and peak device memory), each part skipped
without CUDA, saying so.

- `command`: the ``bench`` subcommand's arguments.
- `results`: what the bench measures, as records (options, targets, rows, the report).
- `cpu`: the CPU table's variants and rows.
- `sync`: sync_gradients against DDP on two processes.
- `cuda`: save_on_cpu and offload_parameters on a transformer stack.
- `report`: the Markdown report.
- `chart`: the chart.
- `run`: the bench from start to end.
"""
