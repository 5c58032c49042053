"""ALBERT as Flax modules: the model config, its layers, the encoder and pretraining heads, the
fine-tuning heads and the analytic FLOPs.
"""
