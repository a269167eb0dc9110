"""The drafter: its layers, P-EAGLE, the TTT loss, export to vLLM's format, and the offline replay
of its drafting."""
