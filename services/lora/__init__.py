"""LoRA adapters on the shared base model (issue: multi-LoRA per tenant); `adapter` checks one."""
