"""The process a run lives in: how it starts (`process_setup`: distributed init, devices,
memory) and ends (`cli`: one error line), its console (`console`), its claim on the workdir
(`workdir_lease`), preemption notices (`preemption`), the persistent compilation cache
(`compile_cache`) and the checkpoint folders read without JAX (`checkpoint_dirs`)."""
