"""What the scripts share and a learner need not read: one-line errors and flag checks (cli), folder
locks (lock), the training prompts and the sample store (data), timers and the kept-token map (metrics)."""
