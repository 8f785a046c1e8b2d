"""Backends: one forward of the target model, appending query tokens (a causal run or draft tree nodes) to
the KV cache. The Hugging Face forward for any causal LM (`forward`, with `kv_cache` compaction and
`tree_tensors`' ancestor masks and depths) and the lean Llama-family forward (`lean`) on goose's own
float32 kernels (`cpukernel`, `cpu_kernels.cpp`) and GGUF quantized-block kernels (`quant`,
`quant_kernels.cpp`). Returns logits for nodes.
"""
