"""The target model: resolving it, its checkpoint's tensors, and the states and head extraction
reads."""
