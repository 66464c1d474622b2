"""Tokenizers, the default corpus, indexed datasets and the GPT sample stream."""
