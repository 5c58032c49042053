"""Pretraining: the run (`train.train_and_evaluate`), its settings read once from the config
(`settings`), what it prepares on disk (`prepare`: sources, tokenizer), the objective's model
half (`model_half`: the model, LAMB, MLM + SOP) and data half (`data_half`: the sharded stream
and the held-out set, evaluated by `heldout`)."""
