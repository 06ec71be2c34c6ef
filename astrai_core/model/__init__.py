"""The model: its shape (config), the decoder itself (transformer), low-rank adapters (lora) and the losses, pure
functions of tensors (losses)."""
