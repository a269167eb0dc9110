"""What every part stands on: configuration, files, progress, rates, GPUs, and the layout of a
run's results. No torch, no other eaglet package."""
