"""The data a run makes and reads: prompts, the template check, the draft vocabulary, the shard
format."""
