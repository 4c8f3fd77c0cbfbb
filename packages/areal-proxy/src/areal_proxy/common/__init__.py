"""Leaf types every stage shares: the recorded interaction and session, the model's tokenizer."""
