"""`python -m albert_jax.sweep`: see `albert_jax.sweep.runner`."""

from albert_jax.sweep.runner import run

run()
