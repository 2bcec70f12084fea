"""Trained drafters: draft heads over the target's features (head.py) and their training
by self-distillation (train.py)."""
