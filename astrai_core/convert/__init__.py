"""Other formats in and out: Hugging Face folders (hf), GGUF files for llama.cpp (gguf_export, gguf_import)."""
