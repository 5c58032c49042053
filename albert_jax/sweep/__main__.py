"""`python -m albert_jax.sweep`: see `albert_jax.sweep.runner`."""

from absl import flags

from albert_jax.sweep import runner

__doc__ = runner.__doc__  # what absl's --help prints: the main module's docstring

runner.define_flags()
flags.adopt_module_key_flags(runner)  # and the main module's flags: the runner's
runner.run()
