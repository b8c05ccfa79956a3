"""Small models trained here (train.py), and the metric harness that judges folds on them (harness.py)."""
