"""pyengine: an embedded, single-process LLM inference engine."""
