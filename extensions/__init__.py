"""Ideas beyond the paper, one file each. Each wraps any method, as kvpress's wrappers wrap any press:
span.py's Spanned wraps a method's scorer (its prefill watched for the hidden states too, its scores
smoothed before the method's own eviction step); layer_budgets.py is a budget policy any scorer takes
(EvictConfig.budgets); layer_loss.py's LayerWeightedKL wraps the paper's kl_loss, layer by layer, for
train.py --loss-weights; answer_weights.py makes a data folder whose targets weigh the answer tokens
that need the prompt (train.py --data reads it as any data stage's folder); decode.py's DecodeEviction
runs any method's scorer again while the answer grows (the decode-phase form of each method is
decode.py's own); chat.py, generate.py's chat, builds on it.
Only methods.py and the scripts name them: deleting a file and the lines that name it there removes its
idea and leaves the rest working (tests/test_decode_evict.py checks it for decode.py and chat.py)."""
