"""Ideas beyond the paper, one file each, each behind one of the seams of eviction.py:
a selection rule (EvictConfig.rule), a budget policy (EvictConfig.budgets), or the hooks and
decode steps every method already has. Nothing outside methods.py and the scripts names them;
deleting a file here removes its idea."""
