"""vLLM: the server eaglet owns, its client, the hidden-states capture (its server options, the
prefill requests and the files the connector saves) and connector, the CPU plugin, and what
the engine supports."""
