"""Ideas beyond the paper, one file each, each behind one of the seams of eviction.py: a selection
rule (EvictConfig.rule: span.py), a budget policy (EvictConfig.budgets: layer_budgets.py), or the
hooks and decode loop every method already has (decode.py, which keeps each method's decode-phase form
itself; chat.py, generate.py's chat, builds on it). Only methods.py and the scripts name them: deleting a
file and the lines that name it there removes its idea and leaves the rest working (tests/test_decode_evict.py
checks it for decode.py and chat.py).
Not yet true to the letter for span.py: eviction.Prefilled carries the prompt's ids and the rule's hook,
and Pool.smooth takes the run and the budgets, for it alone."""
