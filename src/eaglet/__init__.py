"""eaglet: train EAGLE-3 drafters."""
