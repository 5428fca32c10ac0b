"""Model code (the Llama family) and its Hugging Face checkpoint loader."""
