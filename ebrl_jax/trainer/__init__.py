"""Training: PPO/GRPO losses, the train_step stage and checkpoints."""
