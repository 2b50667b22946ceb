"""Weight loaders: GGUF files and HF directories, both yielding HF-named fp32 tensors."""
