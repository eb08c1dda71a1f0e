"""Trainer loops (GRPO, EBFT), rollout producer, reward runner, checkpointing and logging."""
