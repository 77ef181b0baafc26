"""Tiny real checkpoints built offline (random weights, a trained byte-level BPE tokenizer),
for the tests, the benchmarks and the demo. Not needed to serve a real model."""
