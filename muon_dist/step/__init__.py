"""One step on a bound plan: stage, agree, run the bucket tasks, commit."""
