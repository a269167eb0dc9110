"""vLLM: the server eaglet owns, its client, the hidden-states capture, the CPU plugin, extraction
through the engine."""
