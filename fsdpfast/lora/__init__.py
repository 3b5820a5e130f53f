"""PEFT LoRA checkpoints: split the adapters off the base model (plan), write them as adapter
folders or fuse them into the weights (--merge-lora), and verify both."""
