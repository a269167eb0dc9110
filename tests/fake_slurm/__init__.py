"""A fake SLURM for the cluster tests (see fake_slurm.py)."""
