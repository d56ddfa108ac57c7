"""Each model family's forward on symbolic tensors, composed from parts that mirror Hugging Face modules."""
