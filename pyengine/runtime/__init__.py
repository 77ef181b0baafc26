"""Running the model: the model runner (metadata buffers -> model inputs, the KV pool),
CUDA graphs, device resolution and the memory probes of the KV capacity measurement."""
