"""Cloud TPU slices as the TPU compiler sees them: slice names and topologies, and the collectives
of a compiled program.
"""
