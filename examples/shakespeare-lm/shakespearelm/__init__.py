"""shakespearelm: LoRA fine-tuning of a small GPT-2 on Shakespeare's roles with Distributed Lion."""
