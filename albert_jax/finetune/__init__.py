"""Fine-tuning: the run (`train.finetune_and_evaluate`), its settings (`settings`), the task
model (`task_model`: the objective's model half; its data half, `train.FineTuningData`, reads
`tasks.task_data.TaskData`), the pretrained init merged into it (`backbone_init`) and many
seeds in one program (`seeds`)."""
