"""Rewards and scorers, on the floor below the rollout that calls them: reward functions by name
(``functions.py``), the one scorer registry (``scorers.py``), an online signal's scoring and the gather of every
rank's scores (``signals.py``), scalar-model scores of (prompt, response) pairs (``scalar.py``), the CVaR reward
and its shared config section type (``cvar.py``) and the shapes task's image rewards (``image.py``)."""
