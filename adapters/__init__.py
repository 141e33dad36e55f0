"""LoRA adapters as PEFT saves them: reading and checking a folder, and an adapter's identity (no torch)."""
