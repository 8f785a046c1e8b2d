"""Loading: a model and its tokenizer from a packaged model, a local Hugging Face folder or a GGUF file
(`model`; GGUF weights dequantized once and cached, or kept as blocks for goose's quantized kernels).
Returns models from folders, GGUF files and packages.
"""
