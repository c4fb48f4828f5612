"""The memory planner: what a run needs per device, and the strategy that fits.

Two floors (tests/unit/rules/test_layer_order.py): the estimator arithmetic (``model_dims``, ``pipeline_dims``,
``activations``, ``plan``, ``plan_report``: pure numbers from model dimensions, no model built) sits below
the model kinds, which read their dimensions with it; the planner proper (``auto``, ``preflight``) reads a
run config, asks the kinds for their dimensions and picks the strategy that ``distributed/strategy/`` builds.
"""
