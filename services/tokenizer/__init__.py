"""Tokenizer service: the model's Hugging Face tokenizer over gRPC."""
