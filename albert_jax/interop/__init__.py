"""Other layouts of ALBERT's weights: the official TF1 checkpoints, HuggingFace's, the one name
table between them and ours, and unsharing / resharing the shared layers.
"""
