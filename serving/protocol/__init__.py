"""Request bodies, one module per protocol (openai.py, anthropic.py) over the fields they share (base.py)."""
