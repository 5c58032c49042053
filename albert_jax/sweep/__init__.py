"""Sweeps: a grid of points (`grid`) run one after another or, where they share every shape,
as one program (`group`), each point's result gathered in one table (`table`); the command
line is `python -m albert_jax.sweep` (`runner`)."""
