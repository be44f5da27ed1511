"""``python -m tensorhooks plan``: the planner on the demo's tiny Llama, with a chart."""
