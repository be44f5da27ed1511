"""``python -m tensorhooks explain``: what holds the tiny Llama's peak, the traps, a plan."""
