"""What a model says about data: held-out metrics (metrics), DPO's reference log-probabilities (dpo_reference), and
the statistics of evaluation, free of torch (statistics)."""
