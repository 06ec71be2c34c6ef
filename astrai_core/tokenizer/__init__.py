"""Text to token ids and back: the byte-level BPE and its special tokens (bpe), the chat format (chat)."""
